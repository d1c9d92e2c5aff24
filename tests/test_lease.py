"""The node lease watchdog: a node that stops hearing from its orchestrator ends its own processes.

Real processes on a real local cluster; only the TTLs are shortened so the test takes seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from said import listening

from infra.compute.access.agent import NodeAgent
from infra.compute.access.remote import LocalRunner, Process, RemoteError
from infra.compute.providers.base import Cluster, Node
from infra.compute.providers.local import LocalProvider
from infra.compute.spec import ClusterSpec
from infra.lifecycle.lease import LeaseError, LeaseKeeper
from infra.node.events import Event, NodeEvent, parse
from infra.node.protocol import WatchRequest
from infra.node.watchdog import LEASE_FILE

TTL_S = 2.0


@pytest.fixture
def cluster(tmp_path: Path) -> tuple[LocalProvider, Cluster]:
    provider = LocalProvider(tmp_path / "clusters")
    cluster = provider.launch("tp-lease", ClusterSpec(nodes=2), "lease-run")
    yield provider, cluster
    provider.terminate(cluster.name)


def start_workload_and_watchdog(provider: LocalProvider, cluster: Cluster) -> tuple[list[Process], list[Process]]:
    workloads, watchdogs = [], []
    for node in cluster.nodes:
        runner = provider.runner(cluster, node)
        workloads.append(runner.start(["sleep", "600"]))
        watchdogs.append(NodeAgent(runner, node.python).start(
            WatchRequest(lease=node.path(LEASE_FILE), ttl_s=TTL_S, poll_s=0.2)))
    return workloads, watchdogs


def events(process: Process) -> list[Event]:
    return [e for e in (parse(line) for line in process.tail(100).splitlines()) if e]


def test_without_renewals_every_node_ends_its_processes(cluster: tuple[LocalProvider, Cluster]) -> None:
    provider, launched = cluster
    workloads, watchdogs = start_workload_and_watchdog(provider, launched)

    assert [w.wait(timeout=30) for w in watchdogs] == [0, 0]
    for workload in workloads:
        assert workload.wait(timeout=10) is not None
    for watchdog in watchdogs:
        down = [e for e in events(watchdog) if e.kind is NodeEvent.NODE_DOWN]
        assert down == [Event(NodeEvent.NODE_DOWN, {"killed": 1, "containers": 0})]


def test_renewed_lease_keeps_nodes_alive_until_renewals_stop(cluster: tuple[LocalProvider, Cluster]) -> None:
    provider, launched = cluster
    keeper = LeaseKeeper(provider, launched, interval_s=0.3).start()
    workloads, watchdogs = start_workload_and_watchdog(provider, launched)
    try:
        time.sleep(TTL_S * 2.5)
        assert [w.poll() for w in workloads] == [None, None], "a renewed lease expired"
    finally:
        keeper.stop()
    assert [w.wait(timeout=60) for w in watchdogs] == [0, 0]
    assert all(w.poll() is not None for w in workloads)
    expired = [e for w in watchdogs for e in events(w) if e.kind is NodeEvent.LEASE_EXPIRED]
    assert len(expired) == 2 and all(e["age_s"] >= TTL_S for e in expired)


class StuckRunner(LocalRunner):
    """A node the orchestrator cannot write to once `broken` is set: its writes block until `released`
    (a connection waiting out keepalives and reconnects), or fail at once (a connection refused)."""

    def __init__(self, runner: LocalRunner, broken: threading.Event, released: threading.Event,
                 how: str) -> None:
        super().__init__(runner.node_name, runner.workdir, runner.tags)
        self.broken, self.released, self.how = broken, released, how

    def write_text(self, path: str, text: str) -> None:
        if self.broken.is_set():
            if self.how == "fails":
                raise ConnectionError(f"{self.node_name}: connection refused")
            self.released.wait(120)
        super().write_text(path, text)


class StuckNodes(LocalProvider):
    def __init__(self, root: Path, stuck: dict[str, str]) -> None:
        super().__init__(root)
        self.stuck, self.broken, self.released = stuck, threading.Event(), threading.Event()

    def runner(self, cluster: Cluster, node: Node) -> LocalRunner:
        runner = super().runner(cluster, node)
        how = self.stuck.get(node.name)
        return runner if how is None else StuckRunner(runner, self.broken, self.released, how)


def lease_of(node: Node) -> float:
    return float(Path(node.path(LEASE_FILE)).read_text())


def test_a_node_whose_lease_write_blocks_or_fails_does_not_starve_the_others(tmp_path: Path) -> None:
    provider = StuckNodes(tmp_path / "clusters", {})
    cluster = provider.launch("tp-lease-stuck", ClusterSpec(nodes=3), "lease-stuck")
    blocked, failing, healthy = cluster.nodes
    provider.stuck = {blocked.name: "blocks", failing.name: "fails"}
    keeper = LeaseKeeper(provider, cluster, interval_s=0.2).start()
    try:
        with listening("infra.lifecycle.lease") as said:
            provider.broken.set()
            frozen = {node.name: lease_of(node) for node in (blocked, failing)}
            renewed, deadline = [lease_of(healthy)], time.monotonic() + 60
            while len(set(renewed)) < 4:  # three renewals of the healthy node after its peers broke
                assert time.monotonic() < deadline, f"the healthy node's lease was renewed only at {set(renewed)}"
                time.sleep(0.05)
                renewed.append(lease_of(healthy))
        assert {node.name: lease_of(node) for node in (blocked, failing)} == frozen
        warned = said.messages
        assert any(blocked.name in m and "still blocked" in m for m in warned), warned
        assert any(failing.name in m and "connection refused" in m for m in warned), warned
        # The blocked node holds one write in flight, not one more per round.
        assert len([t for t in threading.enumerate() if t.name == f"lease-{blocked.name}"]) == 1
    finally:
        provider.released.set()
        keeper.stop()
        provider.terminate(cluster.name)


def test_a_node_that_gets_no_lease_at_start_fails_the_start(tmp_path: Path) -> None:
    provider = StuckNodes(tmp_path / "clusters", {})
    cluster = provider.launch("tp-lease-start", ClusterSpec(nodes=2), "lease-start")
    provider.stuck = {cluster.nodes[1].name: "fails"}
    provider.broken.set()
    try:
        with pytest.raises(LeaseError, match=f"{cluster.nodes[1].name} .*connection refused") as failed:
            LeaseKeeper(provider, cluster, interval_s=0.2).start()
        assert failed.value.transient, "a refused connection is worth the provision's retry"
        assert not [t for t in threading.enumerate() if t.name.startswith(f"renew-node leases of {cluster.name}")]
    finally:
        provider.terminate(cluster.name)


def renewing(cluster: Cluster) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"renew-node leases of {cluster.name}"]


class NoWatchdog(LocalRunner):
    def start(self, argv: Sequence[str], **kwargs: Any) -> Process:
        raise RemoteError(f"{self.node_name}: cannot start '{argv[0]}': no such file")


class WatchdogsFail(LocalProvider):
    def runner(self, cluster: Cluster, node: Node) -> LocalRunner:
        runner = super().runner(cluster, node)
        return NoWatchdog(runner.node_name, runner.workdir, runner.tags)


def test_a_provision_retry_leaves_one_lease_keeper_and_a_failed_start_none(tmp_path: Path) -> None:
    from tasks.cluster import _lease_keepers, _stop_lease, start_lease

    provider = LocalProvider(tmp_path / "clusters")
    cluster = provider.launch("tp-lease-retry", ClusterSpec(nodes=2), "lease-retry")
    try:
        start_lease(provider, cluster, ttl_s=60)
        first = _lease_keepers[cluster.name]
        start_lease(provider, cluster, ttl_s=60)  # what a retried provision does after tearing the first down
        assert _lease_keepers[cluster.name] is not first
        assert len(renewing(cluster)) == 1, "the first attempt's keeper still renews leases"
        _stop_lease(cluster.name)

        failing = WatchdogsFail(tmp_path / "clusters")
        with pytest.raises(RemoteError, match="cannot start"):
            start_lease(failing, cluster, ttl_s=60)
        assert cluster.name not in _lease_keepers and renewing(cluster) == []
    finally:
        _stop_lease(cluster.name)
        provider.terminate(cluster.name)
