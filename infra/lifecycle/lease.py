"""The orchestrator's side of the lease: renew it on every node, and the cluster's heartbeat, while the run is alive.

Daemon threads, so they die with the orchestrator process: that silence is exactly what the nodes' watchdogs
(infra.node.watch) and the sweeper on any other machine (the cluster's heartbeat, on the clouds) act on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from infra.compute.providers.base import Cluster, Provider

log = logging.getLogger(__name__)

LEASE_FILE = "lease"
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


class LeaseKeeper:
    """The node lease files (what each node's watchdog reads) and the provider's heartbeat of the cluster (what a
    sweeper reads), each renewed on its own thread: a node that takes long to answer never delays the other."""

    def __init__(self, provider: Provider, cluster: Cluster, interval_s: float) -> None:
        self._provider = provider
        self._cluster = cluster
        self._runners = [(node, provider.runner(cluster, node)) for node in cluster.nodes]
        self._renewals = [Renewal(f"node leases of {cluster.name}", self.renew, interval_s),
                          Renewal(f"heartbeat of {cluster.name}", self.heartbeat, interval_s)]

    def start(self) -> LeaseKeeper:
        self.heartbeat()
        self.renew()
        for renewal in self._renewals:
            renewal.start()
        return self

    def renew(self) -> None:
        now = f"{time.time():.3f}\n"
        for node, runner in self._runners:
            runner.write_text(node.path(LEASE_FILE), now)

    def heartbeat(self) -> None:
        self._provider.heartbeat(self._cluster)

    def stop(self) -> None:
        for renewal in self._renewals:
            renewal.stop()
