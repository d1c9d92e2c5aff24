"""Stopping a run's trainers: every node is signalled at once and all are waited for under one bound.

Each node's script here saves collectively on SIGTERM, as a DCP save does: its save finishes only once every rank has
been signalled. Stopped one after another, the first node's save waits on nodes not yet signalled until its grace
runs out and it is killed (and the whole stop takes nodes × grace); stopped together, every save completes at once.

The same, end to end: Ctrl-C on `trainpipe run` of 4 local nodes under torchrun whose script saves a real
torch.distributed.checkpoint (gloo) when it gets SIGTERM: every rank is signalled within a moment of the others, the
save is committed to the store, the trainers are stopped within one trainer bound (flush_deadline_s + the exit grace),
and the run ends within the bound the README promises for Ctrl-C. One after another, the same run's trainers took
88.8 s (3 bounds of 30 s, with flush_deadline_s 20), no rank saved and nothing was committed.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from cloud_env import wait_for
from jobs import job_config, make_dataset, write_config
from test_cancel import Run, summary_of

from infra.checkpoints.store import CheckpointStore
from infra.compute.access.remote import LocalRunner, Process, stop_all
from infra.storage import open_store
from tasks.train import TRAINER_EXIT_GRACE_S

NODES = 4
GRACE_S = 30.0  # each node's bound; the stop must take less than one of them, not four

COLLECTIVE_SAVE = """
import pathlib, signal, sys, time
here, nodes, rank = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

def save(*_):
    (here / f"signalled-{rank}").touch()
    deadline = time.monotonic() + 120
    while len(list(here.glob("signalled-*"))) < nodes:  # the collective: every rank must be in it
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.01)
    (here / f"saved-{rank}").touch()
    sys.exit(0)

signal.signal(signal.SIGTERM, save)
print("ready", flush=True)
while True:
    signal.pause()  # until SIGTERM; the handler exits
"""


def _start_nodes(tmp_path: Path) -> dict[str, Process]:
    script = tmp_path / "collective_save.py"
    script.write_text(COLLECTIVE_SAVE)
    processes: dict[str, Process] = {}
    ready = threading.Semaphore(0)
    for rank in range(NODES):
        runner = LocalRunner(f"node-{rank}", tmp_path, {})
        processes[runner.node_name] = runner.start(
            [sys.executable, str(script), str(tmp_path), str(NODES), str(rank)],
            on_line=lambda line: ready.release() if line.strip() == "ready" else None)
    for _ in range(NODES):
        assert ready.acquire(timeout=60), "a node's script never installed its SIGTERM handler"
    return processes


def test_every_node_is_signalled_at_once_and_a_collective_save_completes_within_one_bound(tmp_path: Path) -> None:
    processes = _start_nodes(tmp_path)
    started = time.monotonic()
    codes = stop_all(processes, GRACE_S)
    elapsed = time.monotonic() - started
    assert codes == {name: 0 for name in processes}, "a node's collective save did not complete"
    assert sorted(path.name for path in tmp_path.glob("saved-*")) == [f"saved-{rank}" for rank in range(NODES)]
    assert elapsed < GRACE_S, f"the stop took {elapsed:.1f}s: more than one node's bound"


def test_no_processes_is_nothing_to_stop() -> None:
    assert stop_all({}, GRACE_S) == {}


# A rank waits, with no collective in flight, until SIGTERM; then all ranks save one DCP checkpoint together (its
# planning and its commit are collectives: no rank's save completes before every rank has joined it).
DCP_SAVE_ON_SIGTERM = """
import os, pathlib, signal, sys, time
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

marks = pathlib.Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
state = {f"rank-{rank}": torch.full((4096,), float(rank))}

def save(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: torchrun's agent passes on the group's SIGTERM again
    (marks / f"signalled-{rank}").write_text(repr(time.time()))
    dcp.save(state, checkpoint_id=pathlib.Path(os.environ["TRAINPIPE_CHECKPOINT_DIR"]) / "step-7")
    (marks / f"saved-{rank}").write_text(repr(time.time()))
    dist.destroy_process_group()
    sys.exit(0)

signal.signal(signal.SIGTERM, save)
dist.barrier()
(marks / f"ready-{rank}").touch()
while True:
    signal.pause()  # until SIGTERM; the handler exits
"""
SAVED_STEP = 7
FLUSH_DEADLINE_S = 25.0  # the most the spec allows
TRAINER_BOUND_S = FLUSH_DEADLINE_S + TRAINER_EXIT_GRACE_S  # one node's bound; serial, 4 nodes took up to 4 of them
RUN_EXIT_BOUND_S = FLUSH_DEADLINE_S + 15.0  # what the README promises for Ctrl-C: flush, commit, teardown
STOPPED = re.compile(r"trainers stopped: (?P<nodes>\d+) in (?P<seconds>[\d.]+)s")  # tasks.train's line
AT_ONCE_S = 5.0  # every rank signalled within this of the first: serial, the second came a whole bound later


def _marks(marks: Path, kind: str) -> list[float]:
    """When each rank got SIGTERM (kind "signalled") or finished its save ("saved"), as it wrote it down."""
    missing = [rank for rank in range(NODES) if not (marks / f"{kind}-{rank}").exists()]
    assert not missing, f"ranks {missing} never {kind}"
    return [float((marks / f"{kind}-{rank}").read_text()) for rank in range(NODES)]


def test_ctrl_c_on_a_4_node_run_commits_its_collective_dcp_save_within_one_bound(
        prefect_server: None, workspace: Path, tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL

    code, marks = tmp_path / "code", tmp_path / "marks"
    code.mkdir()
    marks.mkdir()
    (code / "save_on_sigterm.py").write_text(DCP_SAVE_ON_SIGTERM)
    config = job_config(tmp_path, make_dataset(tmp_path / "data", tokens=20_000, shard_tokens=10_000))
    config["cluster"]["nodes"] = NODES
    config["checkpoints"].update(format="dcp", flush_deadline_s=FLUSH_DEADLINE_S)
    config["training"] = {"code": str(code), "command": ["save_on_sigterm.py", str(marks)], "timeout_s": 600}
    run_id = "stop-4-dcp"
    checkpoints = CheckpointStore(open_store(f"{config['checkpoints']['url']}/{run_id}"))
    env = {**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    run = Run(write_config(tmp_path / "job.yaml", config), run_id, env, tmp_path)
    try:
        wait_for(lambda: run.running() and len(list(marks.glob("ready-*"))) == NODES, 300, "every rank up",
                 interval=0.2)
        signalled_at = time.time()
        os.killpg(run.popen.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        took = run.exit_seconds(RUN_EXIT_BOUND_S)
    finally:
        run.stop()
    output = run.output()[-4000:]
    trainers = STOPPED.search(run.output())
    print(f"figures: Ctrl-C on {NODES} nodes: trainers stopped in {trainers['seconds'] if trainers else '?'}s (one "
          f"trainer bound: {TRAINER_BOUND_S:g}s), the run ended {took:.1f}s after Ctrl-C")
    assert run.popen.returncode == 128 + signal.SIGINT, output
    assert trainers is not None and int(trainers["nodes"]) == NODES, output
    signalled, saved = _marks(marks, "signalled"), _marks(marks, "saved")
    spread, stopped = max(signalled) - min(signalled), max(saved) - signalled_at
    print(f"figures: every rank signalled within {spread:.2f}s, the collective DCP save done on all {stopped:.1f}s "
          "after Ctrl-C")
    assert spread < AT_ONCE_S, f"ranks signalled {spread:.1f}s apart: one after another"
    assert float(trainers["seconds"]) < TRAINER_BOUND_S, f"{trainers[0]}\n{output}"
    latest = checkpoints.latest()
    assert latest is not None and latest.step == SAVED_STEP, f"the save on SIGTERM was not committed: {output}"
    summary = summary_of(workspace, run_id)
    assert summary["status"] == "cancelled" and summary["checkpoint_step"] == SAVED_STEP, summary
    assert summary["nodes_left"] == 0
    assert took < RUN_EXIT_BOUND_S, f"the run ended {took:.1f}s after Ctrl-C: more than {RUN_EXIT_BOUND_S:g}s"
