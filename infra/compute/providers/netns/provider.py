"""provider netns: an emulated multi-host cluster on this one Linux machine (root only).

A node is a local node (LocalProvider: its directory, its record, its tagged processes, its marker and notices)
that is also a host of its own on the network: a network namespace with an address on the cluster's bridge
(infra.compute.providers.netns.emulation), links shaped to cluster.netns.link_mbit with tc tbf, and commands that
run inside it through `ip netns exec`. The orchestrator stays in the root namespace, where the bridge's own address
reaches every node.

Teardown is the local provider's, then the network: kill the cluster's processes, delete its dirs, then delete
whatever is left running in its namespaces, its veths, its bridge and its namespaces. The network objects are
named from the cluster's directory alone, so a fresh process (after the orchestrator was SIGKILLed) removes them.
list_clusters reports the clusters of this workspace from their records, like the local provider, and also any
netns group on the machine that nobody will remove: its record is gone and its owner is dead (a launch killed
halfway, a store whose process died), so `trainpipe sweep` leaves no namespace behind.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path

from infra.compute.access.remote import Runner
from infra.compute.providers.base import (
    Cluster,
    ClusterRecord,
    InvalidRequestError,
    LaunchError,
    Node,
    ReplacementUnavailable,
)
from infra.compute.providers.local import RECORD, LocalProvider, owner_alive
from infra.compute.providers.netns import emulation as netns
from infra.compute.providers.netns.emulation import NetnsError, NetnsRunner
from infra.compute.providers.owner import launcher
from infra.compute.spec import ClusterSpec
from infra.dataset.stagecache import node_cache_dir
from infra.workspace import workspace_dir

log = logging.getLogger(__name__)

# What list_clusters calls a group it found without a record; terminate takes the same name back.
ORPHAN = re.compile(rf"^(?:{netns.NODE_NS}|{netns.STORE_NS})-(?P<id>[0-9a-f]{{6}})$")


def netns_clusters_dir() -> Path:
    # Apart from the local provider's clusters: each provider lists (and the sweeper tears down) only its own.
    return workspace_dir() / "netns-clusters"


class NetnsProvider(LocalProvider):
    name = "netns"
    instance_type = "netns-node"

    def __init__(self, root: Path | None = None) -> None:
        super().__init__(root or netns_clusters_dir())

    def group(self, cluster_name: str) -> str:
        """The id in the names of the cluster's network objects: from its directory, so two workspaces that reuse
        a run id never share a namespace."""
        return netns.group_id(str(self._dir(cluster_name)))

    def launch(self, cluster_name: str, spec: ClusterSpec, run_id: str) -> Cluster:
        if (why := netns.problem()) is not None:
            raise InvalidRequestError(why)
        if spec.nodes > netns.MAX_NODES:
            raise InvalidRequestError(f"cluster.nodes is {spec.nodes}: provider netns puts a cluster on one /24, at "
                                      f"most {netns.MAX_NODES} nodes: lower cluster.nodes")
        gid = self.group(cluster_name)
        # Before the first object: a sweep running meanwhile sees a live owner and leaves the group alone.
        netns.write_state(gid, {"kind": "cluster", "name": cluster_name, "run_id": run_id,
                                "record": str(self._dir(cluster_name) / RECORD), "owner": launcher(),
                                "created_at": time.time(), "relaunch": spec.netns.relaunch})
        try:
            netns.create_cluster_network(gid, spec.nodes, spec.netns.link_mbit)
            cluster = super().launch(cluster_name, spec, run_id)
        except BaseException as exc:
            # Everything this launch made goes; a data dir an earlier attempt staged (a recovery's relaunch) stays.
            try:
                self._terminate(cluster_name, keep_data=True)
            except (NetnsError, OSError) as cleanup:
                log.error("netns cluster %s: rolling back the failed launch failed too: %s", cluster_name, cleanup)
            if isinstance(exc, (NetnsError, OSError)):
                raise LaunchError(f"netns cluster {cluster_name}: {exc}") from exc
            raise
        shaped = f"{spec.netns.link_mbit:g} Mbit/s links" if spec.netns.link_mbit else "unshaped links"
        log.info("netns cluster %s: %s on %s", cluster_name, ", ".join(n.address for n in cluster.nodes), shaped)
        return cluster

    def terminate_keeping_data(self, cluster_name: str) -> bool:
        """As on local nodes, unless the cluster was launched with `netns.relaunch: new-machines` (a cloud's
        relaunch, emulated): then its nodes' data dirs and dataset caches go too."""
        group = netns.groups().get(self.group(cluster_name))
        if group is None or (group.state or {}).get("relaunch") != "new-machines":
            return super().terminate_keeping_data(cluster_name)
        cluster = self.describe(cluster_name)
        ended = self.terminate(cluster_name)
        for node in cluster.nodes if cluster is not None else ():
            shutil.rmtree(node_cache_dir(self.name, node.workdir), ignore_errors=True)
        log.info("netns cluster %s: ended as new-machines (no node's data or cache kept for the relaunch)",
                 cluster_name)
        return ended

    def _check_replaceable(self, cluster: Cluster, node: Node) -> None:
        # The replacement is the same host on the network: its namespace (address, shaped link) must still be there.
        namespace = netns.node_namespace(self.group(cluster.name), node.rank)
        if namespace not in netns.namespaces():
            raise ReplacementUnavailable(f"{node.name}: its network namespace {namespace} is gone: the cluster's "
                                         "network is torn down")

    def _node_address(self, cluster_name: str, rank: int) -> str:
        return netns.namespace_address(netns.node_namespace(self.group(cluster_name), rank))

    def _terminate(self, cluster_name: str, keep_data: bool) -> bool:
        if match := ORPHAN.fullmatch(cluster_name):
            return self._remove_network(match["id"])
        # Processes and dirs first (SIGTERM, then SIGKILL after a grace): what runs inside goes before its network.
        local = super()._terminate(cluster_name, keep_data)
        return self._remove_network(self.group(cluster_name)) or local

    def _remove_network(self, gid: str) -> bool:
        if gid not in netns.groups():
            return False
        if (why := netns.problem()) is not None:
            raise NetnsError(f"netns group {gid} is left but cannot be removed here: {why}")
        removed = netns.remove_group(gid)
        log.info("removed netns group %s (namespaces, veths, bridge)", gid)
        return removed

    def list_clusters(self) -> list[ClusterRecord]:
        records = super().list_clusters()
        known = {self.group(record.name) for record in records}
        for group in netns.groups().values():
            if group.gid in known or not _orphaned(group):
                continue
            state = group.state or {}
            prefix = netns.STORE_NS if group.is_store else netns.NODE_NS
            records.append(ClusterRecord(
                name=f"{prefix}-{group.gid}", provider=self.name, run_id=str(state.get("run_id", "-")),
                created_at=float(state.get("created_at", 0.0)), nodes=len(group.node_namespaces), owner_alive=False,
                processes=len(netns.group_pids(group)),
            ))
        return records

    def _tags(self, cluster: Cluster, node: Node) -> dict[str, str]:
        # Not a tag, but every process of the node needs it: gloo advertises the address the hostname resolves to,
        # which here is the machine's (127.0.0.1 in the namespace); the node's own NIC is what its peers can reach.
        return {**super()._tags(cluster, node), "GLOO_SOCKET_IFNAME": netns.INNER_IF}

    def runner(self, cluster: Cluster, node: Node) -> Runner:
        return NetnsRunner(node.name, Path(node.workdir), self._tags(cluster, node),
                           netns.node_namespace(self.group(cluster.name), node.rank))

    def set_link_mbit(self, cluster_name: str, mbit: float | None) -> int:
        """Reshape a running cluster's links (both directions) to mbit, None for unshaped; how many links."""
        return netns.shape_group(self.group(cluster_name), mbit)


def _orphaned(group: netns.Group) -> bool:
    """Nobody will remove this group: no live owner (a launch, a teardown or a store at work) and no record
    (whose workspace's own sweep would find it)."""
    state = group.state or {}
    owner = state.get("owner")
    if owner and owner_alive(owner):
        return False
    record = state.get("record")
    return not (record and Path(record).is_file())
