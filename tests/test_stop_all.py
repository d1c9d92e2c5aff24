"""Stopping a run's trainers: every node is signalled at once and all are waited for under one bound.

Each node's script here saves collectively on SIGTERM, as a DCP save does: its save finishes only once every rank has
been signalled. Stopped one after another, the first node's save waits on nodes not yet signalled until its grace
runs out and it is killed (and the whole stop takes nodes × grace); stopped together, every save completes at once.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from infra.compute.access.remote import LocalRunner, Process, stop_all

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
    time.sleep(1)
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
