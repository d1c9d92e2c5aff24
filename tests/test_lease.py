"""The node lease watchdog: a node that stops hearing from its orchestrator ends its own processes.

Real processes on a real local cluster; only the TTLs are shortened so the test takes seconds.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from infra.compute.access.remote import Process
from infra.compute.providers.base import Cluster
from infra.compute.providers.local import LocalProvider
from infra.job.spec import ClusterSpec
from infra.lifecycle.lease import LEASE_FILE, LeaseKeeper
from infra.node.events import parse

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
        watchdogs.append(runner.start([node.python, "-m", "infra.node", "watch", "--lease", node.path(LEASE_FILE),
                                       "--ttl", str(TTL_S), "--poll", "0.2"]))
    return workloads, watchdogs


def events(process: Process) -> list[dict]:
    return [e for e in (parse(line) for line in process.tail(100).splitlines()) if e]


def test_without_renewals_every_node_ends_its_processes(cluster: tuple[LocalProvider, Cluster]) -> None:
    provider, launched = cluster
    workloads, watchdogs = start_workload_and_watchdog(provider, launched)

    assert [w.wait(timeout=30) for w in watchdogs] == [0, 0]
    for workload in workloads:
        assert workload.wait(timeout=10) is not None
    for watchdog in watchdogs:
        down = [e for e in events(watchdog) if e["event"] == "node-down"]
        assert down == [{"event": "node-down", "killed": 1}]


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
    expired = [e for w in watchdogs for e in events(w) if e["event"] == "lease-expired"]
    assert len(expired) == 2 and all(e["age_s"] >= TTL_S for e in expired)
