"""The worker threads of one transfer's pool, started only as queued work needs them.

Daemon threads, unlike ThreadPoolExecutor's (joined when the interpreter exits): a thread cannot be killed, so a
worker stuck in a call that ignores its own timeout is reported and left behind by shutdown, and the process can
still exit once the transfer has failed with that report.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# Frames that say nothing of what a stuck worker was doing: the pool's own, and the standard library's.
_MACHINERY = (str(Path(__file__).with_name("pool.py")), __file__, str(Path(threading.__file__).parent))


class Workers:
    """Up to max_workers daemon threads running submitted calls, in order."""

    def __init__(self, max_workers: int, name: str) -> None:
        self._max, self._name = max_workers, name
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._busy: set[threading.Thread] = set()
        self._queued = self._idle = 0
        self._shut = False

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot submit: the workers are shut down")
            self._queue.put((future, fn))
            self._queued += 1
            # Exact counts under the lock: work that waits always has a worker coming, up to the bound (a task
            # waiting on its own background work must never find every thread taken by a miscount).
            if self._queued > self._idle and len(self._threads) < self._max:
                thread = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                self._idle += 1
            item = self._queue.get()
            with self._lock:
                self._idle -= 1
                if item is None:
                    return
                self._queued -= 1
                self._busy.add(me)
            future, fn = item
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn()
                    except BaseException as exc:
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                with self._lock:
                    self._busy.discard(me)

    def busy(self) -> list[str]:
        """Each worker running a call now: its name and where it is (the innermost frame of ours, and the call it
        waits in), for an error that names what is stuck."""
        with self._lock:
            busy = list(self._busy)
        frames = sys._current_frames()
        return [f"{thread.name} in {_where(frames.get(thread.ident or -1))}" for thread in busy]

    def shutdown(self, *, cancel_futures: bool, timeout_s: float) -> list[str]:
        """Take no more work (dropping what is queued when cancel_futures), and wait up to timeout_s for the
        workers to finish theirs. Returns the workers still running a call then (busy()'s lines), left behind."""
        with self._lock:
            self._shut = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
                    with self._lock:
                        self._queued -= 1
        for _ in threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return self.busy()


def _where(frame: Any) -> str:
    if frame is None:
        return "an unknown place"
    stack = traceback.extract_stack(frame)
    innermost = stack[-1]
    ours = next((entry for entry in reversed(stack) if not _machinery(entry.filename)), innermost)
    where = f"{Path(ours.filename).name}:{ours.lineno} {ours.name}()"
    if ours is not innermost:
        where += f", waiting in {Path(innermost.filename).name}:{innermost.lineno} {innermost.name}()"
    return where


def _machinery(filename: str) -> bool:
    return filename.startswith(_MACHINERY) and "site-packages" not in filename
