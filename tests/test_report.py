"""The run report: the launch record (every attempt, what the cluster ran on, what it cost — also when no launch
succeeded: failover attaches its attempts to the error it raises), checkpoints, recoveries, and where step time
went with the predictor's what-if rows."""

from __future__ import annotations

import logging

import pytest

from infra.analysis.breakdown import StepBreakdown
from infra.compute.failover import Attempt, NoCapacityAnywhere
from infra.job.summary import RunSummary
from tasks.report import _attempt_rows, _markdown, _what_if_rows, record_failure, record_resume
from tasks.results import Restored


def attempt(zone: str, outcome: str, error: str | None = None) -> Attempt:
    return Attempt(candidate=f"aws/p5.48xlarge/{zone}/spot", instance_type="p5.48xlarge", region="us-east-1",
                   zone=zone, market="spot", outcome=outcome, error=error, seconds=1.5)


def test_a_launched_cluster_is_priced_over_the_billed_phases_only() -> None:
    summary = RunSummary(run_id="r1", job="j", provider="aws", nodes=2)
    summary.phases = {"plan": 1000.0, "provision": 600.0, "train": 2400.0, "teardown": 600.0}
    tried = [attempt("us-east-1a", "capacity", "InsufficientInstanceCapacity"), attempt("us-east-1b", "launched")]
    summary.record_launch("p5.48xlarge", "spot", 40.0, [a.to_dict() for a in tried])
    summary.finish()

    assert summary.cost_usd == pytest.approx(40.0 * 3600 / 3600), "plan time is not billed"
    assert "2× p5.48xlarge (spot) in us-east-1b after 2 launch attempt(s), $40.00/h, cost $40.0000" in summary.render()
    markdown = _markdown(summary, [])
    assert "## Launch attempts" in markdown
    assert "| p5.48xlarge | us-east-1 | us-east-1a | spot | capacity | 1.5 | InsufficientInstanceCapacity |" in markdown
    assert "cost **$40.0000**" in markdown


def test_a_launch_that_failed_everywhere_still_reports_its_attempts() -> None:
    summary = RunSummary(run_id="r2", job="j", provider="aws", nodes=2)
    tried = [attempt("us-east-1a", "capacity", "InsufficientInstanceCapacity"),
             attempt("us-east-1b", "capacity", "InsufficientInstanceCapacity")]
    record_failure(summary, NoCapacityAnywhere("no candidate launched", tried))
    summary.finish()

    assert summary.status == "failed" and summary.error == "NoCapacityAnywhere: no candidate launched"
    assert [row["outcome"] for row in _attempt_rows(summary)] == ["capacity", "capacity"]
    assert summary.cost_usd is None, "nothing launched, nothing priced"
    assert "nothing launched after 2 launch attempt(s)" in summary.render()


def test_checkpoints_get_a_fact_and_a_table() -> None:
    summary = RunSummary(run_id="r3", job="j", provider="local", nodes=2)
    summary.checkpoints = [
        {"step": 50, "mode": "async", "stall_s": 0.04, "write_s": 0.9, "upload_s": 0.5, "upload_mb_per_s": 300.0,
         "commit_s": 0.7, "local_bytes": 1},
        {"step": 100, "mode": "async", "stall_s": 0.06, "write_s": 0.8, "upload_s": 0.4, "upload_mb_per_s": 350.0,
         "commit_s": 0.6, "local_bytes": 1},
    ]
    markdown = _markdown(summary, [(1, 5.0), (100, 2.0)])
    assert "2 checkpoints (async): training stalled 0.050 s per checkpoint, uploaded at 300–350 MB/s" in markdown
    assert "## Checkpoints" in markdown
    assert "| step | mode | stall_s | write_s | upload_s | upload_mb_per_s | commit_s |" in markdown
    assert "| 100 | async | 0.06 | 0.8 | 0.4 | 350.0 | 0.6 |" in markdown


def test_recoveries_get_a_table_with_the_time_split() -> None:
    summary = RunSummary(run_id="r4", job="j", provider="local", nodes=2)
    summary.recoveries = [{"number": 1, "node": "n1", "reason": "chaos: spot notice", "with_notice": True,
                           "step_reached": 70, "detected_at": 0.0, "resumed_from_step": 72, "steps_lost": 0,
                           "notice_to_resume_s": 2.5, "extra_cost_usd": 0.0, "reused_bytes": 400,
                           "path": "relaunched-cluster",
                           "seconds": {"teardown": 0.1, "provision": 0.2, "verify": 0.5, "stage": 1.0,
                                       "restore": 0.6}}]
    markdown = _markdown(summary, [])
    assert "## Recoveries from preemption" in markdown
    assert ("| 1 | n1 | relaunched-cluster | chaos: spot notice | 70 | 72 | 0 | 2.5 | 0.0 | 400 | 0.1 | 0.2 | 0.5 | "
            "1.0 | 0.6 |") in markdown


def test_a_recovery_that_never_resumed_is_rendered_as_such() -> None:
    """A recovery that failed before training restarted (no capacity left, the deadline) has no resume figures: the
    summary says so instead of failing to render the run's end."""
    summary = RunSummary(run_id="r5", job="j", provider="azure", nodes=2, status="failed")
    summary.recoveries = [{"number": 1, "node": "n1", "reason": "vanished", "with_notice": False,
                           "step_reached": 40, "detected_at": 0.0, "resumed_from_step": None, "steps_lost": None,
                           "notice_to_resume_s": None, "path": "relaunched-cluster", "fallback": "no capacity"}]
    assert "recovery 1: n1 preempted (vanished) at step 40, relaunched-cluster (no capacity), did not resume" \
        in summary.render()


def test_the_step_breakdown_gets_a_fact_a_table_and_what_if_rows() -> None:
    summary = RunSummary(run_id="r5", job="j", provider="local", nodes=2)
    summary.breakdown = StepBreakdown(
        steps=100, wall_s=50.0, comm_exposed_s=30.0, comm_total_s=30.0, sync_wait_s=1.0, data_wait_s=4.0,
        ckpt_block_s=1.0, allreduce_bytes=100 * 4_000_000, read_bytes=100 * 1040, read_requests=800, ckpt_bytes=5,
        ckpt_saves=1, world_size=2, nodes=2).summary()
    summary.stage = {"bytes": 40_000_000, "skipped_bytes": 0, "mb_per_s": 100.0, "seconds": 0.4}

    assert "compute 28%, network 62%, I/O 10% (network-bound: 62% of step time" in summary.render()
    markdown = _markdown(summary, [])
    assert "step time: **network-bound: 62% of step time in exposed all-reduce and sync**; 4.00 MB all-reduced" \
        in markdown
    assert "| T_network | 31.0 | 310.0 | 62.0 |" in markdown, "seconds, ms per step, share"
    what_if = {row["scenario"]: row for row in _what_if_rows(summary)}
    assert what_if["as measured"]["step s"] == pytest.approx(0.5)
    # No overlap measured, so 2× bandwidth halves the exposed all-reduce: 0.5 − 0.15 s per step.
    assert what_if["2× network"]["step s"] == pytest.approx(0.35)
    assert "## What if" in markdown


def test_a_run_that_trained_no_step_has_no_what_if() -> None:
    summary = RunSummary(run_id="r6", job="j", provider="local", nodes=2)
    summary.breakdown = StepBreakdown(
        steps=0, wall_s=0.0, comm_exposed_s=0.0, comm_total_s=0.0, sync_wait_s=0.0, data_wait_s=0.0,
        ckpt_block_s=0.0, allreduce_bytes=0, read_bytes=0, read_requests=0, ckpt_bytes=0, ckpt_saves=0).summary()
    assert _what_if_rows(summary) == []


def test_a_resume_says_where_its_checkpoint_bytes_came_from() -> None:
    """Each node's restore reports its bytes by source; the run's and each recovery's are the cluster's sums."""
    summary = RunSummary(run_id="r5", job="j", provider="local", nodes=2)
    restores = [Restored(step=40, path="/a", sources={"store": 0, "peer": 30_000_000, "local": 10_000_000}),
                Restored(step=40, path="/b", sources={"store": 0, "peer": 0, "local": 40_000_000})]
    record_resume(summary, restores, logging.getLogger("test"))
    assert summary.resume_bytes == {"store": 0, "peer": 30_000_000, "local": 50_000_000}
    assert "(resumed from step 40; 30.0 MB from peers, 50.0 MB already on the nodes)" in summary.render()
    summary.recoveries = [{"number": 1, "node": "n1", "reason": "vanished", "with_notice": False, "step_reached": 50,
                           "detected_at": 0.0, "resumed_from_step": 40, "steps_lost": 10, "notice_to_resume_s": 3.0,
                           "extra_cost_usd": 0.0, "reused_bytes": 0, "path": "replaced-nodes",
                           "restore_bytes": {"store": 2_000_000, "replica": 8_000_000}, "seconds": {}}]
    assert "10 steps redone; restore 2.0 MB from the store, 8.0 MB from peer replicas" in summary.render()
    assert "| restore store MB | restore peer MB | restore local MB | restore replica MB |" in _markdown(summary, [])
    assert "| 2.0 |  |  | 8.0 |" in _markdown(summary, [])
