"""Nebius AI Cloud: a cluster is one GPU cluster (the InfiniBand fabric: every node is launched into it) and N
instances of one platform and preset in the region's project, found again by their labels.

The GPU cluster and every instance carry the cluster's labels, so describe, terminate and the orphan sweeper find it
from any process (in every project TRAINPIPE_NEBIUS_PROJECTS names). Names are unique in a project and derived from
the cluster and rank, so a retried launch adopts what it already made; every call carries an idempotency key that its
repeats reuse. The heartbeat is a label of the GPU cluster (one update per renewal, whatever the node count).

Preemptible nodes are stopped when Nebius preempts them (the only policy it offers); trainpipe itself never stops a
node (teardown deletes), so a preemptible instance seen STOPPING or STOPPED is preempted: that is the notice the
orchestrator reads, and the node reads the same stop as its guest shutdown begins (boot.notice_script).

A lost node is replaced alone (replace_nodes): its instance is deleted, and one of the same name and rank is created
with the spec of a surviving node (platform, preset, preemptible or not, the same GPU cluster, subnet, disks and
filesystem), labelled like the others, so describe, teardown and the sweeper see the new membership.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infra.cancel import CANCEL
from infra.compute.access.agent_env import agent_python
from infra.compute.access.hostkeys import HostKey
from infra.compute.catalog import Catalog
from infra.compute.optimizer import Candidate
from infra.compute.providers.base import Cluster, ClusterRecord, Node, PreemptionNotice, ReplacementUnavailable
from infra.compute.providers.cloud import HOST_KEYS, LEASE_TTL, SSH_KEY_ENV, CloudProvider, lease_alive, rolled_back
from infra.compute.providers.nebius import api
from infra.compute.providers.nebius.api import PAGE_SIZE, NebiusApi
from infra.compute.providers.nebius.boot import FILESYSTEM_TAG, NOTICE_S, WORKDIR, user_data
from infra.compute.providers.nebius.config import IMAGE_FAMILY_ENV, NebiusClusterSpec
from infra.compute.providers.nebius.errors import (
    CapacityError,
    InvalidRequestError,
    LaunchError,
    classify,
    is_sdk_error,
    status_code,
)
from infra.compute.providers.nebius.labels import (
    LABEL_CLUSTER,
    LABEL_HEARTBEAT,
    LABEL_LEASE_TTL,
    LABEL_OWNER,
    LABEL_RANK,
    LABEL_RUN,
    address,
    created_time,
    fingerprint_labels,
    fingerprint_of,
    label_value,
    labels_of,
    rank_of,
    resource_name,
    stamp_labels,
)
from infra.compute.providers.operations import WATCH_ATTEMPTS, WATCH_TIMEOUT_S, raise_first
from infra.compute.providers.owner import Stamp, launcher_stamp
from infra.compute.spec import ClusterSpec

log = logging.getLogger(__name__)

ALIVE = ("CREATING", "STARTING", "RUNNING", "UPDATING")
STOPPED = ("STOPPING", "STOPPED")  # trainpipe never stops a node: on a preemptible one, a preemption
PUBLIC_KEY_ENV = "TRAINPIPE_NEBIUS_SSH_PUBLIC_KEY_FILE"
# Catalog names are platform-preset (gpu-h100-sxm-8gpu-128vcpu-1600gb): the preset is the <n>gpu-<n>vcpu-<n>gb tail.
TYPE_NAME = re.compile(r"^(?P<platform>[a-z0-9-]+?)-(?P<preset>\d+gpu-\d+vcpu-\d+gb)$")
IN_USE_RETRIES = 6  # a GPU cluster can refuse deletion for a short while after its instances are gone
IN_USE_FIRST_S = 1.0


def split_type(instance_type: str) -> tuple[str, str]:
    """(platform, preset) of a catalog name."""
    found = TYPE_NAME.match(instance_type)
    if found is None:
        raise InvalidRequestError(f"nebius: instance type {instance_type!r} is not platform-preset (e.g. "
                                  "gpu-h100-sxm-8gpu-128vcpu-1600gb): fix the catalog or cluster.instance_type")
    return found["platform"], found["preset"]


def _compute() -> Any:
    from nebius.api.nebius.compute import v1

    return v1


def _common() -> Any:
    from nebius.api.nebius.common import v1

    return v1


def _state(instance: Any) -> str:
    return str(instance.status.state.name) if instance.HasField("status") else "UNSPECIFIED"


def _preemptible(instance: Any) -> bool:
    return bool(instance.spec.HasField("preemptible"))


class NebiusProvider(NebiusApi, CloudProvider):
    name = "nebius"
    key_hint = (f"a private key whose public key is beside it (KEY.pub) or in {PUBLIC_KEY_ENV}: the boot script "
                "adds it to the login user")
    boot_log = "/var/log/cloud-init-output.log"

    def __init__(self, catalog: Catalog | None = None, projects: dict[str, str] | None = None,
                 endpoint: str | None = None, credentials: Any = None, bootstrap: bool = True) -> None:
        # Nothing here touches the API: a provider is built for `plan` and `status` on machines without credentials.
        super().__init__(catalog, bootstrap=bootstrap)
        self._init_api(projects, endpoint, credentials)

    @property
    def notice_source(self) -> str:  # type: ignore[override]
        """Nebius publishes no preemption notice to the instance: the stop unit of the boot script writes the notice
        file as the guest shuts down, and the node's watcher reads that file."""
        return "file"

    # -- launch -------------------------------------------------------------------------------------------------

    def launch_candidate(self, cluster_name: str, spec: ClusterSpec, run_id: str, candidate: Candidate,
                         host_key: HostKey) -> Cluster:
        """Every node on this candidate or none: on any failure what this call made is deleted again."""
        platform, preset = split_type(candidate.instance_type)
        region = candidate.region
        section = spec.nebius
        fabric = section.fabric(region, platform)
        if not self.projects():
            raise InvalidRequestError(f"nebius: no projects: set {api.PROJECTS_ENV} to region=project-id,... (the "
                                      "project of each region clusters may be launched in)")
        # A region this machine has no project in, or no fabric for the platform: the next candidate may launch.
        if region not in self.projects():
            raise LaunchError(f"nebius: {api.PROJECTS_ENV} names no project in {region}: skipped (add "
                              f"{region}=project-id to launch there)")
        if fabric is None:
            raise LaunchError(f"nebius: no InfiniBand fabric known for {platform} in {region}: skipped (name one "
                              f"in cluster.nebius.fabrics: {{{region}: fabric-N}})")
        project = self.project(region)
        doing = f"launch {cluster_name} on {candidate.label()}"
        stamp = Stamp(cluster_name, run_id, launcher_stamp(), f"{time.time():.0f}", f"{spec.lease_ttl_s:g}")
        operations: list[Any] = []
        try:
            def start() -> list[Any]:
                gpu_cluster = self._gpu_cluster(project, cluster_name, fabric, stamp, doing)
                subnet = section.subnets.get(region) or self._default_subnet(project, region, doing)
                names = [resource_name(cluster_name, f"node-{rank}") for rank in range(spec.nodes)]
                for rank, name in enumerate(names):
                    instance_spec = self._instance_spec(platform, preset, candidate.spot, gpu_cluster, subnet,
                                                        section, name, host_key)
                    operation = self._node(project, name, rank, stamp, host_key, instance_spec, doing)
                    if operation is not None:
                        operations.append(operation)
                failures = self._finish_all(operations, doing)
                operations.clear()  # all finished: a rollback need not wait for them again
                raise_first(failures, doing)
                return self._wait_running(project, cluster_name, names, doing)

            instances = self._call(doing, start)
        except LaunchError as exc:
            failure = exc
        else:
            return self._cluster(cluster_name, region, project, instances)

        def undo() -> None:
            # Creates still in flight would make instances after the teardown looked: let them end first.
            for error in self._finish_all(operations, f"roll back {cluster_name}"):
                log.info("rolling back %s: a node create also failed: %s", cluster_name, error)
            self._call(f"roll back {cluster_name}", lambda: self._teardown(cluster_name, project))

        raise rolled_back(cluster_name, region, failure, undo)

    def _finish_all(self, operations: list[Any], doing: str) -> list[LaunchError]:
        failures = []
        for operation in operations:
            try:
                self._call(doing, lambda op=operation: self._finish(op, doing))
            except LaunchError as exc:
                failures.append(exc)
        return failures

    def _gpu_cluster(self, project: str, cluster_name: str, fabric: str, stamp: Stamp, doing: str) -> str:
        """The cluster's GPU cluster (its InfiniBand fabric) in the project: made, or adopted from an earlier try."""
        compute, common = _compute(), _common()
        name = resource_name(cluster_name, "fabric")
        existing = self._get(doing, lambda **kw: self.client("gpu_clusters").get_by_name(
            common.GetByNameRequest(parent_id=project, name=name), **kw))
        if existing is not None:
            if labels_of(existing).get(LABEL_CLUSTER) != label_value(cluster_name):
                raise InvalidRequestError(f"nebius: GPU cluster {name} in {project} is not cluster {cluster_name}'s: "
                                          "delete it or rename the cluster")
            if existing.spec.infiniband_fabric == fabric:
                return str(existing.metadata.id)
            # Made by a try on another platform of the region: its fabric is the wrong one.
            self._delete_gpu_cluster(str(existing.metadata.id), doing)
        request = compute.CreateGpuClusterRequest(
            metadata=common.ResourceMetadata(parent_id=project, name=name,
                                             labels={**stamp_labels(stamp), LABEL_HEARTBEAT: f"{time.time():.0f}"}),
            spec=compute.GpuClusterSpec(infiniband_fabric=fabric))
        operation = self._api(doing, lambda **kw: self.client("gpu_clusters").create(request, **kw))
        return self._finish(operation, doing)

    def _default_subnet(self, project: str, region: str, doing: str) -> str:
        """The project's first subnet (Nebius makes a default network and subnet in every project)."""
        from nebius.api.nebius.vpc.v1 import ListSubnetsRequest

        request = ListSubnetsRequest(parent_id=project, page_size=PAGE_SIZE)
        for subnet in self._pages(doing, lambda r: lambda **kw: self.client("subnets").list(r, **kw), request):
            return str(subnet.metadata.id)
        raise InvalidRequestError(f"nebius: project {project} ({region}) has no subnet: create one, or name it in "
                                  f"cluster.nebius.subnets ({region}: vpcsubnet-...)")

    def _ssh_public_key(self) -> str:
        """The orchestrator's public key, which the boot script gives the login user."""
        _, key_file = self.ssh_access()
        path = Path(os.environ.get(PUBLIC_KEY_ENV) or f"{key_file}.pub").expanduser()
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise InvalidRequestError(f"nebius: cannot read the SSH public key {path} ({exc.strerror}): put the "
                                      f"public key of {SSH_KEY_ENV} beside it as .pub, or name it in "
                                      f"{PUBLIC_KEY_ENV}") from None

    def _user_data(self, host_key: HostKey, filesystem: bool) -> str:
        user, _ = self.ssh_access()
        return user_data(host_key, user, self._ssh_public_key(), filesystem)

    def _instance_spec(self, platform: str, preset: str, spot: bool, gpu_cluster: str, subnet: str,
                       section: NebiusClusterSpec, name: str, host_key: HostKey) -> Any:
        compute = _compute()
        disk_type = getattr(compute.DiskSpec.DiskType, section.boot_disk_type.upper())
        boot = compute.AttachedDiskSpec(
            attach_mode=compute.AttachedDiskSpec.AttachMode.READ_WRITE,
            managed_disk=compute.ManagedDisk(name=f"{name}-boot", spec=compute.DiskSpec(
                size_gibibytes=section.boot_disk_gb, type=disk_type,
                source_image_family=compute.SourceImageFamily(
                    image_family=section.boot_image_family(os.environ.get(IMAGE_FAMILY_ENV))))))
        spec = compute.InstanceSpec(
            resources=compute.ResourcesSpec(platform=platform, preset=preset),
            gpu_cluster=compute.InstanceGpuClusterSpec(id=gpu_cluster),
            network_interfaces=[compute.NetworkInterfaceSpec(
                subnet_id=subnet, name="eth0", ip_address=compute.IPAddress(),
                public_ip_address=compute.PublicIPAddress())],
            boot_disk=boot, cloud_init_user_data=self._user_data(host_key, section.filesystem_id is not None))
        described = self.catalog.get(self.name, f"{platform}-{preset}")
        if described is not None and described.local_nvme_count:
            spec.local_disks = compute.LocalDisksSpec(passthrough_group=compute.PassthroughGroupRequest(
                requested=True))
        if section.filesystem_id is not None:
            spec.filesystems = [compute.AttachedFilesystemSpec(
                attach_mode=compute.AttachedFilesystemSpec.AttachMode.READ_WRITE, mount_tag=FILESYSTEM_TAG,
                existing_filesystem=compute.ExistingFilesystem(id=section.filesystem_id))]
        if section.service_account_id is not None:
            spec.service_account_id = section.service_account_id
        if spot:
            spec.preemptible = compute.PreemptibleSpec(
                on_preemption=compute.PreemptibleSpec.PreemptionPolicy.STOP, priority=section.preemptible_priority)
        return spec

    def _node(self, project: str, name: str, rank: int, stamp: Stamp, host_key: HostKey, spec: Any,
              doing: str) -> Any | None:
        """Start one node; None when a live node of this very launch already runs (adopted as it is, with the host
        key its labels name)."""
        compute, common = _compute(), _common()
        existing = self._get(doing, lambda **kw: self.client("instances").get_by_name(
            common.GetByNameRequest(parent_id=project, name=name), **kw))
        if existing is not None:
            if labels_of(existing).get(LABEL_CLUSTER) != label_value(stamp.cluster):
                raise InvalidRequestError(f"nebius: {project} already has an instance {name} outside cluster "
                                          f"{stamp.cluster}: delete it or rename the cluster")
            same = (existing.spec.resources.platform == spec.resources.platform
                    and existing.spec.resources.preset == spec.resources.preset
                    and _preemptible(existing) == bool(spec.HasField("preemptible")))
            if same and _state(existing) in ALIVE:
                log.info("%s rank %d: adopting %s from an earlier try of this launch", stamp.cluster, rank, name)
                return None
            log.info("%s rank %d: replacing %s (%s, %s)", stamp.cluster, rank, name, _state(existing),
                     existing.spec.resources.platform)
            self._delete_instance(str(existing.metadata.id), doing)
        labels = {**stamp_labels(stamp), LABEL_RANK: str(rank), **fingerprint_labels(host_key.fingerprint)}
        request = compute.CreateInstanceRequest(
            metadata=common.ResourceMetadata(parent_id=project, name=name, labels=labels), spec=spec)
        return self._api(doing, lambda **kw: self.client("instances").create(request, **kw))

    def _wait_running(self, project: str, cluster_name: str, names: list[str], doing: str) -> list[Any]:
        """Poll until every node is RUNNING; one that stopped or vanished (preempted while starting) fails the
        candidate."""
        deadline = time.monotonic() + api.WAIT_S
        delay = api.POLL_FIRST_S  # read from api at each call: one place to tune (tests shorten it)
        while True:
            found = {str(i.metadata.name): i for i in self._instances(project, cluster_name, doing)}
            gone = sorted(n for n in names if n not in found or _state(found[n]) not in ALIVE)
            if gone:
                raise CapacityError(f"nebius: {', '.join(gone)} ended while starting (preempted?): trying elsewhere")
            if all(_state(found[n]) == "RUNNING" for n in names):
                return [found[n] for n in names]
            if time.monotonic() > deadline:
                raise CapacityError(f"nebius: {', '.join(names)} not RUNNING after {api.WAIT_S:.0f}s: trying "
                                    "elsewhere")
            CANCEL.wait(delay)
            delay = min(delay * 2, api.POLL_MAX_S)

    def _cluster(self, cluster_name: str, region: str, project: str, instances: list[Any]) -> Cluster:
        instances = sorted(instances, key=rank_of)
        labels = labels_of(instances[0])
        nodes = []
        for instance in instances:
            interface = instance.status.network_interfaces[0] if instance.status.network_interfaces else None
            private = address(interface.ip_address.address) if interface is not None else ""
            public = address(interface.public_ip_address.address) if interface is not None else ""
            nodes.append(Node(name=str(instance.metadata.name), rank=rank_of(instance), address=public or private,
                              cluster_address=private, workdir=WORKDIR, data_dir=f"{WORKDIR}/data",
                              ckpt_dir=f"{WORKDIR}/ckpt", python=agent_python(WORKDIR),
                              node_python="python3"))
        first = instances[0].spec
        instance_type = f"{first.resources.platform}-{first.resources.preset}"
        gpu_cluster = str(first.gpu_cluster.id)
        # owner also says where the nodes are, so later calls (preemption, liveness, heartbeat) go straight there.
        owner = {"owner": labels.get(LABEL_OWNER, ""), "project": project, "region": region,
                 "gpu_cluster": gpu_cluster, "instances": {str(i.metadata.name): str(i.metadata.id) for i in instances},
                 "instance_type": instance_type, LEASE_TTL: labels.get(LABEL_LEASE_TTL),
                 HOST_KEYS: {str(i.metadata.name): fp for i in instances
                             if (fp := fingerprint_of(labels_of(i))) is not None}}
        return Cluster(name=cluster_name, provider=self.name, run_id=labels.get(LABEL_RUN, "unknown"),
                       nodes=tuple(nodes), created_at=created_time(labels), owner=owner, instance_type=instance_type,
                       market="spot" if _preemptible(instances[0]) else "on-demand")

    # -- replacing lost nodes -------------------------------------------------------------------------------------

    def placement(self, cluster: Cluster) -> str:
        return (f"GPU cluster {resource_name(cluster.name, 'fabric')} ({cluster.owner.get('gpu_cluster', '?')}) in "
                f"{cluster.owner['region']}")

    def end_nodes(self, cluster: Cluster, names: Sequence[str]) -> None:
        project, doing = cluster.owner["project"], f"end {', '.join(names)} of {cluster.name}"

        def end() -> None:
            mine = [i for i in self._instances(project, cluster.name, doing) if i.metadata.name in names]
            self._delete_instances(mine, doing)
            if mine:
                log.info("%s: deleted %d of %s", cluster.name, len(mine), ", ".join(names))

        self._call(doing, end)

    def start_replacements(self, cluster: Cluster, lost: Sequence[Node], host_keys: dict[str, HostKey]) -> Cluster:
        project, doing = cluster.owner["project"], f"replace nodes of {cluster.name} in {self.placement(cluster)}"
        compute, common = _compute(), _common()

        def start() -> Cluster:
            names = [node.name for node in lost]
            template = self._survivor(cluster, project, names, doing)
            labels = labels_of(template)
            operations = []
            try:
                for node in lost:
                    # The survivor's spec (platform, preset, preemptible, GPU cluster, subnet, disks, filesystem):
                    # the replacement is its twin but for its name, its boot disk's and its host key.
                    spec = compute.InstanceSpec.FromString(template.spec.SerializeToString())
                    spec.boot_disk.managed_disk.name = f"{node.name}-boot"
                    spec.cloud_init_user_data = self._user_data(host_keys[node.name], bool(spec.filesystems))
                    node_labels = {**labels, LABEL_RANK: str(node.rank),
                                   **fingerprint_labels(host_keys[node.name].fingerprint)}
                    request = compute.CreateInstanceRequest(
                        metadata=common.ResourceMetadata(parent_id=project, name=node.name, labels=node_labels),
                        spec=spec)
                    operations.append(self._api(doing, lambda r=request, **kw: self.client("instances").create(
                        r, **kw)))
            finally:
                # A create still in flight would make its instance after the caller's cleanup looked.
                failures = self._finish_all(operations, doing)
            if failures:
                raise failures[0]
            self._wait_running(project, cluster.name, names, doing)
            return self._cluster(cluster.name, cluster.owner["region"], project,
                                 self._instances(project, cluster.name, doing))

        return self._call(doing, start)

    def _survivor(self, cluster: Cluster, project: str, lost: list[str], doing: str) -> Any:
        for instance in self._instances(project, cluster.name, doing):
            if instance.metadata.name not in lost and _state(instance) in ALIVE:
                return instance
        raise ReplacementUnavailable(f"nebius: no node of {cluster.name} survives in {self.placement(cluster)} to "
                                     f"replace {', '.join(lost)} next to: relaunch the cluster")

    # -- finding what a cluster has -----------------------------------------------------------------------------

    def _instances(self, project: str, cluster_name: str | None, doing: str, attempts: int = api.API_ATTEMPTS,
                   timeout_s: float = api.CALL_TIMEOUT_S) -> list[Any]:
        """The project's trainpipe instances (of one cluster when named), by rank."""
        request = _compute().ListInstancesRequest(parent_id=project, page_size=PAGE_SIZE)
        found = self._pages(doing, lambda r: lambda **kw: self.client("instances").list(r, **kw), request, attempts,
                            timeout_s)
        wanted = None if cluster_name is None else label_value(cluster_name)
        return sorted((i for i in found if LABEL_CLUSTER in labels_of(i)
                       and wanted in (None, labels_of(i)[LABEL_CLUSTER])), key=rank_of)

    def _gpu_clusters(self, project: str, cluster_name: str | None, doing: str) -> list[Any]:
        request = _compute().ListGpuClustersRequest(parent_id=project, page_size=PAGE_SIZE)
        found = self._pages(doing, lambda r: lambda **kw: self.client("gpu_clusters").list(r, **kw), request)
        wanted = None if cluster_name is None else label_value(cluster_name)
        return [g for g in found if LABEL_CLUSTER in labels_of(g) and wanted in (None, labels_of(g)[LABEL_CLUSTER])]

    # -- describe / terminate / list ----------------------------------------------------------------------------

    def describe(self, cluster_name: str) -> Cluster | None:
        if not self._has_credentials():
            return None  # without credentials nothing of ours can exist: `down` and `status` ask every provider
        doing = f"describe {cluster_name}"
        for region, project in self.projects().items():
            found = self._call(doing, lambda p=project: self._instances(p, cluster_name, doing))
            if found:
                return self._cluster(cluster_name, region, project, found)
        return None

    def terminate(self, cluster_name: str) -> bool:
        if not self._has_credentials():
            return False
        doing = f"tear down {cluster_name}"
        ended = False
        for project in self.projects().values():
            ended = self._call(doing, lambda p=project: self._teardown(cluster_name, p)) or ended
        return ended

    def _teardown(self, cluster_name: str, project: str) -> bool:
        """Instances first; the GPU cluster once none is in it (else Nebius refuses, and it would be left)."""
        doing = f"tear down {cluster_name}"
        instances = self._instances(project, cluster_name, doing)
        self._delete_instances(instances, doing)
        if instances:
            log.info("deleted %d instances of %s", len(instances), cluster_name)
        gpu_clusters = self._gpu_clusters(project, cluster_name, doing)
        for gpu_cluster in gpu_clusters:
            self._delete_gpu_cluster(str(gpu_cluster.metadata.id), doing)
        return bool(instances or gpu_clusters)

    def _delete_instances(self, instances: list[Any], doing: str) -> None:
        operations = [op for op in (self._start_delete("instances", str(i.metadata.id), doing) for i in instances)
                      if op is not None]
        failures = self._finish_all(operations, doing)
        if failures:
            raise failures[0]

    def _delete_instance(self, instance_id: str, doing: str) -> None:
        operation = self._start_delete("instances", instance_id, doing)
        if operation is not None:
            self._finish(operation, doing)

    def _start_delete(self, kind: str, resource_id: str, doing: str) -> Any | None:
        compute = _compute()
        request = (compute.DeleteInstanceRequest(id=resource_id) if kind == "instances"
                   else compute.DeleteGpuClusterRequest(id=resource_id))
        return self._get(doing, lambda **kw: self.client(kind).delete(request, **kw))

    def _delete_gpu_cluster(self, gpu_cluster_id: str, doing: str) -> None:
        """Nebius may keep a GPU cluster "in use" briefly after its instances are gone: retried with backoff."""
        for attempt in range(IN_USE_RETRIES):
            try:
                operation = self._start_delete("gpu_clusters", gpu_cluster_id, doing)
                if operation is not None:
                    self._finish(operation, doing)
                return
            except LaunchError as exc:
                refused = exc
            except Exception as exc:
                if not is_sdk_error(exc) or status_code(exc) != "FAILED_PRECONDITION":
                    raise
                refused = classify(exc, doing)
            if attempt == IN_USE_RETRIES - 1 or "FAILED_PRECONDITION" not in str(refused):
                raise refused
            delay = IN_USE_FIRST_S * 2**attempt
            log.warning("nebius: GPU cluster %s still in use: retry %d in %.0fs", gpu_cluster_id, attempt + 1, delay)
            CANCEL.wait(delay)

    def list_clusters(self) -> list[ClusterRecord]:
        if not self._has_credentials():
            return []
        doing = "list clusters"
        by_cluster: dict[str, list[Any]] = {}
        stamps: dict[str, dict[str, str]] = {}
        heartbeats: dict[str, list[str | None]] = {}
        for project in self.projects().values():
            for instance in self._call(doing, lambda p=project: self._instances(p, None, doing)):
                labels = labels_of(instance)
                by_cluster.setdefault(labels[LABEL_CLUSTER], []).append(instance)
                stamps.setdefault(labels[LABEL_CLUSTER], labels)
            # GPU clusters without instances are what a crashed launch or teardown left: listed too, so the sweeper
            # removes them; they carry the heartbeat.
            for gpu_cluster in self._call(doing, lambda p=project: self._gpu_clusters(p, None, doing)):
                labels = labels_of(gpu_cluster)
                by_cluster.setdefault(labels[LABEL_CLUSTER], [])
                stamps[labels[LABEL_CLUSTER]] = labels
                heartbeats.setdefault(labels[LABEL_CLUSTER], []).append(labels.get(LABEL_HEARTBEAT))
        return [ClusterRecord(
            name=name, provider=self.name, run_id=stamps[name].get(LABEL_RUN, "unknown"),
            created_at=created_time(stamps[name]), nodes=len(found), processes=len(found),
            owner_alive=lease_alive(heartbeats.get(name, []), stamps[name].get(LABEL_LEASE_TTL),
                                    created_time(stamps[name])),
        ) for name, found in sorted(by_cluster.items())]

    # -- nodes --------------------------------------------------------------------------------------------------

    def _nodes_now(self, cluster: Cluster) -> dict[str, Any]:
        """The watch's read: asked once (operations.WATCH_ATTEMPTS)."""
        doing = f"describe {cluster.name}"
        found = self._call(doing, lambda: self._instances(cluster.owner["project"], cluster.name, doing,
                                                          WATCH_ATTEMPTS, WATCH_TIMEOUT_S))
        return {str(i.metadata.name): i for i in found}

    def heartbeat(self, cluster: Cluster) -> None:
        """Relabel the cluster's GPU cluster with the time now (the labels replace the whole set)."""
        compute = _compute()
        doing = f"renew the heartbeat of {cluster.name}"

        def renew() -> None:
            for gpu_cluster in self._gpu_clusters(cluster.owner["project"], cluster.name, doing):
                metadata = gpu_cluster.metadata
                metadata.labels = {**labels_of(gpu_cluster), LABEL_HEARTBEAT: f"{time.time():.0f}"}
                request = compute.UpdateGpuClusterRequest(metadata=metadata, spec=gpu_cluster.spec)
                self._finish(self._api(doing, lambda r=request, **kw: self.client("gpu_clusters").update(r, **kw)),
                             doing)

        self._call(doing, renew)

    def nodes_alive(self, cluster: Cluster) -> dict[str, bool]:
        found = self._nodes_now(cluster)
        return {node.name: node.name in found and _state(found[node.name]) in ALIVE for node in cluster.nodes}

    def preemption_notices(self, cluster: Cluster) -> list[PreemptionNotice]:
        """Preemptible nodes Nebius is preempting: seen STOPPING or STOPPED (trainpipe never stops a node). The
        deadline is NOTICE_S after the stop was seen: what the node's stop unit gives its watcher."""
        notices = []
        for name, instance in sorted(self._nodes_now(cluster).items()):
            if _preemptible(instance) and _state(instance) in STOPPED:
                notices.append(PreemptionNotice(node=name, deadline=time.time() + NOTICE_S,
                                                reason=f"nebius preempted ({_state(instance)})"))
        return notices
