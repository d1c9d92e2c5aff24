"""kill -9 at many instants: first the trainer (mid-save or between saves), then the syncer (mid-upload or mid-commit).

After every kill: each local step that has a completion marker loads, the store's latest committed checkpoint
verifies byte for byte and loads, and no uncommitted step is ever reported as latest. The kill instants are
random delays (seeded, so a failure can be replayed) over a trainer that saves asynchronously all the time.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from test_syncer import SyncProcess
from zygote import FORK_PER_LINE

from infra.checkpoints.store import CheckpointStore
from infra.storage import open_store
from trainer.checkpoint import complete_steps, inspect_checkpoint, step_dir_name

KILL_POINTS = 10
COMMIT_DEADLINE_S = 180.0  # generous: CI runs on 2 loaded cores
# A training script using the trainer's checkpoint API (~12 MB per checkpoint, an async save after every step),
# forked from a process that imported torch once, because importing it takes seconds on a loaded machine.
SAVER_ZYGOTE = """
import os, signal, sys, time, torch
from pathlib import Path
from trainer.checkpoint import Checkpointer
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped at once, so a killed one is gone
root = Path(sys.argv[1])
""" + FORK_PER_LINE + """
    torch.set_num_threads(1)
    torch.manual_seed(step)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters())
    with Checkpointer(root, "async", keep_local=2) as checkpointer:
        while True:
            step += 1
            model(torch.randn(4, 512)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            checkpointer.save(step, model, optimizer, {"step": step})
            time.sleep(0.05)
"""


class Savers:
    """Starts trainer processes that save until killed."""

    def __init__(self, ckpt_dir: Path) -> None:
        self.zygote = subprocess.Popen([sys.executable, "-c", SAVER_ZYGOTE, str(ckpt_dir)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def start(self, first_step: int) -> int:
        assert self.zygote.stdin is not None and self.zygote.stdout is not None
        self.zygote.stdin.write(f"{first_step}\n")
        self.zygote.stdin.flush()
        return int(self.zygote.stdout.readline())

    def close(self) -> None:
        self.zygote.kill()
        self.zygote.wait()


def wait_for(ready: Callable[[], object], what: str, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while not ready():
        assert time.monotonic() < deadline, f"no {what} within {deadline_s:.0f}s"
        time.sleep(0.1)


def kill_pid(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid):
        assert time.monotonic() < deadline, f"pid {pid} survived SIGKILL"
        time.sleep(0.01)


def assert_local_steps_load(ckpt_dir: Path) -> None:
    for step in complete_steps(ckpt_dir):
        assert inspect_checkpoint(ckpt_dir / step_dir_name(step))["step"] == step


def assert_latest_is_whole(checkpoints: CheckpointStore, scratch: Path) -> int | None:
    # Listed first: a syncer may still be committing, so latest can only be at least as new as this listing.
    committed_before = [status.step for status in checkpoints.list_steps() if status.committed]
    latest = checkpoints.latest()
    if latest is None:
        assert not committed_before
        return None
    assert latest.step >= max(committed_before, default=latest.step)
    assert latest.step in [status.step for status in checkpoints.list_steps() if status.committed]
    checkpoints.verify(latest.step, deep=True)
    assert inspect_checkpoint(checkpoints.restore(scratch, latest.step))["step"] == latest.step
    return latest.step


def test_kill_9_never_leaves_a_torn_checkpoint_visible(tmp_path: Path) -> None:
    rng = random.Random(4)
    ckpt_dir = tmp_path / "node-0" / "ckpt"
    ckpt_dir.mkdir(parents=True)
    checkpoints = CheckpointStore(open_store(f"file://{tmp_path / 'store'}"))

    def syncer(**fields: Any) -> SyncProcess:
        # keep is large so retention never deletes a step this test is verifying concurrently.
        return SyncProcess(tmp_path, ckpt_dir, checkpoints.store.url, 0, nodes=1, keep=1000, **fields)

    savers = Savers(ckpt_dir)
    running = syncer()
    try:
        # The trainer dies at random instants while the syncer keeps uploading and committing.
        for point in range(KILL_POINTS):
            saver = savers.start(first_step=point * 1000)
            if point == KILL_POINTS - 1:
                # On a loaded machine every earlier kill may land before a save completes: the last trainer lives
                # until something is committed, so the kills are checked against a store that holds a commit.
                wait_for(checkpoints.latest, "a commit while the trainer saves", COMMIT_DEADLINE_S)
            time.sleep(rng.uniform(0.6, 2.0))  # the first save ends ~1 s after the fork
            kill_pid(saver)
            assert_local_steps_load(ckpt_dir)
            assert_latest_is_whole(checkpoints, tmp_path / f"restored-t{point}")
        running.proc.kill()
        running.proc.wait()
        assert checkpoints.latest() is not None, "no step was ever committed: the kills proved nothing"

        # The syncer dies at random instants while the trainer keeps saving.
        saver = savers.start(first_step=KILL_POINTS * 1000)
        committed = []
        for point in range(KILL_POINTS):
            running = syncer()
            time.sleep(rng.uniform(0.8, 2.8))  # startup ~1 s, then uploads
            running.proc.kill()
            running.proc.wait()
            committed.append(assert_latest_is_whole(checkpoints, tmp_path / f"restored-s{point}"))
        kill_pid(saver)
        assert_local_steps_load(ckpt_dir)
    finally:
        if running.proc.poll() is None:
            running.proc.kill()
            running.proc.wait()
        savers.close()
    assert committed == sorted(committed), "latest moved backwards"

    # A restarted syncer flushes what the trainer completed: the newest local step becomes latest.
    stop = tmp_path / "stop"
    stop.touch()
    assert syncer(stop_file=str(stop)).finish() == 0
    assert assert_latest_is_whole(checkpoints, tmp_path / "restored-final") == complete_steps(ckpt_dir)[-1]
