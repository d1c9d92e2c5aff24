"""Microsoft Azure: a cluster is one resource group holding N VMs in one availability set pinned to one proximity
placement group, found again by the group's tags.

Why standalone VMs in an availability set and not a VM scale set: InfiniBand on the ND-series connects VMs of one
availability set (or one scale set), and the proximity placement group keeps them in one datacenter; standalone VMs
keep one name, rank and NIC per node, so a lost node is replaced alone, in the same set and group, by the same calls
that launched it, and the launch stays all-or-none by our own rollback (a scale set's partial allocations and its
instance naming would have to be undone through a second API).

Everything of a cluster lives in its group (network security group, virtual network, placement group, availability
set, and per node a public IP, a NIC and the VM), so teardown is one delete of the group and nothing can leak beside
it. The group carries the cluster's tags and the orchestrator's heartbeat; each VM carries its rank and the fingerprint
of the host key it booted with. A NIC and a public IP are made to go with their VM (deleteOption Delete): an evicted
Spot VM (eviction policy Delete) leaves nothing billed behind.

Nodes carry a managed identity (cluster.azure.identity), so they reach the store with tokens from the instance
metadata service, never with keys; Spot VMs get a max price from cluster.max_price_per_hour (per node), and the nodes'
watchers read Azure's Scheduled Events (`Preempt`) for the notice (infra.node.preemption_notice). A VM that powers
itself off is only stopped, and billed: with that identity, the custom data makes a power-off delete the VM
(infra.node.azure_self_delete), so an expired lease ends the billing without waiting for the sweeper.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from azure.core.exceptions import ResourceNotFoundError

from infra.compute.access.agent_env import agent_python
from infra.compute.access.hostkeys import HostKey
from infra.compute.catalog import Catalog
from infra.compute.optimizer import Candidate
from infra.compute.providers.azure.arm import ArmApi, json_of
from infra.compute.providers.azure.boot import custom_data, user_identity
from infra.compute.providers.azure.config import IMAGE_ENV, AzureClusterSpec
from infra.compute.providers.azure.errors import (
    API_ERRORS,
    CapacityError,
    InvalidRequestError,
    LaunchError,
    classify,
)
from infra.compute.providers.azure.names import (
    AVAILABILITY_SET,
    NSG,
    PPG,
    STAMP_KEYS,
    SUBNET,
    SUBNET_PREFIX,
    TAG_CLUSTER,
    TAG_HEARTBEAT,
    TAG_HOST_KEY,
    TAG_LEASE_TTL,
    TAG_NODES,
    TAG_RANK,
    VNET,
    VNET_PREFIX,
    created_time,
    group_name,
    nic_name,
    public_ip_name,
    rank_of,
    resource_id,
    tags_of,
    vm_name,
)
from infra.compute.providers.base import Cluster, ClusterRecord, Node, PreemptionNotice, ReplacementUnavailable
from infra.compute.providers.cloud import HOST_KEYS, LEASE_TTL, MOUNT, CloudProvider, lease_alive, rolled_back
from infra.compute.providers.node_notices import read_node_notices
from infra.compute.providers.operations import WATCH_ATTEMPTS, WATCH_TIMEOUT_S
from infra.compute.providers.owner import Stamp, launcher_stamp
from infra.compute.spec import ClusterSpec

log = logging.getLogger(__name__)

COMPUTE, NETWORK = "Microsoft.Compute", "Microsoft.Network"
ENDED = ("Failed", "Deleting")  # provisioning states of a VM that is gone or going
SPOT_NOTICE_S = 30.0  # the least notice Azure's Scheduled Events give a Spot VM before the eviction
LISTING_REUSE_S = 1.0  # the notices' VM listing answers the liveness asked right after it (the watch asks every 2 s)
OS_DISK_GB = 256
SSH_CIDR_ENV = "TRAINPIPE_SSH_CIDR"
PUBLIC_KEY_ENV = "TRAINPIPE_AZURE_SSH_PUBLIC_KEY"
METADATA_ENV = "TRAINPIPE_AZURE_METADATA_URL"


@dataclass(frozen=True)
class Shape:
    """What every VM of a cluster is: copied from a survivor when a node is replaced."""

    size: str
    spot: bool
    max_price: float  # USD per VM-hour; -1: up to the regular price (never evicted for price)
    identity: dict[str, Any]
    image: dict[str, str]
    user: str
    public_key: str


class AzureProvider(ArmApi, CloudProvider):
    name = "azure"
    key_hint = "a private key whose public key is TRAINPIPE_AZURE_SSH_PUBLIC_KEY (or the key file's .pub beside it)"
    boot_log = "/var/log/cloud-init-output.log"

    def __init__(self, catalog: Catalog | None = None, subscription: str | None = None, credential: Any = None,
                 endpoint: str | None = None, bootstrap: bool = True) -> None:
        # The subscription and the credential are resolved on first use, never here.
        super().__init__(catalog, bootstrap=bootstrap)
        self._subscription = subscription
        self._credential = credential
        self._endpoint = endpoint
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        # Where the nodes' watchers read Scheduled Events: Azure's instance metadata service unless told otherwise.
        self.notice_url = os.environ.get(METADATA_ENV) or None
        self._notice_listing: dict[str, tuple[float, dict[str, dict[str, Any]]]] = {}  # cluster: (when, its VMs)

    # -- launch -------------------------------------------------------------------------------------------------

    def launch_candidate(self, cluster_name: str, spec: ClusterSpec, run_id: str, candidate: Candidate,
                         host_key: HostKey) -> Cluster:
        """Every node on this candidate or none: on any failure the cluster's resource group is deleted."""
        group = group_name(cluster_name)
        region = candidate.region
        doing = f"launch {cluster_name} on {candidate.label()}"
        stamp = Stamp(cluster_name, run_id, launcher_stamp(), datetime.now(UTC).isoformat(timespec="seconds"),
                      f"{spec.lease_ttl_s:g}")
        shape = self._shape(spec, candidate)
        try:
            self._group(group, region, stamp, spec.nodes, doing)
            self._fabric(group, region, stamp, doing)
            names = [vm_name(cluster_name, rank) for rank in range(spec.nodes)]
            self._start_nodes(group, region, stamp, shape, list(enumerate(names)),
                              dict.fromkeys(names, host_key), doing)
            return self._cluster(cluster_name, group)
        except API_ERRORS as exc:
            failure: LaunchError = classify(exc, doing)
        except LaunchError as exc:
            failure = exc
        # Only this cluster's group (by its tag): a foreign one of the same name that _group refused is not ours.
        raise rolled_back(cluster_name, region, failure,
                          lambda: self._delete_group(group, f"roll back {cluster_name}", cluster_name))

    def _shape(self, spec: ClusterSpec, candidate: Candidate) -> Shape:
        section: AzureClusterSpec = spec.azure
        # Azure's max price is per VM; the job's cap is for the whole cluster.
        max_price = spec.max_price_per_hour / spec.nodes if spec.max_price_per_hour and candidate.spot else -1.0
        try:
            image = section.image_reference(os.environ.get(IMAGE_ENV))
        except ValueError as exc:
            raise InvalidRequestError(f"azure: {exc}") from None
        return Shape(candidate.instance_type, candidate.spot, round(max_price, 5), section.vm_identity(), image,
                     self.ssh_access()[0], self._public_key())

    def _public_key(self) -> str:
        """The public key the VMs' admin user accepts: Azure takes one at creation (no keyless Linux VM)."""
        key = os.environ.get(PUBLIC_KEY_ENV, "").strip()
        if key:
            return key
        public = Path(self.ssh_access()[1] + ".pub")
        try:
            return public.read_text().strip()
        except OSError:
            raise InvalidRequestError(f"azure: no public key for the VMs: set {PUBLIC_KEY_ENV} to the public key of "
                                      f"TRAINPIPE_SSH_KEY_FILE, or put it beside it as {public}") from None

    def _ssh_cidr(self) -> str:
        cidr = os.environ.get(SSH_CIDR_ENV, "").strip()
        if not cidr:
            raise InvalidRequestError(f"azure: {SSH_CIDR_ENV} is not set: the nodes' SSH is open only to the "
                                      "orchestrator's addresses; set it (e.g. 203.0.113.7/32)")
        return cidr

    def _group(self, group: str, region: str, stamp: Stamp, nodes: int, doing: str) -> None:
        """The cluster's resource group, in the candidate's region. One left in another region by an earlier try
        whose rollback failed is deleted first (a group cannot move)."""
        existing = self._get(lambda: self.resources.resource_groups.get(group))
        if existing is not None:
            if tags_of(existing).get(TAG_CLUSTER) != stamp.cluster:
                raise InvalidRequestError(f"azure: resource group {group} is not cluster {stamp.cluster}'s: delete it "
                                          "or rename the cluster")
            if existing["location"] != region:
                self._delete_group(group, doing, stamp.cluster)
        tags = {**stamp.keyed(STAMP_KEYS), TAG_NODES: str(nodes), TAG_HEARTBEAT: f"{time.time():.0f}"}
        self.resources.resource_groups.create_or_update(group, {"location": region, "tags": tags})

    def _fabric(self, group: str, region: str, stamp: Stamp, doing: str) -> None:
        """What the nodes share: SSH only from the orchestrator (all traffic inside the virtual network is allowed by
        Azure's default rules), one subnet, the placement group and the availability set pinned to it."""
        tags = stamp.keyed(STAMP_KEYS)
        rule = {"name": "ssh-from-orchestrator", "properties": {
            "protocol": "Tcp", "sourceAddressPrefix": self._ssh_cidr(), "sourcePortRange": "*",
            "destinationAddressPrefix": "*", "destinationPortRange": "22", "access": "Allow", "priority": 100,
            "direction": "Inbound"}}
        self._finish([self.network.network_security_groups.begin_create_or_update(
            group, NSG, {"location": region, "tags": tags, "properties": {"securityRules": [rule]}})], doing)
        subnet = {"name": SUBNET, "properties": {"addressPrefix": SUBNET_PREFIX, "networkSecurityGroup": {
            "id": resource_id(self.subscription, group, f"{NETWORK}/networkSecurityGroups", NSG)}}}
        self._finish([self.network.virtual_networks.begin_create_or_update(group, VNET, {
            "location": region, "tags": tags,
            "properties": {"addressSpace": {"addressPrefixes": [VNET_PREFIX]}, "subnets": [subnet]}})], doing)
        self.compute.proximity_placement_groups.create_or_update(group, PPG, {
            "location": region, "tags": tags, "properties": {"proximityPlacementGroupType": "Standard"}})
        # One fault and update domain: the nodes sit together on one InfiniBand fabric, and a maintenance event
        # takes them all (Scheduled Events say so) rather than one at a time mid-training.
        self.compute.availability_sets.create_or_update(group, AVAILABILITY_SET, {
            "location": region, "tags": tags, "sku": {"name": "Aligned"},
            "properties": {"platformFaultDomainCount": 1, "platformUpdateDomainCount": 1,
                           "proximityPlacementGroup": {"id": self._ppg_id(group)}}})

    def _ppg_id(self, group: str) -> str:
        return resource_id(self.subscription, group, f"{COMPUTE}/proximityPlacementGroups", PPG)

    def _start_nodes(self, group: str, region: str, stamp: Stamp, shape: Shape, nodes: list[tuple[int, str]],
                     host_keys: dict[str, HostKey], doing: str) -> None:
        """A public IP, a NIC and a VM per (rank, name), each kind started together and waited for; a VM already
        running in this shape (an earlier try of this launch) is adopted as it is, with the host key it booted with."""
        existing = {vm["name"]: vm for vm in self._vms(group)}
        adopted = {name for _, name in nodes if name in existing and self._fits(existing[name], shape)}
        for name in adopted:
            log.info("%s: adopting %s from an earlier try of this launch", stamp.cluster, name)
        todo = [(rank, name) for rank, name in nodes if name not in adopted]
        self._finish([self.compute.virtual_machines.begin_delete(group, name) for _, name in todo
                      if name in existing], doing)  # a failed VM, or one of another shape, holds the name
        tags = stamp.keyed(STAMP_KEYS)
        self._finish([self.network.public_ip_addresses.begin_create_or_update(group, public_ip_name(name), {
            "location": region, "tags": tags, "sku": {"name": "Standard"},
            "properties": {"publicIPAllocationMethod": "Static", "deleteOption": "Delete"}}) for _, name in todo],
            doing)
        subnet = f"{resource_id(self.subscription, group, f'{NETWORK}/virtualNetworks', VNET)}/subnets/{SUBNET}"
        self._finish([self.network.network_interfaces.begin_create_or_update(group, nic_name(name), {
            "location": region, "tags": tags, "properties": {
                "enableAcceleratedNetworking": True,
                "ipConfigurations": [{"name": "ipconfig1", "properties": {
                    "subnet": {"id": subnet}, "privateIPAllocationMethod": "Dynamic", "primary": True,
                    "publicIPAddress": {"id": resource_id(self.subscription, group,
                                                          f"{NETWORK}/publicIPAddresses", public_ip_name(name))}}}]}})
            for _, name in todo], doing)
        self._finish([self.compute.virtual_machines.begin_create_or_update(
            group, name, self._vm(group, region, name, rank, stamp, shape, host_keys[name])) for rank, name in todo],
            doing)
        self._check_running(group, [name for _, name in nodes])

    def _vm(self, group: str, region: str, name: str, rank: int, stamp: Stamp, shape: Shape,
            host_key: HostKey) -> dict[str, Any]:
        properties: dict[str, Any] = {
            "hardwareProfile": {"vmSize": shape.size},
            "storageProfile": {"imageReference": shape.image, "osDisk": {
                "createOption": "FromImage", "deleteOption": "Delete", "diskSizeGB": OS_DISK_GB,
                "managedDisk": {"storageAccountType": "Premium_LRS"}}},
            # With a user-assigned identity the VM deletes itself as it powers off, through the endpoint we call.
            "osProfile": {"computerName": name, "adminUsername": shape.user,
                          "customData": custom_data(host_key, user_identity(shape.identity), self.arm_endpoint),
                          "linuxConfiguration": {"disablePasswordAuthentication": True, "ssh": {"publicKeys": [
                              {"path": f"/home/{shape.user}/.ssh/authorized_keys", "keyData": shape.public_key}]}}},
            "networkProfile": {"networkInterfaces": [{
                "id": resource_id(self.subscription, group, f"{NETWORK}/networkInterfaces", nic_name(name)),
                "properties": {"primary": True, "deleteOption": "Delete"}}]},
            "availabilitySet": {"id": resource_id(self.subscription, group, f"{COMPUTE}/availabilitySets",
                                                  AVAILABILITY_SET)},
            "proximityPlacementGroup": {"id": self._ppg_id(group)},
            "priority": "Spot" if shape.spot else "Regular",
        }
        if shape.spot:
            properties.update(evictionPolicy="Delete", billingProfile={"maxPrice": shape.max_price})
        return {"location": region, "identity": shape.identity, "properties": properties,
                "tags": {**stamp.keyed(STAMP_KEYS), TAG_RANK: str(rank), TAG_HOST_KEY: host_key.fingerprint}}

    @staticmethod
    def _fits(vm: dict[str, Any], shape: Shape) -> bool:
        properties = vm.get("properties", {})
        return (properties.get("provisioningState") == "Succeeded"
                and properties.get("hardwareProfile", {}).get("vmSize") == shape.size
                and (properties.get("priority") == "Spot") == shape.spot)

    def _check_running(self, group: str, names: list[str]) -> None:
        """Every node provisioned; one that failed or is going (a Spot VM evicted while starting) fails the try."""
        found = {vm["name"]: vm for vm in self._vms(group)}
        gone = sorted(n for n in names if n not in found
                      or found[n].get("properties", {}).get("provisioningState") != "Succeeded")
        if gone:
            raise CapacityError(f"azure: {', '.join(gone)} not running after their creation (Spot evicted?): "
                                "trying elsewhere")

    def _vms(self, group: str, **options: Any) -> list[dict[str, Any]]:
        """options: azure-core's per-call ones (retry_total, read_timeout...)."""
        try:
            return sorted((json_of(vm) for vm in self.compute.virtual_machines.list(group, **options)), key=rank_of)
        except ResourceNotFoundError:
            return []

    def _cluster(self, cluster_name: str, group: str) -> Cluster:
        found = self._get(lambda: self.resources.resource_groups.get(group))
        vms = self._vms(group)
        if found is None or not vms:
            raise LaunchError(f"azure: cluster {cluster_name} has no VMs in resource group {group}")
        nics = {nic["name"]: nic for nic in map(json_of, self.network.network_interfaces.list(group))}
        ips = {ip["name"]: ip for ip in map(json_of, self.network.public_ip_addresses.list(group))}
        stamp = tags_of(found)
        # Every rank the cluster was launched with: Azure deletes an evicted Spot VM at once, and the record must
        # still name the node it lost (without an address: nodes_alive says it is gone) for its replacement.
        by_rank = {rank_of(vm): vm["name"] for vm in vms}
        ranks = range(max(int(stamp.get(TAG_NODES) or 0), max(by_rank) + 1))
        names = [by_rank.get(rank, vm_name(cluster_name, rank)) for rank in ranks]
        nodes = tuple(Node(
            name=name, rank=rank, address=_public_ip(ips.get(public_ip_name(name))),
            cluster_address=_private_ip(nics.get(nic_name(name))), workdir=f"{MOUNT}/trainpipe",
            data_dir=f"{MOUNT}/trainpipe/data", ckpt_dir=f"{MOUNT}/trainpipe/ckpt",
            python=agent_python(f"{MOUNT}/trainpipe"), node_python="python3",
        ) for rank, name in zip(ranks, names, strict=True))
        size = vms[0]["properties"]["hardwareProfile"]["vmSize"]
        spot = vms[0]["properties"].get("priority") == "Spot"
        launched = Stamp.read(stamp, STAMP_KEYS)
        # owner also says where the nodes are, so later calls (preemption, liveness) go straight to the group.
        owner = {"owner": launched.owner, "subscription": self.subscription, "resource_group": group,
                 "region": found["location"], "instance_type": size, LEASE_TTL: stamp.get(TAG_LEASE_TTL),
                 "instances": {vm["name"]: vm["properties"].get("vmId", "") for vm in vms},
                 HOST_KEYS: {vm["name"]: tags_of(vm)[TAG_HOST_KEY] for vm in vms if TAG_HOST_KEY in tags_of(vm)}}
        return Cluster(name=cluster_name, provider=self.name, run_id=launched.run_id, nodes=nodes,
                       created_at=created_time(stamp), owner=owner, instance_type=size,
                       market="spot" if spot else "on-demand")

    # -- replacing lost nodes -------------------------------------------------------------------------------------

    def placement(self, cluster: Cluster) -> str:
        return (f"proximity placement group {PPG} (availability set {AVAILABILITY_SET}) of resource group "
                f"{cluster.owner['resource_group']} in {cluster.owner['region']}")

    def end_nodes(self, cluster: Cluster, names: Sequence[str]) -> None:
        group, doing = cluster.owner["resource_group"], f"end {', '.join(names)} of {cluster.name}"

        def end() -> None:
            mine = {vm["name"] for vm in self._vms(group)}
            self._finish([self.compute.virtual_machines.begin_delete(group, n) for n in names if n in mine], doing)
            # A NIC and a public IP go with their VM; these are what a launch that died before its VM left.
            self._finish([self.network.network_interfaces.begin_delete(group, nic_name(n)) for n in names], doing)
            self._finish([self.network.public_ip_addresses.begin_delete(group, public_ip_name(n)) for n in names],
                         doing)
            log.info("%s: ended %s", cluster.name, ", ".join(names))

        self._call(doing, end)

    def start_replacements(self, cluster: Cluster, lost: Sequence[Node], host_keys: dict[str, HostKey]) -> Cluster:
        group, doing = cluster.owner["resource_group"], f"replace nodes of {cluster.name} in {self.placement(cluster)}"

        def start() -> Cluster:
            names = [node.name for node in lost]
            template = next((vm for vm in self._vms(group) if vm["name"] not in names
                             and vm["properties"].get("provisioningState") == "Succeeded"), None)
            if template is None:
                raise ReplacementUnavailable(f"azure: no node of {cluster.name} survives in {group} to replace "
                                             f"{', '.join(names)} next to: relaunch the cluster")
            found = self._get(lambda: self.resources.resource_groups.get(group))
            stamp = Stamp.read(tags_of(found or template), STAMP_KEYS)
            self._start_nodes(group, template["location"], stamp, _shape_of(template),
                              [(node.rank, node.name) for node in lost], host_keys, doing)
            return self._cluster(cluster.name, group)

        return self._call(doing, start)

    # -- describe / terminate / list ----------------------------------------------------------------------------

    def describe(self, cluster_name: str) -> Cluster | None:
        if not self._has_subscription():
            return None  # without a subscription nothing of ours can exist: `down` and `status` ask every provider
        group = group_name(cluster_name)
        doing = f"describe {cluster_name}"

        def look() -> Cluster | None:
            found = self._get(lambda: self.resources.resource_groups.get(group))
            if found is None or tags_of(found).get(TAG_CLUSTER) != cluster_name or not self._vms(group):
                return None
            return self._cluster(cluster_name, group)

        return self._call(doing, look)

    def terminate(self, cluster_name: str) -> bool:
        if not self._has_subscription():
            return False
        return self._delete_group(group_name(cluster_name), f"tear down {cluster_name}", cluster_name)

    def _delete_group(self, group: str, doing: str, cluster_name: str | None = None) -> bool:
        """Delete the group and all it holds (ARM deletes its resources in their dependency order)."""

        def delete() -> bool:
            found = self._get(lambda: self.resources.resource_groups.get(group))
            if found is None or (cluster_name is not None and tags_of(found).get(TAG_CLUSTER) != cluster_name):
                return False
            self._finish([self.resources.resource_groups.begin_delete(group)], doing)
            log.info("deleted resource group %s", group)
            return True

        return self._call(doing, delete)

    def list_clusters(self) -> list[ClusterRecord]:
        if not self._has_subscription():
            return []
        doing = "list clusters"

        def listed() -> list[ClusterRecord]:
            groups = [json_of(g) for g in self.resources.resource_groups.list(filter=f"tagName eq '{TAG_CLUSTER}'")]
            records = []
            for group in groups:
                tags = tags_of(group)
                vms = self._vms(group["name"])
                records.append(ClusterRecord(
                    name=tags[TAG_CLUSTER], provider=self.name, run_id=Stamp.read(tags, STAMP_KEYS).run_id,
                    created_at=created_time(tags), nodes=len(vms), processes=len(vms),
                    owner_alive=lease_alive([tags.get(TAG_HEARTBEAT)], tags.get(TAG_LEASE_TTL), created_time(tags))))
            return sorted(records, key=lambda r: r.name)

        return self._call(doing, listed)

    # -- nodes --------------------------------------------------------------------------------------------------

    def _listed_for_notices(self, cluster: Cluster) -> dict[str, dict[str, Any]] | None:
        """The listing preemption_notices made less than LISTING_REUSE_S ago, used once."""
        listed = self._notice_listing.pop(cluster.name, None)
        if listed is None or time.monotonic() - listed[0] > LISTING_REUSE_S:
            return None
        return listed[1]

    def _nodes_now(self, cluster: Cluster) -> dict[str, dict[str, Any]]:
        """The watch's read: asked once (operations.WATCH_ATTEMPTS): azure-core would otherwise retry it, waiting out
        each throttle's Retry-After."""
        doing = f"describe {cluster.name}"
        return self._call(doing, lambda: {vm["name"]: vm for vm in self._vms(
            cluster.owner["resource_group"], retry_total=WATCH_ATTEMPTS - 1, connection_timeout=WATCH_TIMEOUT_S,
            read_timeout=WATCH_TIMEOUT_S)})

    def heartbeat(self, cluster: Cluster) -> None:
        """Stamp the cluster's group with the time now (PATCH replaces the tags whole: the others are kept)."""
        group, doing = cluster.owner["resource_group"], f"renew the heartbeat of {cluster.name}"

        def renew() -> None:
            found = self._get(lambda: self.resources.resource_groups.get(group))
            if found is not None:
                tags = {**tags_of(found), TAG_HEARTBEAT: f"{time.time():.0f}"}
                self.resources.resource_groups.update(group, {"tags": tags})

        self._call(doing, renew)

    def nodes_alive(self, cluster: Cluster) -> dict[str, bool]:
        found = self._listed_for_notices(cluster) or self._nodes_now(cluster)
        return {node.name: node.name in found and found[node.name]["properties"].get("provisioningState") not in ENDED
                for node in cluster.nodes}

    def preemption_notices(self, cluster: Cluster) -> list[PreemptionNotice]:
        """Spot VMs Azure is evicting. The control plane does not show Scheduled Events: the nodes' own watchers read
        them, and each writes the notice it acted on into its workdir (before it stops the trainer), read here over
        SSH from every VM still standing. Once Azure deletes the VM, a Spot VM seen Deleting is being reclaimed too
        (trainpipe deletes single VMs only while replacing them), its deadline counted from now."""
        vms = self._nodes_now(cluster)
        # The watch asks for liveness right after the notices: one ARM list a round, not two (ARM's read limits
        # are the subscription's, shared by every run in it).
        self._notice_listing[cluster.name] = (time.monotonic(), vms)
        standing = [node for node in cluster.nodes if node.address and node.name in vms
                    and vms[node.name]["properties"].get("provisioningState") not in ENDED]
        told = {notice.node: notice for notice in read_node_notices(standing, lambda node: self.runner(cluster, node))}
        deleting = {name: PreemptionNotice(node=name, deadline=time.time() + SPOT_NOTICE_S, reason="spot evicted")
                    for name, vm in vms.items() if vm["properties"].get("priority") == "Spot"
                    and vm["properties"].get("provisioningState") == "Deleting"}
        notices = {**deleting, **told}  # a node's own notice, where it wrote one, says what Azure told it
        return [notices[name] for name in sorted(notices)]


def _public_ip(address: dict[str, Any] | None) -> str:
    return str((address or {}).get("properties", {}).get("ipAddress", ""))


def _private_ip(nic: dict[str, Any] | None) -> str:
    configs = (nic or {}).get("properties", {}).get("ipConfigurations", [])
    return str(configs[0].get("properties", {}).get("privateIPAddress", "")) if configs else ""


def _shape_of(vm: dict[str, Any]) -> Shape:
    """The shape of a running VM, which its replacements copy (ARM does not return customData: each replacement
    boots with a host key of its own)."""
    properties = vm["properties"]
    os_profile = properties.get("osProfile", {})
    keys = os_profile.get("linuxConfiguration", {}).get("ssh", {}).get("publicKeys", [])
    identity = vm.get("identity") or {"type": "SystemAssigned"}
    identity = {k: v for k, v in identity.items() if k in ("type", "userAssignedIdentities")}
    if "userAssignedIdentities" in identity:
        identity["userAssignedIdentities"] = {key: {} for key in identity["userAssignedIdentities"]}
    image = {k: v for k, v in properties["storageProfile"]["imageReference"].items()
             if k in ("publisher", "offer", "sku", "version")}
    return Shape(properties["hardwareProfile"]["vmSize"], properties.get("priority") == "Spot",
                 float(properties.get("billingProfile", {}).get("maxPrice", -1)), identity, image,
                 os_profile.get("adminUsername", ""), keys[0]["keyData"] if keys else "")
