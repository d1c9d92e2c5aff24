"""Something renewed on a daemon thread while its process lives: a cluster's heartbeat while a cloud provider launches
it (infra.compute.providers.cloud), then the run's node leases and heartbeat (infra.lifecycle.lease.LeaseKeeper).

A daemon thread dies with the process: that silence is what the nodes' watchdogs and the sweeper act on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

# Renewed several times per TTL, so one slow or failed renewal never expires a healthy lease.
RENEWALS_PER_TTL = 6


class Renewal:
    """Calls renew every interval_s on a daemon thread until stopped. A failed renewal is logged and tried again at
    the next one: a lease lasts several intervals, so one slow or failed renewal never lets it expire."""

    def __init__(self, what: str, renew: Callable[[], None], interval_s: float) -> None:
        self.what = what
        self._renew = renew
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_forever, name=f"renew-{what}", daemon=True)

    def start(self) -> Renewal:
        self._thread.start()
        return self

    def _renew_forever(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._renew()
            except Exception as exc:  # a renewal thread that died would let a live lease expire
                log.warning("%s: renewal failed (%s: %s): retrying in %.0fs", self.what, type(exc).__name__, exc,
                            self._interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval_s + 5)
