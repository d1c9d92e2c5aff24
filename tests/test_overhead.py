"""Where a run's wall time goes outside its training steps: the summary's figures and the bench's split."""

from __future__ import annotations

import time

import pytest

from bench.overhead import split
from infra.job.summary import RunSummary


def test_the_summary_counts_overhead_from_the_command_start() -> None:
    started = time.time() - 30.0  # the command started 30 s ago (its interpreter, imports, the Prefect server)
    summary = RunSummary(run_id="r", job="j", provider="local", nodes=2, started_at=started)
    assert summary.flow_started_s == pytest.approx(30.0, abs=1.0)
    summary.trained(first_step_at=started + 40.0, steps_s=12.5)
    summary.trained(first_step_at=started + 90.0, steps_s=7.5)  # a recovery's attempt: its steps count too
    summary.finish()
    assert summary.time_to_first_step_s == pytest.approx(40.0)
    assert summary.steps_s == 20.0
    wall = summary.finished_at - started
    assert summary.overhead_s == pytest.approx(wall - 20.0, abs=0.01)
    assert "overhead: " in summary.render() and "first step after 40.0s" in summary.render()


def test_the_bench_splits_the_wall_time_into_pieces_that_add_up() -> None:
    summary = {"flow_started_s": 12.0, "time_to_first_step_s": 31.0, "steps_s": 20.0, "steps": 100,
               "start_step": 1, "phases": {"plan": 1.0, "provision": 0.5, "verify": 0.5, "stage": 2.0,
                                          "train": 37.0, "sync": 0.4, "teardown": 0.2}}
    wall = 60.0
    rows = dict(split(summary, wall))
    # Training reached at 16 s; its first step ended at 31 s and took 0.2 s of the steps' 20 s.
    assert rows["train: start-up before the first step"] == pytest.approx(14.8)
    assert rows["train: after the last step (last save, flush)"] == pytest.approx(37.0 - 14.8 - 20.0)
    assert rows["report, server stop, exit"] == pytest.approx(wall - 12.0 - 41.6)
    assert sum(rows.values()) == pytest.approx(wall)
