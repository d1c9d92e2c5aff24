"""The recovery half of `bench staging`: its arithmetic and its report, on synthetic counters and summaries.

The bench itself runs the retrain flow twice on a 4-node netns cluster (minutes, root): `trainpipe bench staging
--no-staging`; what is tested here is how it turns the store's sampled counter and a run's recovery record into the
table's figures, and the job it builds for each path."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench.recovery import (
    RECORDED,
    RecoveryBenchConfig,
    RecoveryBenchReport,
    RecoveryRun,
    StoreMeter,
    bytes_between,
    job_for,
    measured_run,
    replace_supported,
)
from infra.analysis.predict import Recovery

MB = 10**6
# The store's tx counter: 100 MB/s from t=100 to t=110, idle before and after.
SAMPLES = [(90.0, 0), (100.0, 0), (105.0, 500 * MB), (110.0, 1000 * MB), (130.0, 1000 * MB)]


@pytest.mark.parametrize(("start", "end", "sent"), [
    (100.0, 110.0, 1000 * MB),  # the whole burst
    (102.5, 107.5, 500 * MB),  # interpolated at both ends
    (80.0, 101.0, 100 * MB),  # before the first sample: held at it
    (108.0, 200.0, 200 * MB),  # after the last: held at it
    (111.0, 120.0, 0),
])
def test_bytes_between_interpolates_the_sampled_counter(start: float, end: float, sent: int) -> None:
    assert bytes_between(SAMPLES, start, end) == sent


def test_the_meter_samples_until_it_is_closed() -> None:
    reads = iter(range(0, 10**9, 1000))
    with StoreMeter(lambda: next(reads), every=0.01) as meter:
        while len(meter.samples) < 3:
            pass  # the meter's thread appends; the first sample is taken on entry
    times = [t for t, _ in meter.samples]
    assert times == sorted(times) and meter.samples[-1][1] > meter.samples[0][1]
    assert meter.between(times[0], times[-1]) == meter.samples[-1][1] - meter.samples[0][1]


def record(detected_at: float, resume_s: float, first_s: float | None, path: str | None) -> dict[str, object]:
    fields: dict[str, object] = {
        "number": 1, "node": "node-2", "reason": "chaos: spot notice", "with_notice": True, "step_reached": 32,
        "detected_at": detected_at, "resumed_from_step": 30, "seconds": {"teardown": 1.0, "provision": 2.0},
        "reused_bytes": 24 * MB, "notice_to_resume_s": resume_s, "steps_lost": 2, "time_to_first_step_s": first_s}
    if path is not None:
        fields["path"] = path
    return fields


def test_a_runs_store_bytes_run_from_the_detection_to_the_first_step_after_it() -> None:
    meter = StoreMeter(lambda: 0)
    meter.samples = list(SAMPLES)
    summary = {"status": "completed", "recoveries": [record(100.0, 5.0, 8.0, RECORDED["cluster"])]}
    run = measured_run("cluster", "r1", summary, meter, lambda summary, step: step * MB)
    assert (run.store_bytes, run.store_bytes_to_resume) == (800 * MB, 500 * MB)
    assert (run.took, run.checkpoint_bytes, run.resumed_from_step) == ("relaunched-cluster", 30 * MB, 30)
    with pytest.raises(RuntimeError, match="path nodes: run r2 failed with 0 recoveries: boom"):
        measured_run("nodes", "r2", {"status": "failed", "error": "boom"}, meter)


def run(path: str, resume_s: float, store_mb: int) -> RecoveryRun:
    return RecoveryRun(path=path, run_id=f"run-{path}", took=RECORDED[path], detect_to_resume_s=resume_s,
                       detect_to_first_step_s=resume_s + 4, store_bytes=store_mb * MB,
                       store_bytes_to_resume=store_mb * MB, checkpoint_bytes=40 * MB, resumed_from_step=30,
                       steps_lost=2, reused_bytes=0, seconds={"provision": 1.5})


def test_the_report_sets_replace_one_against_the_whole_relaunch_and_the_targets() -> None:
    report = RecoveryBenchReport(RecoveryBenchConfig(), dataset_bytes=60 * MB,
                                 runs=[run("cluster", 40.0, 100), run("nodes", 16.0, 4)])
    ratios = report.ratios()
    assert ratios is not None
    assert ratios["resume_nodes_cluster"] == pytest.approx(0.4)
    assert ratios["first_step_nodes_cluster"] == pytest.approx(20 / 44)
    assert ratios["store_share_nodes"] == pytest.approx(0.04)  # 4 MB of 60 + 40
    assert report.meets_targets()
    table = report.table()
    assert "replaced-nodes" in table and "0.40×" in table and "4.0%" in table and "meets the targets" in table
    assert "before them (stopping the rest, last uploads) 14.5 s" in table  # 16 s less the 1.5 s of its phases
    # The model on the bench's links (node 2 Gbit/s, store 0.4 Gbit/s): replace-one moves dataset + checkpoint
    # (100 MB) over the new node's link and reads the lost node's quarter of the checkpoint (10 MB) once.
    # The new node takes all 100 MB from its peers, the lost part from its neighbour's replica: no store byte.
    assert report.model(report.runs[1]) == Recovery(pytest.approx(100 * MB / 250e6), 0)
    assert report.model(report.runs[0]).store_bytes == 100 * MB  # fan-out on: the whole relaunch reads it once
    figures = json.loads(report.to_json())
    assert figures["ratios"] == ratios and figures["meets_targets"] is True

    slow = RecoveryBenchReport(RecoveryBenchConfig(), dataset_bytes=60 * MB,
                               runs=[run("cluster", 40.0, 100), run("nodes", 30.0, 4)])
    assert slow.meets_targets() is False and "DOES NOT meet" in slow.table()

    fell_back = replace(run("nodes", 40.0, 100), took=RECORDED["cluster"], fallback="no capacity in the zone")
    assert "relaunched the whole cluster because: no capacity in the zone" in RecoveryBenchReport(
        RecoveryBenchConfig(), dataset_bytes=60 * MB, runs=[fell_back]).table()


def test_a_path_not_measured_is_said_and_leaves_the_ratios_out() -> None:
    report = RecoveryBenchReport(RecoveryBenchConfig(), dataset_bytes=60 * MB, runs=[run("cluster", 40.0, 100)],
                                 not_measured={"nodes": "no recovery.replace"})
    assert report.ratios() is None and report.meets_targets() is None
    assert "nodes    not measured: no recovery.replace" in report.table()
    assert json.loads(report.to_json())["not_measured"] == {"nodes": "no recovery.replace"}


def test_each_paths_job_preempts_one_node_past_a_commit_and_names_its_path() -> None:
    config = RecoveryBenchConfig()
    job = job_for(config, "nodes")
    assert job.cluster.provider == "netns" and job.cluster.nodes == 4
    assert job.chaos is not None and [(p.node, p.at_step) for p in job.chaos.preempt] == [(2, 25)]
    assert job.recovery.max_recoveries == 1
    if replace_supported():
        assert job.recovery.model_dump()["replace"] == "nodes"


@pytest.mark.parametrize(("changes", "why"), [
    ({"preempt_node": 0}, "other than the head"),
    ({"paths": ("cluster", "all")}, "give some of cluster, nodes"),
    ({"preempt_at_step": 5}, "after the first commit"),
    ({"nodes": 1}, "needs peers"),
])
def test_a_bad_config_is_refused_before_anything_runs(changes: dict[str, object], why: str) -> None:
    problem = RecoveryBenchConfig(**changes).problem()  # type: ignore[arg-type]
    assert problem is not None and why in problem
