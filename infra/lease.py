"""The orchestrator's side of the node lease: renew it on every node while the run is alive.

A daemon thread, so it dies with the orchestrator process: that silence is exactly what the nodes'
watchdogs (infra.node.watch) act on.
"""

from __future__ import annotations

import logging
import threading
import time

from infra.providers.base import Cluster, Provider

log = logging.getLogger(__name__)

LEASE_FILE = "lease"


class LeaseKeeper:
    def __init__(self, provider: Provider, cluster: Cluster, interval_s: float) -> None:
        self._runners = [(node, provider.runner(cluster, node)) for node in cluster.nodes]
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_forever, name=f"lease-{cluster.name}", daemon=True)

    def start(self) -> LeaseKeeper:
        self.renew()
        self._thread.start()
        return self

    def renew(self) -> None:
        now = f"{time.time():.3f}\n"
        for node, runner in self._runners:
            runner.write_text(node.path(LEASE_FILE), now)

    def _renew_forever(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.renew()
            except OSError as exc:
                # A node we cannot reach right now may answer at the next renewal, well within the TTL.
                log.warning("lease renewal failed (%s): retrying in %.0fs", exc, self._interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval_s + 5)
