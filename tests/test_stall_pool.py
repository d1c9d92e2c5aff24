"""Every wait of a transfer's pool has a deadline: a worker stuck for good in a call that ignores its own timeout
(here: one blocked on an Event nobody sets) fails the transfer within the pool's bound, naming where it is stuck,
and the wait for the workers after the cancel is bounded too, leaving the stuck one behind."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from infra.storage.pool import Pool, PoolStuck

STUCK_S = 0.5
CANCEL_WAIT_S = 0.5


@pytest.fixture
def never() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()  # lets the test's stuck workers go at last


def _pool() -> Pool:
    return Pool(2, 1 << 20, None, time.monotonic(), stuck_s=STUCK_S, cancel_wait_s=CANCEL_WAIT_S)


def blocked_request(never: threading.Event) -> None:
    never.wait()  # a call that ignores its timeout: only the test's end lets it go


def test_wait_idle_raises_within_its_bound_naming_the_stuck_worker(never: threading.Event,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    undone = threading.Event()
    started = time.monotonic()
    with pytest.raises(PoolStuck) as raised, _pool().running(undone.set) as pool:
        pool.submit(0, lambda: blocked_request(never))
    took = time.monotonic() - started
    message = str(raised.value)
    assert "moved no byte and finished no task" in message, message
    assert "trainpipe-transfer_0 in test_stall_pool.py" in message and "blocked_request()" in message, message
    # The wait after the cancel is bounded too: the stuck worker is reported (logged beside the transfer's own
    # error) and left behind.
    left = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("left behind" in line and "blocked_request()" in line for line in left), left
    assert undone.is_set()
    logging.getLogger(__name__).warning("stuck worker found after %.2fs (stuck_s %.1f, cancel wait %.1f)", took,
                                        STUCK_S, CANCEL_WAIT_S)
    assert took < (STUCK_S + CANCEL_WAIT_S) * 6, took  # generous: 2 loaded cores


def test_shutdown_after_a_failure_is_bounded_and_raises_the_failure(never: threading.Event,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    pool = Pool(2, 1 << 20, None, time.monotonic(), cancel_wait_s=CANCEL_WAIT_S)  # no stuck bound: the failure ends it
    running = threading.Event()

    def stuck() -> None:
        running.set()
        blocked_request(never)

    def failing() -> None:
        assert running.wait(30)
        raise OSError("the disk went away")

    started = time.monotonic()
    with pytest.raises(OSError, match="the disk went away"), pool.running(lambda: None):
        pool.submit(0, stuck)
        pool.submit(0, failing)
    assert time.monotonic() - started < CANCEL_WAIT_S * 20
    assert any("left behind" in r.getMessage() and "blocked_request()" in r.getMessage() for r in caplog.records)
    # Called directly, the bounded shutdown raises what it left behind.
    with pytest.raises(PoolStuck, match=r"1 workers or requests still running .* left behind: trainpipe-transfer"):
        pool.shutdown(cancel=True)


def test_a_stuck_worker_does_not_hold_the_process_at_exit(tmp_path: object) -> None:
    script = textwrap.dedent("""
        import threading, time
        from infra.storage.pool import Pool, PoolStuck
        pool = Pool(1, 1, None, time.monotonic(), stuck_s=0.2, cancel_wait_s=0.2)
        try:
            with pool.running(lambda: None):
                pool.submit(0, threading.Event().wait)
        except PoolStuck as exc:
            print("failed:", exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "failed: the transfer moved no byte" in done.stdout, done
