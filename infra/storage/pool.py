"""The bounded worker pool one transfer runs on, with back-pressure, cancellation and progress.

Work in flight is bounded in bytes and in tasks (memory and open files stay flat however many files there are);
the first failure of any task cancels the rest and is raised to the caller's thread, and progress callbacks run
on the caller's thread too, so they never race each other.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from infra.storage.retry import Cancelled

T = TypeVar("T")

TICK_S = 0.1  # progress callbacks and failure checks happen at most this often
TASKS_PER_WORKER = 4  # queued + running tasks per worker: enough to never starve, few enough to bound open files


@dataclass(frozen=True)
class Progress:
    """Passed to the progress callback at most every TICK_S seconds, and once at the end.

    Totals count only what is moved: files skipped as already valid are in neither.
    """

    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    elapsed_s: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes_done / 1e6 / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float:
        """Seconds left at the rate so far; inf before anything has moved."""
        remaining = self.bytes_total - self.bytes_done
        if remaining <= 0:
            return 0.0
        rate = self.bytes_done / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return remaining / rate if rate > 0 else math.inf


class Pool:
    """The bounded worker pool shared by every task of one transfer."""

    def __init__(
        self, workers: int, max_inflight_bytes: int, progress: Callable[[Progress], None] | None, started: float
    ) -> None:
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="trainpipe-transfer")
        self._max_bytes = max_inflight_bytes
        self._max_tasks = TASKS_PER_WORKER * workers
        self._cond = threading.Condition()
        self._bytes_in_flight = 0
        self._tasks_in_flight = 0
        self._error: BaseException | None = None
        self.cancel = threading.Event()
        self._progress = progress
        self._started = started
        self._last_report = -math.inf
        self.bytes_total = self.files_total = self.bytes_done = self.files_done = 0
        self._totals_known = False  # no progress while planning: "0 of 0 bytes" would mislead

    def submit(self, nbytes: int, task: Callable[[], T]) -> Future[T]:
        """Run task on a worker once fewer than the bounded bytes and tasks are in flight."""
        while True:
            with self._cond:
                if self._error is not None:
                    raise self._error
                fits = self._tasks_in_flight < self._max_tasks and self._bytes_in_flight + nbytes <= self._max_bytes
                # A task larger than the whole budget still runs, alone.
                if fits or self._tasks_in_flight == 0:
                    self._tasks_in_flight += 1
                    self._bytes_in_flight += nbytes
                    break
                self._cond.wait(TICK_S)
            self.report()
        return self._executor.submit(self._run, nbytes, task)

    def _run(self, nbytes: int, task: Callable[[], T]) -> T:
        try:
            if self.cancel.is_set():
                raise Cancelled()
            return task()
        except BaseException as exc:
            with self._cond:
                if self._error is None and not isinstance(exc, Cancelled):
                    self._error = exc
                self.cancel.set()
            raise
        finally:
            with self._cond:
                self._tasks_in_flight -= 1
                self._bytes_in_flight -= nbytes
                self._cond.notify_all()

    def wait_idle(self) -> None:
        """Block until every submitted task has finished; raise the first failure."""
        while True:
            with self._cond:
                if self._error is not None:
                    raise self._error
                if self._tasks_in_flight == 0:
                    return
                self._cond.wait(TICK_S)
            self.report()

    def shutdown(self, *, cancel: bool) -> None:
        """Stop the workers (after their current task when cancelling); no thread outlives the transfer."""
        if cancel:
            self.cancel.set()
        self._executor.shutdown(wait=True, cancel_futures=cancel)

    def set_totals(self, bytes_total: int, files_total: int) -> None:
        with self._cond:
            self.bytes_total, self.files_total = bytes_total, files_total
            self._totals_known = True

    def add_bytes(self, n: int) -> None:
        with self._cond:
            self.bytes_done += n

    def file_done(self) -> None:
        with self._cond:
            self.files_done += 1

    def report(self, *, final: bool = False) -> None:
        now = time.monotonic()
        if self._progress is None or not self._totals_known or (not final and now - self._last_report < TICK_S):
            return
        self._last_report = now
        with self._cond:
            snapshot = Progress(
                self.bytes_done, self.bytes_total, self.files_done, self.files_total, now - self._started
            )
        self._progress(snapshot)
