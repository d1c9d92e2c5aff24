"""The orchestrator's side of the lease: renew it on every node, and the cluster's heartbeat, while the run is alive.

Daemon threads, so they die with the orchestrator process: that silence is exactly what the nodes' watchdogs
(infra.node.watchdog) and the sweeper on any other machine (the cluster's heartbeat, on the clouds) act on.
"""

from __future__ import annotations

import logging
import threading
import time

from infra.compute.access.remote import Runner
from infra.compute.providers.base import Cluster, Provider
from infra.compute.renewal import Renewal
from infra.errors import is_transient
from infra.node.watchdog import LEASE_FILE

log = logging.getLogger(__name__)

# The first leases, before any renewal thread runs: a fresh connection's first write may be slow on a loaded machine,
# and a node that cannot get its lease at all fails the provision (retried when transient).
START_WRITE_DEADLINE_S = 60.0


class LeaseError(RuntimeError):
    """Nodes that could not be given their lease: transient when every node's failure was."""

    def __init__(self, cluster_name: str, missed: dict[str, BaseException]) -> None:
        super().__init__(f"{cluster_name}: no lease written on " + "; ".join(
            f"{node} ({type(exc).__name__}: {exc})" for node, exc in missed.items()))
        self.missed = missed
        self.transient = all(is_transient(exc) for exc in missed.values())


class _LeaseWrite(threading.Thread):
    """One node's lease write of one round, on its own daemon thread: a node that blocks holds up only itself."""

    def __init__(self, node_name: str, runner: Runner, path: str, text: str) -> None:
        super().__init__(name=f"lease-{node_name}", daemon=True)
        self._runner, self._path, self._text = runner, path, text
        self.started_at = time.monotonic()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._runner.write_text(self._path, self._text)
        except Exception as exc:  # handed to the round that started it, which logs it
            self.error = exc


class LeaseKeeper:
    """The node lease files (what each node's watchdog reads) and the provider's heartbeat of the cluster (what a
    sweeper reads), each renewed on its own thread.

    Every node's lease is written at once, each within write_deadline_s: a node that fails or blocks (an SSH
    connection that waits a minute for keepalives and reconnects) is logged and never delays another node's lease,
    so a healthy node's watchdog never powers it off because a peer stopped answering."""

    def __init__(self, provider: Provider, cluster: Cluster, interval_s: float,
                 write_deadline_s: float | None = None) -> None:
        self._provider = provider
        self._cluster = cluster
        self._interval_s = interval_s
        # Half an interval: a round that waits out a blocked node still renews the others well within the TTL.
        self._write_deadline_s = interval_s / 2 if write_deadline_s is None else write_deadline_s
        self._runners = [(node, provider.runner(cluster, node)) for node in cluster.nodes]
        self._writes: dict[str, _LeaseWrite] = {}  # each node's latest write, finished or not
        self._renewals = [Renewal(f"node leases of {cluster.name}", self.renew, interval_s),
                          Renewal(f"heartbeat of {cluster.name}", self.heartbeat, interval_s)]

    def start(self) -> LeaseKeeper:
        """The first heartbeat and leases now (a node that cannot get its lease fails the start), then renewals."""
        self.heartbeat()
        missed = self.renew(max(self._write_deadline_s, START_WRITE_DEADLINE_S))
        if missed:
            raise LeaseError(self._cluster.name, missed)
        for renewal in self._renewals:
            renewal.start()
        return self

    def renew(self, deadline_s: float | None = None) -> dict[str, BaseException]:
        """One round: every node's lease written in parallel. Returns the nodes not renewed this round (each logged):
        its write failed, is still blocked at the deadline, or an earlier round's write to it still blocks."""
        text = f"{time.time():.3f}\n"
        missed: dict[str, BaseException] = {}
        started: dict[str, _LeaseWrite] = {}
        for node, runner in self._runners:
            earlier = self._writes.get(node.name)
            if earlier is not None and earlier.is_alive():
                # One write in flight per node: a node that blocks never piles up threads.
                missed[node.name] = TimeoutError(
                    f"its lease write of {time.monotonic() - earlier.started_at:.0f}s ago is still blocked")
                continue
            write = self._writes[node.name] = started[node.name] = _LeaseWrite(
                node.name, runner, node.path(LEASE_FILE), text)
            write.start()
        deadline_s = self._write_deadline_s if deadline_s is None else deadline_s
        deadline = time.monotonic() + deadline_s
        for write in started.values():
            write.join(max(0.0, deadline - time.monotonic()))
        for name, write in started.items():
            if write.is_alive():
                missed[name] = TimeoutError(f"its lease write is still blocked after {deadline_s:.1f}s")
            elif write.error is not None:
                missed[name] = write.error
        for name, exc in missed.items():
            log.warning("%s: lease of %s not renewed (%s: %s): the other nodes' are; trying it again in %.1fs",
                        self._cluster.name, name, type(exc).__name__, exc, self._interval_s)
        return missed

    def heartbeat(self) -> None:
        self._provider.heartbeat(self._cluster)

    def stop(self) -> None:
        for renewal in self._renewals:
            renewal.stop()
