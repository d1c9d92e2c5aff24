"""What every cloud provider's tests check of a cluster it just launched, written once: the provider contract
(infra/compute/providers/base.py) as seen from outside, whatever cloud answers it."""

from __future__ import annotations

from infra.compute.providers.base import Cluster, Provider


def assert_reports_launched_cluster(provider: Provider, cluster: Cluster, name: str, run_id: str) -> None:
    """describe, liveness, the cluster listing and preemption notices all agree with the launch."""
    described = provider.describe(name)
    assert described is not None and [n.address for n in described.nodes] == [n.address for n in cluster.nodes]
    assert provider.nodes_alive(cluster) == {n.name: True for n in cluster.nodes}
    [record] = [r for r in provider.list_clusters() if r.name == name]
    assert (record.run_id, record.nodes, record.owner_alive) == (run_id, 2, True)
    assert provider.preemption_notices(cluster) == []
