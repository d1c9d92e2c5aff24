"""Stalled requests: a request that moves no byte for the transfer's stall bound (TransferConfig.stall_timeout_s)
is cancelled and retried, however its connection failed to say so (a path that stops forwarding, held open, sends
neither a reset nor a FIN: without this, only the CRT's throughput check (~30 s) or nothing at all would notice).

The waits after a cancel are bounded too: an engine that does not let go of a cancelled request fails the
transfer with a line naming it instead of hanging it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable

from infra.storage.base import StorageError
from infra.storage.cloud import TransientStorageError

CANCEL_WAIT_S = 10.0  # how long an engine may take to let go of a request once it was cancelled


class StalledRequest(TransientStorageError):
    """No byte moved for the stall bound: the request was cancelled, and is worth retrying on a new connection."""


class StallWatch:
    """When one request last moved a byte; stalled once that is the bound ago.

    link, when given, says how long ago the engine's connections last moved a byte, for a request whose own
    progress shows only in large steps (a CRT GET's whole parts): it is stalled only once the link is still too.
    """

    def __init__(self, bound_s: float, link: Callable[[], float] | None = None) -> None:
        self.bound_s, self.link = bound_s, link
        self._last = time.monotonic()
        self._mark: object = None
        self._lock = threading.Lock()

    def moved(self, *_args: object) -> None:
        """Progress now (usable as a progress callback, from any thread)."""
        with self._lock:
            self._last = time.monotonic()

    def saw(self, mark: object) -> None:
        """Progress when mark (what the request has moved so far: a file's size) changed since the last look."""
        with self._lock:
            if mark != self._mark:
                self._mark, self._last = mark, time.monotonic()

    @property
    def idle_s(self) -> float:
        with self._lock:
            own = time.monotonic() - self._last
        return own if self.link is None or own < self.bound_s else min(own, self.link())

    def stalled(self) -> bool:
        return self.idle_s >= self.bound_s

    def error(self, what: str) -> StalledRequest:
        return StalledRequest(f"{what}: stalled: no byte moved for {self.idle_s:.1f}s (stall_timeout_s="
                              f"{self.bound_s:g}): cancelled, to retry on a new connection")


def ended_after_cancel(futures: Iterable[concurrent.futures.Future[object]], what: str) -> None:
    """Wait, bounded, for cancelled requests to end; raise when the engine still holds one."""
    _done, running = concurrent.futures.wait(list(futures), timeout=CANCEL_WAIT_S)
    if running:
        raise StorageError(f"{what}: {len(running)} requests still running {CANCEL_WAIT_S:g}s after they were "
                           "cancelled: the storage engine does not let go of them; run again, and report it if it "
                           "recurs")
