"""Google Compute Engine: a cluster is N instances in one zone under one compact placement policy, found again by
their labels.

Every instance carries the cluster's labels, so describe, terminate and the orphan sweeper find it from any process.
GCP label values only allow [a-z0-9_-] (63 characters), so labels hold sanitised values for filtering and the
instance metadata holds the exact ones (the owner string, the creation time). Resource policies have no labels: the
placement policy is named after the cluster and says whose it is in its description. Instance names are unique per
zone and derived from the cluster and rank, so a retried launch adopts the instances it already started; each insert
carries a requestId that its retries reuse, so a repeated API call never starts a second instance either.

A lost node is replaced alone (replace_nodes): its instance is deleted, and a new one of the same name, rank, machine
type, provisioning model and service account is inserted in the same zone under the same compact policy, labelled
like the cluster's others, so describe, teardown and the sweeper see the new membership.

Beside it: api (the Compute API calls, retried and polled), labels (labels, metadata and names), boot (image, disks
and the startup-script).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from google.api_core import exceptions
from google.auth.credentials import Credentials

from infra.cancel import CANCEL
from infra.compute.access.agent_env import agent_python
from infra.compute.access.hostkeys import HostKey
from infra.compute.catalog import Catalog
from infra.compute.optimizer import Candidate
from infra.compute.providers.base import Cluster, ClusterRecord, Node, PreemptionNotice, ReplacementUnavailable
from infra.compute.providers.cloud import HOST_KEYS, LEASE_TTL, MOUNT, CloudProvider, lease_alive, rolled_back
from infra.compute.providers.gcp import api
from infra.compute.providers.gcp.api import (
    API_ATTEMPTS,
    API_ERRORS,
    API_TIMEOUT_S,
    ComputeApi,
    compute_v1,
    region_of,
    short_name,
)
from infra.compute.providers.gcp.boot import (
    BOOT_DISK_GB,
    BOOT_DISK_TYPE,
    DLVM_FAMILY,
    DLVM_PROJECT,
    IMAGE_ENV,
    bundles_local_ssd,
    startup_script,
)
from infra.compute.providers.gcp.config import GcpServiceAccount
from infra.compute.providers.gcp.errors import (
    CapacityError,
    InvalidRequestError,
    LaunchError,
    classify,
    error_codes,
    operation_error,
)
from infra.compute.providers.gcp.labels import (
    LABEL_CLUSTER,
    LABEL_HEARTBEAT,
    LABEL_LEASE_TTL,
    LABEL_OWNER,
    LABEL_RANK,
    LABEL_RUN,
    META_BOOT_IMAGE,
    META_HOST_KEY,
    POLICY_MARK,
    STAMP_KEYS,
    address_of,
    cluster_address_of,
    created_time,
    label_value,
    policy_stamp,
    rank_of,
    resource_name,
    stamp_labels,
    stamp_of,
)
from infra.compute.providers.operations import WATCH_ATTEMPTS, WATCH_TIMEOUT_S, raise_first
from infra.compute.providers.owner import Stamp, launcher_stamp
from infra.compute.spec import ClusterSpec

log = logging.getLogger(__name__)

ALIVE = ("PROVISIONING", "STAGING", "RUNNING")
ENDED = ("STOPPING", "STOPPED", "SUSPENDING", "SUSPENDED", "TERMINATED")
# A Spot VM being preempted shows STOPPING for up to 30 s before it is deleted (instance_termination_action=DELETE).
PREEMPTING = ("STOPPING", "TERMINATED")
SPOT_NOTICE_S = 30.0
IN_USE = ("resourceInUseByAnotherResource", "RESOURCE_IN_USE_BY_ANOTHER_RESOURCE")
DELETE_RETRIES = 6  # a policy can stay "in use" for a short while after its instances are gone
FREE_FIRST_S = 2.0


class GcpProvider(ComputeApi, CloudProvider):
    name = "gcp"
    key_hint = "a private key whose public key is in TRAINPIPE_GCP_SSH_KEYS (or the project's ssh-keys metadata)"
    boot_log = "`journalctl -u google-startup-scripts`"

    def __init__(self, catalog: Catalog | None = None, zones: tuple[str, ...] | None = None,
                 project: str | None = None, credentials: Credentials | None = None, api_endpoint: str | None = None,
                 image: str | None = None, network: str | None = None, subnetwork: str | None = None,
                 service_account: str | None = None, ssh_keys: str | None = None, bootstrap: bool = True) -> None:
        # The project and the credentials are resolved on first use, never here.
        super().__init__(catalog, bootstrap=bootstrap)
        env_zones = tuple(z for z in os.environ.get("TRAINPIPE_GCP_ZONES", "").split(",") if z)
        self._zones = zones or env_zones or None
        self._project = project or os.environ.get("TRAINPIPE_GCP_PROJECT") or None
        self._credentials = credentials
        # A Private Service Connect endpoint, say; the nodes call the same one to delete themselves.
        self._api_endpoint = api_endpoint or os.environ.get("TRAINPIPE_GCP_ENDPOINT") or None
        self._image = image or os.environ.get(IMAGE_ENV) or None  # cluster.gcp.image wins over it (_boot_image)
        self._network = network or os.environ.get("TRAINPIPE_GCP_NETWORK") or "default"
        self._subnetwork = subnetwork or os.environ.get("TRAINPIPE_GCP_SUBNETWORK")
        self._service_account = service_account or os.environ.get("TRAINPIPE_GCP_SERVICE_ACCOUNT") or "default"
        self._ssh_keys = ssh_keys or os.environ.get("TRAINPIPE_GCP_SSH_KEYS")
        self._clients: dict[type, Any] = {}

    # -- plumbing -----------------------------------------------------------------------------------------------

    # -- launch -------------------------------------------------------------------------------------------------

    def launch_candidate(self, cluster_name: str, spec: ClusterSpec, run_id: str, candidate: Candidate,
                         host_key: HostKey) -> Cluster:
        """Every node on this candidate or none: on any failure what this call started is rolled back."""
        zone = self._zone(candidate)
        doing = f"launch {cluster_name} on {candidate.label()}"
        stamp = Stamp(cluster_name, run_id, launcher_stamp(), datetime.now(UTC).isoformat(timespec="seconds"),
                       f"{spec.lease_ttl_s:g}")
        started: list[compute_v1.Operation] = []
        try:
            image = self._boot_image(spec.gcp.image, doing)
            policy = self._placement_policy(cluster_name, region_of(zone), stamp, doing)
            names = [resource_name(cluster_name, f"node-{rank}") for rank in range(spec.nodes)]
            for rank, name in enumerate(names):
                operation = self._node(name, rank, candidate.instance_type, candidate.spot, zone, policy, stamp,
                                       host_key, spec.gcp.service_account, image, doing)
                if operation is not None:
                    started.append(operation)
            failures = self._finish(started, doing)
            started.clear()  # all finished: a rollback need not wait for them again
            raise_first(failures, doing)
            instances = self._wait_running(zone, cluster_name, names, doing)
        except API_ERRORS as exc:
            failure: LaunchError = classify(exc, doing)
        except LaunchError as exc:
            failure = exc
        else:
            return self._cluster(cluster_name, zone, instances)

        def undo() -> None:
            # Inserts still in flight would create instances after the teardown looked: let them finish first.
            for error in self._finish(started, f"roll back {cluster_name}"):
                log.info("rolling back %s: a node insert also failed: %s", cluster_name, error)
            self._teardown(cluster_name, zone)

        raise rolled_back(cluster_name, zone, failure, lambda: self._call(f"roll back {cluster_name}", undo))

    def _zone(self, candidate: Candidate) -> str:
        """GCE instances live in a zone: the candidate's, else the first TRAINPIPE_GCP_ZONES zone of its region."""
        if candidate.zone:
            return candidate.zone
        configured = [z for z in self._zones or () if region_of(z) == candidate.region]
        if not configured:
            raise InvalidRequestError(f"gcp: the catalog names no zone for {candidate.instance_type} in "
                                      f"{candidate.region}: add its zones to the catalog or set TRAINPIPE_GCP_ZONES")
        return configured[0]

    def _boot_image(self, configured: str | None, doing: str) -> str:
        """cluster.gcp.image, else TRAINPIPE_GCP_IMAGE, else the newest image of the Deep Learning VM family: one
        image for every node, so a family that moves on mid-launch (or before a replacement) splits no cluster."""
        if configured or self._image:
            return str(configured or self._image)
        try:
            found = self._api(doing, lambda: self.images.get_from_family(
                project=DLVM_PROJECT, family=DLVM_FAMILY, retry=None, timeout=API_TIMEOUT_S))
        except API_ERRORS as exc:
            reason = error_codes(exc)[0] if error_codes(exc) else type(exc).__name__
            raise InvalidRequestError(f"gcp: cannot look up the newest image of family {DLVM_FAMILY} in project "
                                      f"{DLVM_PROJECT} ({reason}): set cluster.gcp.image (or {IMAGE_ENV}) to an "
                                      "image (projects/P/global/images/NAME)") from None
        return str(found.self_link)

    def _placement_policy(self, cluster_name: str, region: str, stamp: Stamp, doing: str) -> str:
        """COLLOCATED: every node in one low-latency block of the zone (GCE's compact placement)."""
        name = resource_name(cluster_name, "compact")
        existing = self._get(doing, lambda: self.policies.get(
            project=self.project, region=region, resource_policy=name, retry=None, timeout=API_TIMEOUT_S))
        if existing is not None:
            owner = policy_stamp(existing)
            if owner is None or owner[LABEL_CLUSTER] != cluster_name:
                raise InvalidRequestError(f"gcp: resource policy {name} in {region} is not cluster {cluster_name}'s: "
                                          "delete it or rename the cluster")
            return str(existing.self_link)
        policy = compute_v1.ResourcePolicy(
            name=name, description=POLICY_MARK + json.dumps(stamp.keyed(STAMP_KEYS)),
            group_placement_policy=compute_v1.ResourcePolicyGroupPlacementPolicy(collocation="COLLOCATED"))
        request = compute_v1.InsertResourcePolicyRequest(project=self.project, region=region,
                                                         request_id=str(uuid.uuid4()),
                                                         resource_policy_resource=policy)
        self._done(self._api(doing, lambda: self.policies.insert_unary(request=request, retry=None,
                                                                       timeout=API_TIMEOUT_S)), doing)
        return f"projects/{self.project}/regions/{region}/resourcePolicies/{name}"

    def _node(self, name: str, rank: int, machine_type: str, spot: bool, zone: str, policy: str, stamp: Stamp,
              host_key: HostKey, account: GcpServiceAccount, image: str, doing: str) -> compute_v1.Operation | None:
        """Start one node; None when a live node of this very launch already runs (adopted as it is, with the host
        key, and the metadata naming it, of the try that started it)."""
        existing = self._get(doing, lambda: self.instances.get(
            project=self.project, zone=zone, instance=name, retry=None, timeout=API_TIMEOUT_S))
        if existing is not None:
            if stamp_of(existing).get(LABEL_CLUSTER) != stamp.cluster:
                raise InvalidRequestError(f"gcp: {zone} already has an instance {name} outside cluster "
                                          f"{stamp.cluster}: delete it or rename the cluster")
            same = (short_name(existing.machine_type) == machine_type
                    and (existing.scheduling.provisioning_model == "SPOT") == spot)
            if same and existing.status in ALIVE:
                log.info("%s rank %d: adopting %s from an earlier try of this launch", stamp.cluster, rank, name)
                return None
            # An ended node (a stopped or preempted VM) or one of another shape holds the name: replace it.
            log.info("%s rank %d: replacing %s (%s, %s)", stamp.cluster, rank, name, existing.status,
                     short_name(existing.machine_type))
            deleting = self._delete_instance(zone, name, doing)
            if deleting is not None:
                self._done(deleting, doing)
        request = compute_v1.InsertInstanceRequest(
            project=self.project, zone=zone, request_id=str(uuid.uuid4()),
            instance_resource=self._instance(name, rank, machine_type, spot, zone, policy, stamp, host_key, account,
                                             image))
        return self._api(doing, lambda: self.instances.insert_unary(request=request, retry=None,
                                                                    timeout=API_TIMEOUT_S))

    def _instance(self, name: str, rank: int, machine_type: str, spot: bool, zone: str, policy: str, stamp: Stamp,
                  host_key: HostKey, account: GcpServiceAccount, image: str) -> compute_v1.Instance:
        metadata = {"startup-script": startup_script(host_key, self._api_endpoint), "install-nvidia-driver": "True",
                    **stamp.keyed(STAMP_KEYS), LABEL_RANK: str(rank), META_HOST_KEY: host_key.fingerprint,
                    META_BOOT_IMAGE: image}
        if self._ssh_keys:
            metadata["ssh-keys"] = self._ssh_keys
        # GPU VMs cannot live-migrate; a host event ends the node visibly (nodes_alive) instead of rebooting it
        # without its processes and its local SSD data.
        scheduling = compute_v1.Scheduling(on_host_maintenance="TERMINATE", automatic_restart=False,
                                           provisioning_model="SPOT" if spot else "STANDARD")
        if spot:
            scheduling.instance_termination_action = "DELETE"
        interface = compute_v1.NetworkInterface(
            access_configs=[compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")], nic_type="GVNIC")
        if self._subnetwork:
            interface.subnetwork = f"regions/{region_of(zone)}/subnetworks/{self._subnetwork}"
        else:
            interface.network = f"global/networks/{self._network}"
        return compute_v1.Instance(
            name=name, machine_type=f"zones/{zone}/machineTypes/{machine_type}",
            labels={**stamp_labels(stamp), LABEL_RANK: str(rank), LABEL_HEARTBEAT: f"{time.time():.0f}"},
            metadata=compute_v1.Metadata(items=[compute_v1.Items(key=k, value=v) for k, v in metadata.items()]),
            scheduling=scheduling, disks=self._disks(machine_type, zone, stamp, image), network_interfaces=[interface],
            resource_policies=[policy], tags=compute_v1.Tags(items=["trainpipe", resource_name(stamp.cluster, "node")]),
            # The nodes' own credentials for the dataset and checkpoints (cluster.gcp.service_account).
            service_accounts=[compute_v1.ServiceAccount(email=account.email or self._service_account,
                                                        scopes=list(account.scopes))])

    def _disks(self, machine_type: str, zone: str, stamp: Stamp, image: str) -> list[compute_v1.AttachedDisk]:
        boot = compute_v1.AttachedDisk(boot=True, auto_delete=True,
                                       initialize_params=compute_v1.AttachedDiskInitializeParams(
                                           source_image=image, disk_size_gb=BOOT_DISK_GB,
                                           disk_type=f"zones/{zone}/diskTypes/{BOOT_DISK_TYPE}",
                                           labels=stamp_labels(stamp)))
        described = self.catalog.get(self.name, machine_type)
        count = described.local_nvme_count if described else 0
        if bundles_local_ssd(machine_type):
            count = 0  # attached by GCE itself
        local = [compute_v1.AttachedDisk(type_="SCRATCH", interface="NVME", auto_delete=True,
                                         initialize_params=compute_v1.AttachedDiskInitializeParams(
                                             disk_type=f"zones/{zone}/diskTypes/local-ssd"))
                 for _ in range(count)]
        return [boot, *local]

    def _wait_running(self, zone: str, cluster_name: str, names: list[str],
                      doing: str) -> list[compute_v1.Instance]:
        """Poll from 0.2 s up to 3 s apart until every node is RUNNING; one that ended or vanished (a Spot VM
        reclaimed while starting) fails the candidate."""
        deadline = time.monotonic() + api.WAIT_S
        delay = api.POLL_FIRST_S  # read from api at each call, as _wait does: one place to tune (tests shorten it)
        while True:
            found = {i.name: i for i in self._zone_instances(zone, cluster_name, doing)}
            gone = sorted(n for n in names if n not in found or found[n].status in ENDED)
            if gone:
                raise CapacityError(f"gcp: {', '.join(gone)} ended while starting (spot reclaimed?): "
                                    "trying elsewhere")
            if all(found[n].status == "RUNNING" for n in names):
                return [found[n] for n in names]
            if time.monotonic() > deadline:
                raise CapacityError(f"gcp: {', '.join(names)} not RUNNING after {api.WAIT_S:.0f}s: trying elsewhere")
            CANCEL.wait(delay)
            delay = min(delay * 2, api.POLL_MAX_S)

    def _cluster(self, cluster_name: str, zone: str, instances: list[compute_v1.Instance]) -> Cluster:
        instances = sorted(instances, key=rank_of)
        stamp = stamp_of(instances[0])
        nodes = tuple(Node(
            name=i.name, rank=rank_of(i), address=address_of(i), cluster_address=cluster_address_of(i),
            workdir=f"{MOUNT}/trainpipe",
            data_dir=f"{MOUNT}/trainpipe/data", ckpt_dir=f"{MOUNT}/trainpipe/ckpt",
            python=agent_python(f"{MOUNT}/trainpipe"), node_python="python3",
        ) for i in instances)
        machine_type = short_name(instances[0].machine_type)
        spot = instances[0].scheduling.provisioning_model == "SPOT"
        # owner also says where the nodes are, so later calls (preemption, liveness) go straight to the zone.
        owner = {"owner": stamp.get(LABEL_OWNER, ""), "project": self.project, "zone": zone, "region": region_of(zone),
                 "instances": {i.name: str(i.id) for i in instances}, "instance_type": machine_type,
                 LEASE_TTL: stamp.get(LABEL_LEASE_TTL),
                 HOST_KEYS: {i.name: stamp_of(i)[META_HOST_KEY] for i in instances if META_HOST_KEY in stamp_of(i)}}
        return Cluster(name=cluster_name, provider=self.name, run_id=stamp.get(LABEL_RUN, "unknown"), nodes=nodes,
                       created_at=created_time(stamp), owner=owner, instance_type=machine_type,
                       market="spot" if spot else "on-demand")

    # -- replacing lost nodes -------------------------------------------------------------------------------------

    def placement(self, cluster: Cluster) -> str:
        return f"compact policy {resource_name(cluster.name, 'compact')} in {cluster.owner['zone']}"

    def end_nodes(self, cluster: Cluster, names: Sequence[str]) -> None:
        zone, doing = cluster.owner["zone"], f"end {', '.join(names)} of {cluster.name}"

        def end() -> None:
            mine = {i.name for i in self._zone_instances(zone, cluster.name, doing)}
            deleting = [op for op in (self._delete_instance(zone, name, doing) for name in names if name in mine)
                        if op is not None]
            for operation in deleting:
                self._done(operation, doing)
            if deleting:
                log.info("%s: deleted %d of %s", cluster.name, len(deleting), ", ".join(names))

        self._call(doing, end)

    def start_replacements(self, cluster: Cluster, lost: Sequence[Node], host_keys: dict[str, HostKey]) -> Cluster:
        zone, doing = cluster.owner["zone"], f"replace nodes of {cluster.name} in {self.placement(cluster)}"

        def start() -> Cluster:
            names = [node.name for node in lost]
            template = self._survivor(cluster, zone, names, doing)
            found = stamp_of(template)
            stamp = replace(Stamp.read(found, STAMP_KEYS, run_id=cluster.run_id), cluster=cluster.name)
            # The survivors' service account and scopes: the replacement reaches the buckets as they do.
            account = GcpServiceAccount()
            if template.service_accounts:
                account = GcpServiceAccount(email=template.service_accounts[0].email,
                                            scopes=tuple(template.service_accounts[0].scopes) or account.scopes)
            # The image the survivors booted (a cluster launched before it was recorded: looked up as at launch).
            image = found.get(META_BOOT_IMAGE) or self._boot_image(None, doing)
            started: list[compute_v1.Operation] = []
            try:
                for node in lost:
                    operation = self._node(
                        node.name, node.rank, short_name(template.machine_type),
                        template.scheduling.provisioning_model == "SPOT", zone, template.resource_policies[0],
                        stamp, host_keys[node.name], account, image, doing)
                    if operation is not None:
                        started.append(operation)
            finally:
                # An insert still in flight would create its instance after the caller's cleanup looked.
                failures = self._finish(started, doing)
            if failures:
                raise failures[0]
            self._wait_running(zone, cluster.name, names, doing)
            return self._cluster(cluster.name, zone, self._zone_instances(zone, cluster.name, doing))

        return self._call(doing, start)

    def _survivor(self, cluster: Cluster, zone: str, lost: list[str], doing: str) -> compute_v1.Instance:
        """A live instance of the cluster that is not being replaced: the shape its replacements copy."""
        for instance in self._zone_instances(zone, cluster.name, doing):
            if instance.name not in lost and instance.status in ALIVE and instance.resource_policies:
                return instance
        raise ReplacementUnavailable(f"gcp: no node of {cluster.name} survives in {zone} to replace "
                                     f"{', '.join(lost)} next to: relaunch the cluster")

    # -- finding what a cluster has -----------------------------------------------------------------------------

    @staticmethod
    def _label_filter(cluster_name: str | None) -> str:
        return f'labels.{LABEL_CLUSTER} = "{label_value(cluster_name)}"' if cluster_name else \
            f"labels.{LABEL_CLUSTER}:*"

    def _zone_instances(self, zone: str, cluster_name: str, doing: str, attempts: int = API_ATTEMPTS,
                        timeout_s: float = API_TIMEOUT_S) -> list[compute_v1.Instance]:
        request = compute_v1.ListInstancesRequest(project=self.project, zone=zone,
                                                  filter=self._label_filter(cluster_name))
        found = self._api(doing, lambda: list(self.instances.list(request=request, retry=None, timeout=timeout_s)),
                          attempts)
        # The label is sanitised, so two cluster names may share it; the metadata holds the exact name.
        return sorted((i for i in found if stamp_of(i).get(LABEL_CLUSTER) == cluster_name), key=rank_of)

    def _all_instances(self, cluster_name: str | None, doing: str) -> list[tuple[str, compute_v1.Instance]]:
        """(zone, instance) of every trainpipe instance (of one cluster when named), across zones in one call."""
        request = compute_v1.AggregatedListInstancesRequest(project=self.project,
                                                            filter=self._label_filter(cluster_name))
        scopes = self._api(doing, lambda: list(self.instances.aggregated_list(request=request, retry=None,
                                                                               timeout=API_TIMEOUT_S)))
        found = [(short_name(scope), i) for scope, listed in scopes for i in listed.instances]
        return sorted(((zone, i) for zone, i in found if self._in_scope(zone)
                       and (cluster_name is None or stamp_of(i).get(LABEL_CLUSTER) == cluster_name)),
                      key=lambda found_in: (found_in[0], rank_of(found_in[1])))

    def _all_policies(self, cluster_name: str | None, doing: str) -> list[tuple[str, compute_v1.ResourcePolicy]]:
        """(region, policy) of trainpipe's placement policies (of one cluster when named), across regions."""
        request = compute_v1.AggregatedListResourcePoliciesRequest(project=self.project)
        scopes = self._api(doing, lambda: list(self.policies.aggregated_list(request=request, retry=None,
                                                                              timeout=API_TIMEOUT_S)))
        found = []
        for scope, listed in scopes:
            for policy in listed.resource_policies:
                stamp = policy_stamp(policy)
                if stamp and self._in_scope(short_name(scope)) and cluster_name in (None, stamp[LABEL_CLUSTER]):
                    found.append((short_name(scope), policy))
        return found

    # -- describe / terminate / list ----------------------------------------------------------------------------

    def describe(self, cluster_name: str) -> Cluster | None:
        if not self._has_credentials():
            return None  # without credentials nothing of ours can exist: `down` and `status` ask every provider
        doing = f"describe {cluster_name}"
        found = self._call(doing, lambda: self._all_instances(cluster_name, doing))
        if not found:
            return None
        zone = found[0][0]
        return self._cluster(cluster_name, zone, [i for z, i in found if z == zone])

    def terminate(self, cluster_name: str) -> bool:
        if not self._has_credentials():
            return False
        return self._call(f"tear down {cluster_name}", lambda: self._teardown(cluster_name))

    def _teardown(self, cluster_name: str, zone: str | None = None) -> bool:
        """Instances first; the placement policy only once no instance uses it (else GCE refuses, and it would
        leak). With a zone (a rollback) only that zone and its region are looked at."""
        doing = f"tear down {cluster_name}"
        if zone is not None:
            instances = [(zone, i) for i in self._zone_instances(zone, cluster_name, doing)]
            policies = self._region_policy(cluster_name, region_of(zone), doing)
        else:
            instances = self._all_instances(cluster_name, doing)
            policies = self._all_policies(cluster_name, doing)
        deleting = [op for op in (self._delete_instance(z, i.name, doing) for z, i in instances) if op is not None]
        for operation in deleting:
            self._done(operation, doing)
        if instances:
            log.info("deleted %d instances of %s", len(instances), cluster_name)
        for region, policy in policies:
            self._delete_when_free(region, policy.name, doing)
        return bool(instances or policies)

    def _region_policy(self, cluster_name: str, region: str,
                       doing: str) -> list[tuple[str, compute_v1.ResourcePolicy]]:
        name = resource_name(cluster_name, "compact")
        policy = self._get(doing, lambda: self.policies.get(project=self.project, region=region,
                                                            resource_policy=name, retry=None, timeout=API_TIMEOUT_S))
        stamp = policy_stamp(policy) if policy is not None else None
        return [(region, policy)] if policy is not None and stamp and stamp[LABEL_CLUSTER] == cluster_name else []

    def _delete_instance(self, zone: str, name: str, doing: str) -> compute_v1.Operation | None:
        request = compute_v1.DeleteInstanceRequest(project=self.project, zone=zone, instance=name,
                                                   request_id=str(uuid.uuid4()))
        return self._get(doing, lambda: self.instances.delete_unary(request=request, retry=None,
                                                                    timeout=API_TIMEOUT_S))

    def _delete_when_free(self, region: str, name: str, doing: str) -> None:
        """GCE may keep a policy "in use" briefly after its instances are gone; that is transient: retry with
        backoff. The refusal comes as an HTTP 400 or as the error of the delete operation."""
        request = compute_v1.DeleteResourcePolicyRequest(project=self.project, region=region, resource_policy=name,
                                                         request_id=str(uuid.uuid4()))
        for attempt in range(DELETE_RETRIES):
            try:
                operation = self._get(doing, lambda: self.policies.delete_unary(request=request, retry=None,
                                                                                timeout=API_TIMEOUT_S))
                error = operation_error(self._wait(operation, doing)) if operation is not None else None
            except exceptions.BadRequest as exc:
                error = exc
            if error is None:
                return
            if not set(error_codes(error)) & set(IN_USE) or attempt == DELETE_RETRIES - 1:
                raise classify(error, doing)
            delay = FREE_FIRST_S * 2**attempt
            log.warning("resource policy %s in %s still in use: retry %d in %.0fs", name, region, attempt + 1, delay)
            time.sleep(delay)
            request.request_id = str(uuid.uuid4())  # a new attempt, not a repeat of the refused one

    def list_clusters(self) -> list[ClusterRecord]:
        if not self._has_credentials():
            return []
        doing = "list clusters"
        instances = self._call(doing, lambda: self._all_instances(None, doing))
        policies = self._call(doing, lambda: self._all_policies(None, doing))
        by_cluster: dict[str, list[compute_v1.Instance]] = {}
        stamps: dict[str, dict[str, str]] = {}
        for _, instance in instances:
            stamp = stamp_of(instance)
            by_cluster.setdefault(stamp[LABEL_CLUSTER], []).append(instance)
            stamps.setdefault(stamp[LABEL_CLUSTER], stamp)
        # Policies without instances are what a crashed teardown left: list them too, so the sweeper removes them.
        for _, policy in policies:
            owner = policy_stamp(policy)
            if owner is not None:
                by_cluster.setdefault(owner[LABEL_CLUSTER], [])
                stamps.setdefault(owner[LABEL_CLUSTER], owner)
        return [ClusterRecord(
            name=name, provider=self.name, run_id=stamps[name].get(LABEL_RUN, "unknown"),
            created_at=created_time(stamps[name]), nodes=len(found), processes=len(found),
            owner_alive=bool(found) and lease_alive([i.labels.get(LABEL_HEARTBEAT) for i in found],
                                                    stamps[name].get(LABEL_LEASE_TTL), created_time(stamps[name])),
        ) for name, found in sorted(by_cluster.items())]

    # -- nodes --------------------------------------------------------------------------------------------------

    def _nodes_now(self, cluster: Cluster) -> dict[str, compute_v1.Instance]:
        """The watch's read: asked once (operations.WATCH_ATTEMPTS)."""
        doing = f"describe {cluster.name}"
        found = self._call(doing, lambda: self._zone_instances(cluster.owner["zone"], cluster.name, doing,
                                                               WATCH_ATTEMPTS, WATCH_TIMEOUT_S))
        return {i.name: i for i in found}

    def heartbeat(self, cluster: Cluster) -> None:
        """Relabel every node with the time now (setLabels replaces the whole set, guarded by its fingerprint)."""
        doing = f"renew the heartbeat of {cluster.name}"
        zone = cluster.owner["zone"]
        for instance in self._call(doing, lambda: self._zone_instances(zone, cluster.name, doing)):
            labels = {**instance.labels, LABEL_HEARTBEAT: f"{time.time():.0f}"}
            request = compute_v1.SetLabelsInstanceRequest(
                project=self.project, zone=zone, instance=instance.name, request_id=str(uuid.uuid4()),
                instances_set_labels_request_resource=compute_v1.InstancesSetLabelsRequest(
                    label_fingerprint=instance.label_fingerprint, labels=labels))
            self._call(doing, lambda r=request: self._done(self._api(doing, lambda: self.instances.set_labels_unary(
                request=r, retry=None, timeout=API_TIMEOUT_S)), doing))

    def nodes_alive(self, cluster: Cluster) -> dict[str, bool]:
        found = self._nodes_now(cluster)
        return {node.name: node.name in found and found[node.name].status in ALIVE for node in cluster.nodes}

    def preemption_notices(self, cluster: Cluster) -> list[PreemptionNotice]:
        """Spot nodes GCE is preempting: trainpipe never stops a node (teardown deletes), so a Spot VM seen STOPPING
        or TERMINATED is being reclaimed. The deadline is 30 s (GCE's notice) after it began to stop."""
        notices = []
        for name, instance in sorted(self._nodes_now(cluster).items()):
            if instance.scheduling.provisioning_model != "SPOT" or instance.status not in PREEMPTING:
                continue
            try:
                stopped = datetime.fromisoformat(instance.last_stop_timestamp).timestamp()
            except ValueError:
                stopped = time.time()  # not stamped yet: the 30 s count from now at the latest
            notices.append(PreemptionNotice(node=name, deadline=stopped + SPOT_NOTICE_S,
                                            reason=f"spot preempted ({instance.status})"))
        return notices
