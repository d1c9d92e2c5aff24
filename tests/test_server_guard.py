"""The guard of `trainpipe run`'s temporary Prefect server (trainpipe.server_guard): the server ends with the run,
however the run ends. A real `trainpipe run` killed with SIGKILL is tests/test_pipeline_e2e.py's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from infra.node.processes import tagged_processes

TAG = "TP_GUARD_TEST"
SERVER = [sys.executable, "-c", "import signal; signal.pause()"]  # stands in for uvicorn: runs until signalled
GUARD = [sys.executable, "-m", "trainpipe.server_guard"]
REPO = Path(__file__).resolve().parents[1]


def _tag() -> str:
    return f"{os.getpid()}-{time.monotonic_ns()}"


def _gone(tag: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while tagged_processes(TAG, tag):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _ended(process: psutil.Process) -> bool:
    """Exited: gone, or a zombie its new parent (init here) has not reaped yet."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _server_of(guard_pid: int, within_s: float = 30.0) -> psutil.Process:
    deadline = time.monotonic() + within_s
    while not (children := psutil.Process(guard_pid).children()):
        assert time.monotonic() < deadline, "the guard never started the server"
        time.sleep(0.05)
    return children[0]


def test_the_server_ends_when_the_run_that_started_it_is_killed() -> None:
    tag = _tag()
    # The run: starts the guarded server in a session of its own (as trainpipe.prefect_server does), then waits.
    owner_code = ("import os, signal, subprocess, sys\n"
                  f"subprocess.Popen({GUARD!r} + [str(os.getpid()), '--'] + {SERVER!r}, start_new_session=True)\n"
                  "signal.pause()\n")
    owner = subprocess.Popen([sys.executable, "-c", owner_code], cwd=REPO, env={**os.environ, TAG: tag})
    try:
        [guard] = _children_within(owner.pid)
        server = _server_of(guard.pid)
        owner.kill()  # SIGKILL: no atexit, no chance to stop anything
        owner.wait()
        assert _gone(tag, 30), "the server outlived the run that started it"
        assert _ended(server)
    finally:
        for process in tagged_processes(TAG, tag):
            process.kill()


def test_the_server_ends_when_its_guard_is_killed() -> None:
    tag = _tag()
    guard = subprocess.Popen([*GUARD, str(os.getpid()), "--", *SERVER], cwd=REPO, env={**os.environ, TAG: tag})
    try:
        server = _server_of(guard.pid)
        guard.kill()
        guard.wait()
        assert _gone(tag, 30), "the server outlived its guard"
        assert _ended(server)
    finally:
        for process in tagged_processes(TAG, tag):
            process.kill()


def test_a_stop_reaches_the_server_and_its_exit_code_comes_back() -> None:
    guard = subprocess.Popen([*GUARD, str(os.getpid()), "--", *SERVER], cwd=REPO)
    try:
        _server_of(guard.pid)
        guard.terminate()  # Prefect's stop at the run's exit
        assert guard.wait(30) == 128 + signal.SIGTERM
    finally:
        guard.kill()
    # Prefect reads 3 from the server as "port taken" and starts another: the guard passes it on.
    taken = subprocess.run([*GUARD, str(os.getpid()), "--", sys.executable, "-c", "raise SystemExit(3)"], cwd=REPO,
                           timeout=60)
    assert taken.returncode == 3


def test_a_server_that_ignores_the_stop_is_killed_after_its_grace() -> None:
    """Before, the guard forwarded the stop and waited on the server for good."""
    stubborn = [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); signal.pause()"]
    guard = subprocess.Popen([*GUARD, str(os.getpid()), "--", *stubborn], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "TRAINPIPE_SERVER_STOP_GRACE_S": "2"})
    try:
        assert guard.stdout is not None and guard.stdout.readline().strip() == "ready"
        stopped_at = time.monotonic()
        guard.terminate()
        code = guard.wait(30)
        took = time.monotonic() - stopped_at
    finally:
        guard.kill()
    assert code == 128 + signal.SIGKILL
    assert 2 <= took < 20, took
    assert "did not stop within 2s" in (guard.stderr.read() if guard.stderr else "")


def _children_within(pid: int, within_s: float = 30.0) -> list[psutil.Process]:
    deadline = time.monotonic() + within_s
    while not (children := psutil.Process(pid).children()):
        assert time.monotonic() < deadline, f"pid {pid} started nothing"
        time.sleep(0.05)
    return children


def test_a_server_whose_guard_died_before_it_asked_for_the_signal_ends_at_once() -> None:
    """The parent-death signal is asked for in the forked server, before its exec: a guard killed before then (a
    run killed the instant it started its server) is already gone, and no signal would ever come. Seen in CI: the
    server outlived a guard killed right after the fork."""
    code = ("import time\nfrom trainpipe.server_guard import _end_with_me\n"
            "_end_with_me(1)\n"  # 1 is not this process's parent: its guard is gone
            "time.sleep(60)\n")
    orphan = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=30)
    assert orphan.returncode == -signal.SIGTERM
