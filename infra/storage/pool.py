"""The bounded worker pool one transfer runs on, with back-pressure, cancellation and progress.

Work in flight is bounded in bytes and in tasks (memory and open files stay flat however many files there are);
the first failure of any task cancels the rest and is raised to the caller's thread, and progress callbacks run
on the caller's thread too, so they never race each other.

A task is either work for a worker thread (submit), or a file a store's own engine moves without any thread of
ours (start): it holds its slot until the engine is done, then a worker finishes it. So a native transfer keeps
hundreds of files in flight on a handful of threads (as s5cmd keeps them on goroutines).

Every wait of the pool has a deadline: a transfer in which nothing moves (no byte, no task ending) for stuck_s
fails naming what is in flight, and the wait for the workers after a cancel is bounded too; a worker still stuck
in a call then (one that ignores its own timeout: threads cannot be killed) is reported and left behind.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from infra.storage.base import StorageError
from infra.storage.retry import Cancelled
from infra.storage.stall import CANCEL_WAIT_S, ended_after_cancel
from infra.storage.workers import Workers

log = logging.getLogger(__name__)

T = TypeVar("T")

TICK_S = 0.1  # progress callbacks and failure checks happen at most this often
TASKS_PER_WORKER = 4  # queued + running tasks per worker: enough to never starve, few enough to bound open files


class Pending(Protocol):
    """Work a store's engine does without a thread of ours (one file it moves), as the pool watches it."""

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call callback (from any thread, at once if already done) when the work has ended, however it ended."""
        ...

    def poll(self) -> None:
        """Report progress so far; called on the pool's caller thread at most every TICK_S."""
        ...

    def cancel(self) -> None:
        """Stop the work; returns once the engine has let go of it (done callbacks have run)."""
        ...


P = TypeVar("P", bound=Pending)


class Threaded(Generic[T]):
    """Pending work that runs on a thread (an engine with no other way to wait for it), or is done already."""

    def __init__(self, future: Future[T]) -> None:
        self.future = future

    @classmethod
    def done(cls, result: T) -> Threaded[T]:
        future: Future[T] = Future()
        future.set_result(result)
        return cls(future)

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        self.future.add_done_callback(lambda _future: callback())

    def poll(self) -> None:
        """Its engine reports its own progress."""

    def cancel(self) -> None:
        # Work already running stops at its next look at the transfer's cancel event.
        self.future.cancel()
        ended_after_cancel([self.future], "a file's transfer")

    def result(self) -> T:
        return self.future.result()


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


class PoolStuck(StorageError):
    """Nothing in the transfer moved for the pool's deadline, or workers did not stop after it was cancelled."""


class Pool:
    """The bounded worker pool shared by every task of one transfer."""

    def __init__(
        self, workers: int, max_inflight_bytes: int, progress: Callable[[Progress], None] | None, started: float,
        max_tasks: int | None = None, *, stuck_s: float = math.inf, cancel_wait_s: float = CANCEL_WAIT_S,
    ) -> None:
        self._executor = Workers(workers, "trainpipe-transfer")
        self.stuck_s, self.cancel_wait_s = stuck_s, cancel_wait_s
        self._moved_at = time.monotonic()  # when a byte last moved or a task last ended
        self._max_bytes = max_inflight_bytes
        self._max_tasks = max_tasks or TASKS_PER_WORKER * workers
        self._pending: set[Pending] = set()
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
        self._take_slot(nbytes)
        return self._executor.submit(lambda: self._run(nbytes, task))

    def start(self, begin: Callable[[], P], finish: Callable[[P], None]) -> None:
        """Once a slot is free, begin (on this thread) work that runs without a thread of ours, then finish it on a
        worker when it has ended; the slot is held until finish returns. A failure of either fails the pool."""
        self._take_slot(0)
        try:
            pending = begin()
        except BaseException as exc:
            self._end_task(0, exc)
            raise
        with self._cond:
            self._pending.add(pending)

        def ended() -> None:
            with self._cond:
                self._pending.discard(pending)
            try:
                self._executor.submit(lambda: self._run(0, lambda: finish(pending)))
            except RuntimeError as exc:  # shut down: only after a failure, whose error the caller already has
                self._end_task(0, exc)

        pending.add_done_callback(ended)

    def background(self, work: Callable[[], T]) -> Future[T]:
        """Run work on a worker outside the slots (it belongs to a task that holds one already)."""
        return self._executor.submit(work)

    def _take_slot(self, nbytes: int) -> None:
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

    def _run(self, nbytes: int, task: Callable[[], T]) -> T:
        try:
            if self.cancel.is_set():
                raise Cancelled()
            result = task()
        except BaseException as exc:
            self._end_task(nbytes, exc)
            raise
        self._end_task(nbytes, None)
        return result

    def _end_task(self, nbytes: int, error: BaseException | None) -> None:
        with self._cond:
            if error is not None:
                if self._error is None and not isinstance(error, Cancelled):
                    self._error = error
                self.cancel.set()
            self._tasks_in_flight -= 1
            self._bytes_in_flight -= nbytes
            self._moved_at = time.monotonic()
            self._cond.notify_all()

    def wait_idle(self) -> None:
        """Block until every submitted task has finished; raise the first failure, or PoolStuck naming what is in
        flight once nothing moved for stuck_s."""
        while True:
            with self._cond:
                if self._error is not None:
                    raise self._error
                if self._tasks_in_flight == 0:
                    return
                self._cond.wait(TICK_S)
                pending = list(self._pending)
                still_s = time.monotonic() - self._moved_at
            if still_s >= self.stuck_s:
                raise PoolStuck(f"the transfer moved no byte and finished no task for {still_s:.0f}s: "
                                f"stuck: {self.in_flight(pending)}: check the network and the store, run again")
            for work in pending:
                work.poll()
            self.report()

    def in_flight(self, pending: list[Pending] | None = None) -> str:
        """What the transfer is doing now, by name: its busy workers and the files its engines hold."""
        if pending is None:
            with self._cond:
                pending = list(self._pending)
        held = [str(getattr(work, "what", work)) for work in pending]
        doing = [*self._executor.busy(), *held[:5], *([f"{len(held) - 5} more files"] if len(held) > 5 else [])]
        return "; ".join(doing) or "nothing (a task was lost)"

    @contextmanager
    def running(self, undo: Callable[[], None]) -> Iterator[Pool]:
        """Schedule the transfer's tasks inside; leaving waits for all of them and reports the end. When anything
        fails, the rest are cancelled, undo() drops what they left, and the first failure is raised."""
        try:
            yield self
            self.wait_idle()
        except BaseException as exc:
            try:
                self.shutdown(cancel=True)
            except StorageError as stuck:
                # The transfer's own failure is what the caller must see; what would not stop is logged with it.
                log.error("after %s: %s", type(exc).__name__, stuck)
            undo()
            raise
        self.shutdown(cancel=False)
        self.report(final=True)

    def shutdown(self, *, cancel: bool) -> None:
        """Stop the workers (after their current task when cancelling) and, when cancelling, the engines' work in
        flight; wait up to cancel_wait_s for them. Raises PoolStuck naming each worker or engine request still
        running then: threads cannot be killed, so they are left behind (daemons: the process can still exit)."""
        stuck: list[str] = []
        if cancel:
            self.cancel.set()
            with self._cond:
                pending = list(self._pending)
            for work in pending:
                try:
                    work.cancel()
                except StorageError as exc:  # each cancel's wait is bounded; the others are still cancelled
                    stuck.append(str(exc))
        stuck += self._executor.shutdown(cancel_futures=cancel, timeout_s=self.cancel_wait_s)
        if stuck:
            raise PoolStuck(f"{len(stuck)} workers or requests still running {self.cancel_wait_s:g}s after the "
                            f"transfer {'was cancelled' if cancel else 'ended'}, left behind: {'; '.join(stuck)}")

    def set_totals(self, bytes_total: int, files_total: int) -> None:
        with self._cond:
            self.bytes_total, self.files_total = bytes_total, files_total
            self._totals_known = True

    def add_bytes(self, n: int) -> None:
        with self._cond:
            self.bytes_done += n
            self._moved_at = time.monotonic()

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
