"""What every provider's tests check of a cluster it just launched, written once: the provider contract
(infra/compute/providers/base.py) as seen from outside, whatever cloud answers it."""

from __future__ import annotations

from pathlib import Path

import pytest
from cloud_env import wait_for

from infra.compute.providers.base import Cluster, Provider
from infra.node.processes import NODE_TAG, tagged_processes


def unreached_key(tmp_path: Path) -> Path:
    """The key nodes are reached with: launch reads it before anything is paid for; simulated nodes are never reached
    with it (only stand-ins that answer are)."""
    key = tmp_path / "id_ed25519"
    key.write_text("a private key\n")
    return key


def assert_reports_launched_cluster(provider: Provider, cluster: Cluster, name: str, run_id: str) -> None:
    """describe, liveness, the cluster listing and preemption notices all agree with the launch."""
    described = provider.describe(name)
    assert described is not None and [n.address for n in described.nodes] == [n.address for n in cluster.nodes]
    assert provider.nodes_alive(cluster) == {n.name: True for n in cluster.nodes}
    [record] = [r for r in provider.list_clusters() if r.name == name]
    assert (record.run_id, record.nodes, record.owner_alive) == (run_id, 2, True)
    assert provider.preemption_notices(cluster) == []


def assert_replaces_only_the_lost(provider: Provider, cluster: Cluster) -> Cluster:
    """replace_nodes of the second node of a running 2-node cluster whose nodes all run on this machine (local,
    netns, ssh on loopback): the lost node's processes end and it comes back empty in the same place; the survivor's
    process (same pid) and files are untouched; the record and the listing follow."""
    survivor, lost = cluster.nodes
    for node in cluster.nodes:
        runner = provider.runner(cluster, node)
        runner.write_text(node.path("data", "staged.bin"), f"{node.name}\n")
        runner.start(["sleep", "300"], log_path=node.path("logs", "sleep.log"))
    wait_for(lambda: all(tagged_processes(NODE_TAG, node.name) for node in cluster.nodes), 30,
             "every node's process tagged")
    before = {p.pid for p in tagged_processes(NODE_TAG, survivor.name)}

    replaced = provider.replace_nodes(cluster, [lost.name])

    assert replaced.nodes == cluster.nodes, "same names, ranks, addresses and dirs"
    assert (replaced.name, replaced.run_id, replaced.created_at) == (cluster.name, cluster.run_id, cluster.created_at)
    assert provider.describe(cluster.name) == replaced, "the record follows the replacement"
    assert replaced.owner["replaced"] == {lost.name: 1}
    assert not tagged_processes(NODE_TAG, lost.name), "the lost node's processes outlived its replacement"
    assert {p.pid for p in tagged_processes(NODE_TAG, survivor.name)} == before, "a survivor's process was touched"
    assert Path(survivor.path("data", "staged.bin")).read_text() == f"{survivor.name}\n"
    assert not Path(lost.path("data", "staged.bin")).exists(), "the replacement inherited the lost node's files"
    assert all(Path(lost.path(sub)).is_dir() for sub in ("data", "ckpt", "logs"))
    assert provider.nodes_alive(replaced) == {n.name: True for n in cluster.nodes}
    [record] = [r for r in provider.list_clusters() if r.name == cluster.name]
    assert record.nodes == 2
    with pytest.raises(ValueError, match="cannot replace"):
        provider.replace_nodes(replaced, ["no-such-node"])
    return replaced

