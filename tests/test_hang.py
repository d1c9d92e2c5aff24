"""A hung rank is noticed: training.hang_timeout_s without a new step or a new checkpoint makes every rank print its
Python stacks into the run folder, stops the ranks and restarts them on the same nodes from the latest commit.

End to end: the example's own script (plain DDP over gloo, DCP checkpoints) on 2 local nodes, whose rank 1 stops
answering at step 70 of 200 in the first attempt (the issue's drill: 120 of 300), as a deadlock in a script would:
it sleeps where it should step, and rank 0 waits in its all-reduce. The node side alone: the `stacks` command on
real processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from infra.job.recovery_spec import RecoverySpec
from infra.job.spec import parse_job
from infra.lifecycle.hang import HangClock, hang_reason
from infra.lifecycle.recovery import RESTARTED, Recoveries, RecoveryExhausted
from infra.node.events import NodeEvent, parse
from infra.node.processes import NODE_TAG
from infra.node.protocol import StacksRequest

HANG_TIMEOUT_S = 10.0  # the drill says 40 s; the mechanism is the same, and CI's minutes are not
STEPS, HANG_AT, SAVE_EVERY, STEP_DELAY_S = 200, 70, 30, 0.011

# Runs the example's train.py; in the first attempt, rank 1 sleeps for good at its HANG_AT-th step, before the step's
# all-reduce, and says when in HANG_MARK. The step's sleep is told apart by its length (torch sleeps too).
WRAPPER = """
import os, runpy, sys, time
if os.environ.get("RANK") == "1" and os.environ.get("TRAINPIPE_ATTEMPT") == "0":
    real_sleep, steps = time.sleep, [0]
    def sleep(seconds):
        if seconds == float(os.environ["STEP_DELAY_S"]):
            steps[0] += 1
            if steps[0] == int(os.environ["HANG_AT"]):
                with open(os.environ["HANG_MARK"], "w") as mark:
                    mark.write(repr(time.time()))
                while True:
                    real_sleep(3600)
        real_sleep(seconds)
    time.sleep = sleep
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_rank_that_stops_answering_is_noticed_its_stacks_kept_and_training_completes(
        prefect_server: None, workspace: Path, tmp_path: Path) -> None:
    from flows.retrain import retrain

    sys.path.insert(0, str(REPO / "examples" / "own-script"))
    try:
        from make_data import write
    finally:
        sys.path.pop(0)
    write(tmp_path / "dataset")
    code = tmp_path / "project"
    code.mkdir()
    shutil.copy(REPO / "examples" / "own-script" / "train.py", code / "train.py")
    (code / "hang.py").write_text(WRAPPER)
    mark = tmp_path / "hung-at"
    config = {
        "name": "hang",
        "cluster": {"provider": "local", "nodes": 2, "procs_per_node": 1, "verify": {"bench": "off"}},
        "dataset": {"url": f"file://{tmp_path / 'dataset'}"},
        "checkpoints": {"url": f"file://{tmp_path / 'store'}", "format": "dcp", "keep": 2},
        "training": {"code": str(code), "hang_timeout_s": HANG_TIMEOUT_S,
                     "command": ["hang.py", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--step-delay-s",
                                 str(STEP_DELAY_S)],
                     "env": {"HANG_AT": str(HANG_AT), "HANG_MARK": str(mark), "STEP_DELAY_S": str(STEP_DELAY_S)}},
    }
    summary = retrain(parse_job(config), "hang-drill")

    assert summary["status"] == "completed" and summary["steps"] == STEPS, summary.get("error")
    [recovery] = summary["recoveries"]
    # The head's script reports every 10 steps: the last step it reported before rank 0 blocked in step 70's
    # all-reduce is 60.
    assert recovery["reason"] == hang_reason(HANG_TIMEOUT_S, HANG_AT - 10), recovery
    assert recovery["hung"] and recovery["path"] == RESTARTED and recovery["replaced"] == []
    assert recovery["resumed_from_step"] == 60, "restarted from the latest commit"
    # Noticed within the timeout and a few polls of the hang (the last step came just before it).
    hung_at = float(mark.read_text())
    assert HANG_TIMEOUT_S - 3 <= recovery["detected_at"] - hung_at <= HANG_TIMEOUT_S + 10, recovery
    assert [a["outcome"] for a in summary["attempts"]] == ["launched"], "the same nodes trained again"
    stacks = workspace / "runs" / "hang-drill" / "stacks" / "attempt-0"
    sleeping = (stacks / "tp-hang-drill-node-1.txt").read_text()
    waiting = (stacks / "tp-hang-drill-node-0.txt").read_text()
    # faulthandler's dumps: the hung rank in its endless sleep, the other one in its all-reduce.
    assert "Fatal Python error: Aborted" in sleeping and "in sleep" in sleeping and "hang.py" in sleeping, sleeping
    assert "Fatal Python error: Aborted" in waiting and "train.py" in waiting, waiting


def test_the_stacks_command_dumps_each_rank_stopped_or_running_and_leaves_no_core(tmp_path: Path) -> None:
    """torchrun's workers (LOCAL_RANK set) of this node print every thread's stack and end; other processes of
    the node are left alone."""
    rank = "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n" \
           "print('up', flush=True)\ntime.sleep(600)\n"
    base = {**os.environ, NODE_TAG: f"stacks-{os.getpid()}", "PYTHONFAULTHANDLER": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", rank], env={**base, "LOCAL_RANK": str(i), "RANK": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for i in range(2)]
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=base)
    try:
        for process in ranks:
            assert process.stdout.readline() == "up\n"
        ranks[1].send_signal(signal.SIGSTOP)  # stopped, as by a debugger: it prints once it runs again
        request = StacksRequest(grace_s=20)
        done = subprocess.run(request.command_line(sys.executable), env=request.environment(base),
                              capture_output=True, text=True, timeout=60, cwd=REPO)
        assert done.returncode == 0, done.stderr
        [event] = [e for e in map(parse, done.stdout.splitlines()) if e is not None]
        assert event.kind is NodeEvent.STACKS_DUMPED and event["ranks"] == ["0", "1"] and event["exited"] == 2
        for process in ranks:
            assert process.wait(timeout=10) == -signal.SIGABRT
            stderr = process.stderr.read()
            # Every thread's stack: the main one in its sleep, the other one's too.
            assert "Fatal Python error: Aborted" in stderr and "Current thread" in stderr, stderr
            assert "File \"<string>\", line" in stderr and "in _bootstrap" in stderr, stderr
        assert agent.poll() is None, "a process of the node that is not a rank was signalled"
        assert not list(tmp_path.glob("core*")), "the abort wrote a core"
    finally:
        for process in [*ranks, agent]:
            process.kill()
            process.wait()


def test_the_clock_is_armed_by_progress_and_off_at_zero() -> None:
    now = [0.0]
    clock = HangClock(10.0, lambda: now[0])
    now[0] = 11.0
    assert not clock.hung() and clock.unarmed_past_timeout(), "no step, no checkpoint: nothing to go by"
    clock.saw(5, 0)
    now[0] = 20.0
    assert not clock.hung()
    clock.saw(5, 1)  # a checkpoint found complete is progress too
    now[0] = 29.9
    assert not clock.hung()
    now[0] = 30.0
    assert clock.hung()
    off = HangClock(0.0, lambda: now[0])
    off.saw(1, 0)
    now[0] = 10_000.0
    assert not off.hung() and not off.unarmed_past_timeout()


def test_a_second_hang_at_the_same_step_is_not_recovered() -> None:
    recoveries = Recoveries(RecoverySpec(max_recoveries=5))
    recoveries.begin(["n0", "n1"], hang_reason(10, 110), False, 110, time.time(), hung=True)
    recoveries.begin(["n0", "n1"], hang_reason(10, 150), False, 150, time.time(), hung=True)  # further on: again
    with pytest.raises(RecoveryExhausted) as caught:
        recoveries.begin(["n0", "n1"], hang_reason(10, 150), False, 150, time.time(), hung=True)
    message = str(caught.value)
    assert "training hung: no step for 10 s after step 150" in message and "second time at step 150" in message
    assert json.dumps([r.hung for r in recoveries.records]) == "[true, true]"
