"""The run's one cancellation token: a signal (Ctrl-C, SIGTERM) or a Prefect cancel sets it, and every sleep or poll
loop that can outlast a cancel (SSH and boot waits, remote commands, the cloud's own waits, worker threads) waits on
it, so a cancelled run's threads stop at their next poll instead of running on to their own deadlines.

One per process: a run is one process (`trainpipe run`, or the subprocess a Prefect worker starts per flow run).
Teardown runs inside shield() (per thread; in_parallel carries it to its workers): there the waits keep their own
deadlines and a later signal only marks the token, so a cancel never interrupts the teardown it asks for."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
Handler = Callable[[int, FrameType | None], Any]


class Cancelled(Exception):
    """The run was cancelled: stop waiting, let teardown run. Never transient: nothing retries it."""

    transient = False


class CancelToken:
    def __init__(self) -> None:
        self._cancelled = threading.Event()
        self._hurry = threading.Event()
        self.reason = ""
        self.signum: int | None = None  # the first signal that cancelled, when one did
        self._local = threading.local()  # shield depth, per thread: teardown's threads only

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def hurried(self) -> bool:
        """Asked twice: skip the checkpoint flush (teardown still runs)."""
        return self._hurry.is_set()

    @property
    def shielded(self) -> bool:
        """This thread is tearing down: a cancel does not stop it."""
        return getattr(self._local, "depth", 0) > 0

    def cancel(self, reason: str, signum: int | None = None) -> None:
        if not self._cancelled.is_set():
            self.reason, self.signum = reason, signum
            log.warning("cancelling the run: %s", reason)
        self._cancelled.set()

    def interrupted(self, exc: BaseException) -> None:
        """An interrupt unwinding the main thread (a BaseException that is no Exception: Prefect's TerminationSignal,
        KeyboardInterrupt) cancels the token, so the threads it leaves behind stop at their next wait. How a SIGTERM
        reaches the token where Prefect's own SIGTERM handler must stay installed (signals_cancel)."""
        if not isinstance(exc, Exception):
            self.cancel(f"{type(exc).__name__} received", getattr(exc, "signal", None))

    def hurry(self, reason: str) -> None:
        self.cancel(reason)
        if not self._hurry.is_set():
            log.warning("cancelled again (%s): skipping the checkpoint flush, tearing down", reason)
        self._hurry.set()

    def check(self) -> None:
        """Raises Cancelled once the run is cancelled."""
        if self._cancelled.is_set() and not self.shielded:
            raise Cancelled(f"run cancelled ({self.reason})")

    def wait(self, timeout: float) -> None:
        """Sleep up to timeout seconds; a cancel ends the sleep at once with Cancelled (not in a shielded thread,
        whose waits are teardown's own)."""
        if self.shielded:
            time.sleep(max(0.0, timeout))
        elif self._cancelled.wait(max(0.0, timeout)):
            self.check()

    @contextmanager
    def shield(self) -> Iterator[None]:
        """Teardown: a signal inside only marks the token, it raises nothing into the code tearing down."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def carried(self, work: Callable[..., T]) -> Callable[..., T]:
        """work, to run on another thread as shielded as this one is now (teardown's workers are teardown too)."""
        if not self.shielded:
            return work

        def shielded_work(*args: Any, **kwargs: Any) -> T:
            with self.shield():
                return work(*args, **kwargs)

        return shielded_work

    def reset(self) -> None:
        """For a process that runs flows one after the other (tests): the next run starts uncancelled."""
        self._cancelled.clear()
        self._hurry.clear()
        self.reason, self.signum = "", None


CANCEL = CancelToken()


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def cancelling_handler(stop: Handler, token: CancelToken = CANCEL) -> Handler:
    """A handler that cancels the token and calls stop (which raises, to unwind the main thread into teardown) on the
    first signal; on a second it asks to hurry (no flush) and raises Cancelled, out of the flush wait. Inside
    token.shield() (teardown) it only marks the token."""

    def handle(signum: int, frame: FrameType | None) -> None:
        first = not token.cancelled
        if first:
            token.cancel(f"{signal_name(signum)} received", signum)
        else:
            token.hurry(f"{signal_name(signum)} received again")
        if token.shielded:
            return
        if first:
            stop(signum, frame)
        else:
            raise Cancelled(f"run cancelled twice ({signal_name(signum)}): flush skipped")

    return handle


@contextmanager
def signals_cancel(stop_signal: int = signal.SIGTERM, also: tuple[int, ...] = (signal.SIGINT,),
                   token: CancelToken = CANCEL) -> Iterator[None]:
    """Within the block (main thread only; elsewhere it does nothing): stop_signal and every signal in `also` cancel
    the token, then unwind the main thread as stop_signal's current handler would (Prefect's raises its termination
    signal, so its own cancel and crash handling still apply); the previous handlers are back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    current = signal.getsignal(stop_signal)

    def stop(signum: int, frame: FrameType | None) -> None:
        if callable(current):
            current(stop_signal, frame)
        else:  # SIG_DFL or SIG_IGN: nothing to unwind with but our own exception
            raise Cancelled(f"run cancelled ({signal_name(signum)})")

    handler = cancelling_handler(stop, token)
    # Prefect's runner acknowledges a cancel (and ends the run Cancelled) only while its own SIGTERM bridge is the
    # installed handler (an identity check): that one stays, and its TerminationSignal cancels the token where it
    # unwinds the waits (CancelToken.interrupted). Replaced, a cancel from the API ended the run Crashed.
    prefects = getattr(current, "__module__", "").startswith("prefect.")
    ours = (*also,) if prefects else (stop_signal, *also)
    previous = {signum: signal.signal(signum, handler) for signum in ours}
    try:
        yield
    except BaseException as exc:
        token.interrupted(exc)
        raise
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
