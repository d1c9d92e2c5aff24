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
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import google.auth
import requests
from google.api_core import exceptions
from google.auth import exceptions as auth_exceptions
from google.auth.credentials import Credentials

from infra.cancel import CANCEL
from infra.compute.access.bootstrap import WheelSource
from infra.compute.access.hostkeys import HostKey
from infra.compute.catalog import Catalog
from infra.compute.optimizer import Candidate
from infra.compute.providers.base import Cluster, ClusterRecord, Node, PreemptionNotice, ReplacementUnavailable
from infra.compute.providers.cloud import HOST_KEYS, LEASE_TTL, MOUNT, CloudProvider, boot_script, lease_alive
from infra.compute.providers.gcp.config import GcpServiceAccount
from infra.compute.providers.gcp.errors import (
    CapacityError,
    InvalidRequestError,
    LaunchError,
    classify,
    error_codes,
    is_transient,
    operation_error,
)
from infra.compute.providers.owner import launcher_stamp
from infra.compute.spec import ClusterSpec
from infra.node import gce_self_delete


class _LazyModule:
    """A module imported on first attribute access: google.cloud.compute_v1 takes ~1.5 s to import, and every
    `trainpipe status` and sweep builds this provider, mostly on machines that never call GCP.

    Not importlib's LazyLoader: on Python 3.11 two threads touching it at once (a launch and its heartbeat thread) can
    see the module half-executed (AttributeError on a class it defines). The import here happens once, under a lock."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            with self._lock:
                if self._module is None:
                    self._module = importlib.import_module(self._name)
                module = self._module
        return getattr(module, attr)


compute_v1: Any = sys.modules.get("google.cloud.compute_v1") or _LazyModule("google.cloud.compute_v1")

log = logging.getLogger(__name__)
T = TypeVar("T")

# Label (and metadata) keys: underscores, not hyphens, so that list filters (`labels.KEY = "…"`) parse them whole.
LABEL_CLUSTER = "trainpipe_cluster"
LABEL_RUN = "trainpipe_run_id"
LABEL_OWNER = "trainpipe_owner"
LABEL_CREATED = "trainpipe_created_at"
LABEL_RANK = "trainpipe_rank"
LABEL_LEASE_TTL = "trainpipe_lease_ttl_s"  # how old the heartbeat may get before the run counts as gone
# A label only (renewed in place; metadata would shadow it in _stamp_of): unix time of the orchestrator's latest
# renewal (cloud.lease_alive).
LABEL_HEARTBEAT = "trainpipe_heartbeat"
# Metadata only (a fingerprint is no label value): the SHA256 fingerprint of the host key the startup-script installs.
META_HOST_KEY = "trainpipe_host_key"
POLICY_MARK = "trainpipe cluster placement "  # + the cluster's stamp as JSON: how our policies are recognised
SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]
# Deep Learning VM image (NVIDIA driver, CUDA) published by Google; TRAINPIPE_GCP_IMAGE overrides it.
DEFAULT_IMAGE = "projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570"
BOOT_DISK_GB = 200
BOOT_DISK_TYPE = "pd-balanced"
ALIVE = ("PROVISIONING", "STAGING", "RUNNING")
ENDED = ("STOPPING", "STOPPED", "SUSPENDING", "SUSPENDED", "TERMINATED")
# A Spot VM being preempted shows STOPPING for up to 30 s before it is deleted (instance_termination_action=DELETE).
PREEMPTING = ("STOPPING", "TERMINATED")
SPOT_NOTICE_S = 30.0
IN_USE = ("resourceInUseByAnotherResource", "RESOURCE_IN_USE_BY_ANOTHER_RESOURCE")
# Series that come with their local SSDs attached; earlier ones (A2 standard, N1, G2) take SCRATCH disks in the
# request (cloud.google.com/compute/docs/disks/add-local-ssd).
BUNDLED_SSD_SERIES = ("a2-ultragpu-", "a3-", "a4-", "a4x-", "a5x-", "z3-", "z4d-", "z4m-")
WAIT_S = 600.0  # for an operation to finish / instances to reach RUNNING
POLL_FIRST_S = 0.2
POLL_MAX_S = 3.0
API_ATTEMPTS = 5  # one call, repeated while it fails transiently
RETRY_FIRST_S = 1.0
API_TIMEOUT_S = 60.0
DELETE_RETRIES = 6  # a policy can stay "in use" for a short while after its instances are gone
FREE_FIRST_S = 2.0
GCE_PRODUCT_FILE = Path("/sys/class/dmi/id/product_name")
API_ERRORS = (exceptions.GoogleAPICallError, auth_exceptions.GoogleAuthError, requests.RequestException)

# Local SSDs: RAID0 over every device (one device is used as is), one filesystem, mounted at MOUNT. GCE runs the
# startup script on every boot, so each step is skipped when already done; it follows the host key install (see
# startup_script), which is the same key at every boot.
NVME_SCRIPT = f"""shopt -s nullglob
mkdir -p {MOUNT}
if ! mountpoint -q {MOUNT}; then
  devices=(/dev/disk/by-id/google-local-nvme-ssd-*)
  target=""
  if [ -e /dev/md0 ]; then
    target=/dev/md0
  elif [ "${{#devices[@]}}" -gt 1 ]; then
    command -v mdadm >/dev/null || {{ apt-get update -qq && apt-get install -y -qq mdadm; }}
    mdadm --create /dev/md0 --run --force --level=0 --raid-devices="${{#devices[@]}}" "${{devices[@]}}"
    target=/dev/md0
  elif [ "${{#devices[@]}}" -eq 1 ]; then
    target="${{devices[0]}}"
  fi
  if [ -n "$target" ]; then
    if ! blkid "$target" >/dev/null 2>&1; then
      if command -v mkfs.xfs >/dev/null; then mkfs.xfs -f -K "$target"; else mkfs.ext4 -F -E nodiscard "$target"; fi
    fi
    mount -o noatime "$target" {MOUNT}
  fi
fi
mkdir -p {MOUNT}/trainpipe/data {MOUNT}/trainpipe/ckpt {MOUNT}/trainpipe/logs
chmod -R 1777 {MOUNT}/trainpipe
"""


SELF_DELETE = "/usr/local/sbin/trainpipe-delete-self"
POWEROFF_UNIT = "trainpipe-delete-on-poweroff.service"


def poweroff_deletes_script(api_endpoint: str | None = None) -> str:
    """Makes powering the instance off delete it (infra.node.gce_self_delete says why GCE needs this): the program,
    and a unit whose stop (at shutdown; skipped on a reboot) runs it while the network is still up. Idempotent, as
    GCE runs the startup script at every boot."""
    program = Path(gce_self_delete.__file__).read_text()
    api = api_endpoint or gce_self_delete.API
    if not re.fullmatch(r"[A-Za-z0-9:/._-]+", api):
        raise InvalidRequestError(f"gcp: API endpoint {api!r}: give a plain http(s)://host[:port] URL")
    return f"""cat > {SELF_DELETE} <<'TRAINPIPE_SELF_DELETE'
{program}TRAINPIPE_SELF_DELETE
chmod 0755 {SELF_DELETE}
cat > /etc/systemd/system/{POWEROFF_UNIT} <<'TRAINPIPE_UNIT'
[Unit]
Description=trainpipe: delete this instance when it powers off (GCE only stops it, and bills its disks)
Wants=network-online.target
After=network-online.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/true
ExecStop=/bin/sh -c 'systemctl list-jobs | grep -q reboot.target || exec /usr/bin/python3 {SELF_DELETE} --api {api}'
TimeoutStopSec=60

[Install]
WantedBy=multi-user.target
TRAINPIPE_UNIT
systemctl daemon-reload
systemctl enable --now {POWEROFF_UNIT}
"""


def startup_script(host_key: HostKey, api_endpoint: str | None = None) -> str:
    """The instance's startup-script: the cluster's host key installed first, then the local SSD mount, then what makes
    a power-off delete the instance (api_endpoint: the Compute API the nodes call, default Google's). Anyone who may
    read instance metadata in the project (compute.instances.get) can read it, host private key included: see
    infra.compute.access.hostkeys."""
    return boot_script(host_key, NVME_SCRIPT + poweroff_deletes_script(api_endpoint))


def _hash8(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def label_value(text: str) -> str:
    """A GCP label value: lowercase letters, digits, '_' and '-', at most 63; a cut value ends with a hash of the
    whole, so two long values stay distinct."""
    value = re.sub(r"[^a-z0-9_-]", "-", text.lower())
    return value if len(value) <= 63 else f"{value[:54]}-{_hash8(text)}"


def resource_name(cluster_name: str, suffix: str) -> str:
    """An RFC 1035 name (what GCE takes for instances, policies, network tags): [a-z]([-a-z0-9]*[a-z0-9])?, ≤63."""
    base = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", cluster_name.lower())).strip("-")
    if not base[:1].isalpha():
        base = f"tp-{base}".rstrip("-")
    name = f"{base}-{suffix}"
    if len(name) <= 63:
        return name
    keep = 63 - len(suffix) - len(_hash8("")) - 2
    return f"{base[:keep].rstrip('-')}-{_hash8(cluster_name)}-{suffix}"


def bundles_local_ssd(machine_type: str) -> bool:
    return machine_type.startswith(BUNDLED_SSD_SERIES) or machine_type.endswith("-lssd")


def _region(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def _short(url: str) -> str:
    return url.rsplit("/", 1)[-1]


def _stamp_of(instance: compute_v1.Instance) -> dict[str, str]:
    """The cluster stamp of an instance: exact values from the metadata, sanitised labels where metadata lacks one."""
    return {**dict(instance.labels), **{item.key: item.value for item in instance.metadata.items}}


def _policy_stamp(policy: compute_v1.ResourcePolicy) -> dict[str, str] | None:
    if not policy.description.startswith(POLICY_MARK):
        return None
    try:
        stamp = json.loads(policy.description[len(POLICY_MARK):])
    except json.JSONDecodeError:
        return None
    return stamp if isinstance(stamp, dict) and LABEL_CLUSTER in stamp else None


def _created(stamp: dict[str, str]) -> float:
    try:
        return datetime.fromisoformat(stamp[LABEL_CREATED]).timestamp()
    except (KeyError, ValueError):
        return 0.0


def _rank(instance: compute_v1.Instance) -> int:
    return int(_stamp_of(instance).get(LABEL_RANK, "0"))


def _address(instance: compute_v1.Instance) -> str:
    for interface in instance.network_interfaces:
        for access in interface.access_configs:
            if access.nat_i_p:
                return str(access.nat_i_p)
    return str(instance.network_interfaces[0].network_i_p) if instance.network_interfaces else ""


@dataclass(frozen=True)
class _Stamp:
    """Who launched a cluster and when: exact in metadata and policy descriptions, sanitised in labels."""

    cluster: str
    run_id: str
    owner: str
    created: str
    lease_ttl_s: str

    def exact(self) -> dict[str, str]:
        return {LABEL_CLUSTER: self.cluster, LABEL_RUN: self.run_id, LABEL_OWNER: self.owner,
                LABEL_CREATED: self.created, LABEL_LEASE_TTL: self.lease_ttl_s}

    def labels(self) -> dict[str, str]:
        return {key: label_value(value) for key, value in self.exact().items()}


class GcpProvider(CloudProvider):
    name = "gcp"
    key_hint = "a private key whose public key is in TRAINPIPE_GCP_SSH_KEYS (or the project's ssh-keys metadata)"
    boot_log = "`journalctl -u google-startup-scripts`"

    def __init__(self, catalog: Catalog | None = None, zones: tuple[str, ...] | None = None,
                 project: str | None = None, credentials: Credentials | None = None, api_endpoint: str | None = None,
                 image: str | None = None, network: str | None = None, subnetwork: str | None = None,
                 service_account: str | None = None, ssh_keys: str | None = None, bootstrap: bool = True,
                 wheel: WheelSource = None) -> None:
        # The project and the credentials are resolved on first use, never here.
        super().__init__(catalog, bootstrap=bootstrap, wheel=wheel)
        env_zones = tuple(z for z in os.environ.get("TRAINPIPE_GCP_ZONES", "").split(",") if z)
        self._zones = zones or env_zones or None
        self._project = project or os.environ.get("TRAINPIPE_GCP_PROJECT") or None
        self._credentials = credentials
        # A Private Service Connect endpoint, say; the nodes call the same one to delete themselves.
        self._api_endpoint = api_endpoint or os.environ.get("TRAINPIPE_GCP_ENDPOINT") or None
        self._image = image or os.environ.get("TRAINPIPE_GCP_IMAGE") or DEFAULT_IMAGE
        self._network = network or os.environ.get("TRAINPIPE_GCP_NETWORK") or "default"
        self._subnetwork = subnetwork or os.environ.get("TRAINPIPE_GCP_SUBNETWORK")
        self._service_account = service_account or os.environ.get("TRAINPIPE_GCP_SERVICE_ACCOUNT") or "default"
        self._ssh_keys = ssh_keys or os.environ.get("TRAINPIPE_GCP_SSH_KEYS")
        self._clients: dict[type, Any] = {}

    # -- plumbing -----------------------------------------------------------------------------------------------

    @property
    def project(self) -> str:
        """The constructor's, else TRAINPIPE_GCP_PROJECT, else the one Application Default Credentials name."""
        if self._project is None:
            try:
                _, self._project = google.auth.default(scopes=SCOPES)
            except auth_exceptions.DefaultCredentialsError:
                self._project = None
            if not self._project:
                raise InvalidRequestError("gcp: no project: set TRAINPIPE_GCP_PROJECT or run "
                                          "`gcloud config set project PROJECT`")
        return self._project

    def _client(self, kind: type) -> Any:
        """One client per kind, built on first use: Application Default Credentials unless some were given."""
        if kind not in self._clients:
            if self._credentials is None:
                self._credentials, found = google.auth.default(scopes=SCOPES)
                self._project = self._project or found
            options = {"api_endpoint": self._api_endpoint} if self._api_endpoint else None
            # REST is the only transport Compute Engine offers; it also lets tests point it at a local server.
            self._clients[kind] = kind(credentials=self._credentials, transport="rest", client_options=options)
        return self._clients[kind]

    @property
    def instances(self) -> compute_v1.InstancesClient:
        return self._client(compute_v1.InstancesClient)

    @property
    def policies(self) -> compute_v1.ResourcePoliciesClient:
        return self._client(compute_v1.ResourcePoliciesClient)

    def _has_credentials(self) -> bool:
        """Whether Application Default Credentials could exist, decided locally: google.auth.default() would probe
        the metadata server over the network, seconds lost on every machine that is not on GCE."""
        if self._credentials is not None or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
            return True
        config = os.environ.get("CLOUDSDK_CONFIG") or (
            Path(os.environ["APPDATA"]) / "gcloud" if os.name == "nt" and "APPDATA" in os.environ
            else Path.home() / ".config" / "gcloud")
        if (Path(config) / "application_default_credentials.json").is_file():
            return True
        try:
            return GCE_PRODUCT_FILE.read_text().strip().startswith("Google")
        except OSError:
            return False

    def _in_scope(self, zone_or_region: str) -> bool:
        """TRAINPIPE_GCP_ZONES limits where clusters are looked for; without it every zone is (one aggregated call
        covers them all, and limiting to the catalog's zones would only hide leftovers in zones it no longer has)."""
        if self._zones is None:
            return True
        return zone_or_region in self._zones or zone_or_region in {_region(z) for z in self._zones}

    def _api(self, doing: str, call: Callable[[], T]) -> T:
        """One Compute Engine call, repeated with backoff while it fails transiently; every retry is logged. Calls
        pass retry=None so that the library's own silent retries do not stack under these."""
        attempt = 1
        while True:
            try:
                return call()
            except API_ERRORS as exc:
                if attempt >= API_ATTEMPTS or not is_transient(exc):
                    raise
                delay = RETRY_FIRST_S * 2 ** (attempt - 1)
                log.warning("gcp: %s: transient %s (%s): retry %d of %d in %.1fs", doing, type(exc).__name__,
                            " ".join(str(exc).split())[:300], attempt, API_ATTEMPTS - 1, delay)
                CANCEL.wait(delay)
                attempt += 1

    def _get(self, doing: str, call: Callable[[], T]) -> T | None:
        try:
            return self._api(doing, call)
        except exceptions.NotFound:
            return None

    def _call(self, doing: str, action: Callable[[], T]) -> T:
        try:
            return action()
        except API_ERRORS as exc:
            raise classify(exc, doing) from None

    def _wait(self, operation: compute_v1.Operation, doing: str) -> compute_v1.Operation:
        """The finished operation. Polls from 0.2 s up to 3 s apart with its own operations clients: the library's
        ExtendedOperation polls from 1 s up to 20 s (slow for an insert done in seconds), and its poller is built
        without the client's api_endpoint, so it would not even ask the endpoint the provider was given."""
        deadline = time.monotonic() + WAIT_S
        delay = POLL_FIRST_S
        while operation.status != compute_v1.Operation.Status.DONE:
            if time.monotonic() > deadline:
                error = LaunchError(f"gcp: {doing}: operation {operation.name} not done after {WAIT_S:.0f}s: "
                                    "retry later")
                error.transient = True
                raise error
            CANCEL.wait(delay)
            delay = min(delay * 2, POLL_MAX_S)
            operation = self._api(doing, lambda op=operation: self._refresh(op))
        return operation

    def _refresh(self, operation: compute_v1.Operation) -> compute_v1.Operation:
        if operation.zone:
            return self._client(compute_v1.ZoneOperationsClient).get(
                project=self.project, zone=_short(operation.zone), operation=operation.name, retry=None,
                timeout=API_TIMEOUT_S)
        return self._client(compute_v1.RegionOperationsClient).get(
            project=self.project, region=_short(operation.region), operation=operation.name, retry=None,
            timeout=API_TIMEOUT_S)

    def _done(self, operation: compute_v1.Operation, doing: str) -> None:
        error = operation_error(self._wait(operation, doing))
        if error is not None:
            raise classify(error, doing)

    def _finish(self, operations: list[compute_v1.Operation], doing: str) -> list[LaunchError]:
        """Wait for every operation (the list then holds the finished ones); the errors of those that failed."""
        failures = []
        for index, operation in enumerate(operations):
            operations[index] = self._wait(operation, doing)
            error = operation_error(operations[index])
            if error is not None:
                failures.append(classify(error, doing))
        return failures

    # -- launch -------------------------------------------------------------------------------------------------

    def launch_candidate(self, cluster_name: str, spec: ClusterSpec, run_id: str, candidate: Candidate,
                         host_key: HostKey) -> Cluster:
        """Every node on this candidate or none: on any failure what this call started is rolled back."""
        zone = self._zone(candidate)
        doing = f"launch {cluster_name} on {candidate.label()}"
        stamp = _Stamp(cluster_name, run_id, launcher_stamp(), datetime.now(UTC).isoformat(timespec="seconds"),
                       f"{spec.lease_ttl_s:g}")
        started: list[compute_v1.Operation] = []
        try:
            policy = self._placement_policy(cluster_name, _region(zone), stamp, doing)
            names = [resource_name(cluster_name, f"node-{rank}") for rank in range(spec.nodes)]
            for rank, name in enumerate(names):
                operation = self._node(name, rank, candidate.instance_type, candidate.spot, zone, policy, stamp,
                                       host_key, spec.gcp.service_account, doing)
                if operation is not None:
                    started.append(operation)
            failures = self._finish(started, doing)
            started.clear()  # all finished: a rollback need not wait for them again
            for other in failures[1:]:
                log.warning("%s: another node failed too: %s", doing, other)
            if failures:
                raise failures[0]
            instances = self._wait_running(zone, cluster_name, names, doing)
        except API_ERRORS as exc:
            failure: LaunchError = classify(exc, doing)
        except LaunchError as exc:
            failure = exc
        else:
            return self._cluster(cluster_name, zone, instances)
        log.warning("rolling back partial launch of %s in %s: %s", cluster_name, zone, failure)
        try:
            # Inserts still in flight would create instances after the teardown looked: let them finish first.
            for error in self._finish(started, f"roll back {cluster_name}"):
                log.info("rolling back %s: a node insert also failed: %s", cluster_name, error)
            self._teardown(cluster_name, zone)
        except (*API_ERRORS, LaunchError) as exc:
            # The launch failure is what the caller must act on; what is left is labelled, so the sweeper finds it.
            left = exc if isinstance(exc, LaunchError) else classify(exc, f"roll back {cluster_name}")
            log.error("rollback of %s in %s failed, resources left for `trainpipe sweep`: %s", cluster_name, zone,
                      left)
        raise failure

    def _zone(self, candidate: Candidate) -> str:
        """GCE instances live in a zone: the candidate's, else the first TRAINPIPE_GCP_ZONES zone of its region."""
        if candidate.zone:
            return candidate.zone
        configured = [z for z in self._zones or () if _region(z) == candidate.region]
        if not configured:
            raise InvalidRequestError(f"gcp: the catalog names no zone for {candidate.instance_type} in "
                                      f"{candidate.region}: add its zones to the catalog or set TRAINPIPE_GCP_ZONES")
        return configured[0]

    def _placement_policy(self, cluster_name: str, region: str, stamp: _Stamp, doing: str) -> str:
        """COLLOCATED: every node in one low-latency block of the zone (GCE's compact placement)."""
        name = resource_name(cluster_name, "compact")
        existing = self._get(doing, lambda: self.policies.get(
            project=self.project, region=region, resource_policy=name, retry=None, timeout=API_TIMEOUT_S))
        if existing is not None:
            owner = _policy_stamp(existing)
            if owner is None or owner[LABEL_CLUSTER] != cluster_name:
                raise InvalidRequestError(f"gcp: resource policy {name} in {region} is not cluster {cluster_name}'s: "
                                          "delete it or rename the cluster")
            return str(existing.self_link)
        policy = compute_v1.ResourcePolicy(
            name=name, description=POLICY_MARK + json.dumps(stamp.exact()),
            group_placement_policy=compute_v1.ResourcePolicyGroupPlacementPolicy(collocation="COLLOCATED"))
        request = compute_v1.InsertResourcePolicyRequest(project=self.project, region=region,
                                                         request_id=str(uuid.uuid4()),
                                                         resource_policy_resource=policy)
        self._done(self._api(doing, lambda: self.policies.insert_unary(request=request, retry=None,
                                                                       timeout=API_TIMEOUT_S)), doing)
        return f"projects/{self.project}/regions/{region}/resourcePolicies/{name}"

    def _node(self, name: str, rank: int, machine_type: str, spot: bool, zone: str, policy: str, stamp: _Stamp,
              host_key: HostKey, account: GcpServiceAccount, doing: str) -> compute_v1.Operation | None:
        """Start one node; None when a live node of this very launch already runs (adopted as it is, with the host
        key, and the metadata naming it, of the try that started it)."""
        existing = self._get(doing, lambda: self.instances.get(
            project=self.project, zone=zone, instance=name, retry=None, timeout=API_TIMEOUT_S))
        if existing is not None:
            if _stamp_of(existing).get(LABEL_CLUSTER) != stamp.cluster:
                raise InvalidRequestError(f"gcp: {zone} already has an instance {name} outside cluster "
                                          f"{stamp.cluster}: delete it or rename the cluster")
            same = (_short(existing.machine_type) == machine_type
                    and (existing.scheduling.provisioning_model == "SPOT") == spot)
            if same and existing.status in ALIVE:
                log.info("%s rank %d: adopting %s from an earlier try of this launch", stamp.cluster, rank, name)
                return None
            # An ended node (a stopped or preempted VM) or one of another shape holds the name: replace it.
            log.info("%s rank %d: replacing %s (%s, %s)", stamp.cluster, rank, name, existing.status,
                     _short(existing.machine_type))
            deleting = self._delete_instance(zone, name, doing)
            if deleting is not None:
                self._done(deleting, doing)
        request = compute_v1.InsertInstanceRequest(
            project=self.project, zone=zone, request_id=str(uuid.uuid4()),
            instance_resource=self._instance(name, rank, machine_type, spot, zone, policy, stamp, host_key, account))
        return self._api(doing, lambda: self.instances.insert_unary(request=request, retry=None,
                                                                    timeout=API_TIMEOUT_S))

    def _instance(self, name: str, rank: int, machine_type: str, spot: bool, zone: str, policy: str, stamp: _Stamp,
                  host_key: HostKey, account: GcpServiceAccount) -> compute_v1.Instance:
        metadata = {"startup-script": startup_script(host_key, self._api_endpoint), "install-nvidia-driver": "True",
                    **stamp.exact(), LABEL_RANK: str(rank), META_HOST_KEY: host_key.fingerprint}
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
            interface.subnetwork = f"regions/{_region(zone)}/subnetworks/{self._subnetwork}"
        else:
            interface.network = f"global/networks/{self._network}"
        return compute_v1.Instance(
            name=name, machine_type=f"zones/{zone}/machineTypes/{machine_type}",
            labels={**stamp.labels(), LABEL_RANK: str(rank), LABEL_HEARTBEAT: f"{time.time():.0f}"},
            metadata=compute_v1.Metadata(items=[compute_v1.Items(key=k, value=v) for k, v in metadata.items()]),
            scheduling=scheduling, disks=self._disks(machine_type, zone, stamp), network_interfaces=[interface],
            resource_policies=[policy], tags=compute_v1.Tags(items=["trainpipe", resource_name(stamp.cluster, "node")]),
            # The nodes' own credentials for the dataset and checkpoints (cluster.gcp.service_account).
            service_accounts=[compute_v1.ServiceAccount(email=account.email or self._service_account,
                                                        scopes=list(account.scopes))])

    def _disks(self, machine_type: str, zone: str, stamp: _Stamp) -> list[compute_v1.AttachedDisk]:
        boot = compute_v1.AttachedDisk(boot=True, auto_delete=True,
                                       initialize_params=compute_v1.AttachedDiskInitializeParams(
                                           source_image=self._image, disk_size_gb=BOOT_DISK_GB,
                                           disk_type=f"zones/{zone}/diskTypes/{BOOT_DISK_TYPE}",
                                           labels=stamp.labels()))
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
        deadline = time.monotonic() + WAIT_S
        delay = POLL_FIRST_S
        while True:
            found = {i.name: i for i in self._zone_instances(zone, cluster_name, doing)}
            gone = sorted(n for n in names if n not in found or found[n].status in ENDED)
            if gone:
                raise CapacityError(f"gcp: {', '.join(gone)} ended while starting (spot reclaimed?): "
                                    "trying elsewhere")
            if all(found[n].status == "RUNNING" for n in names):
                return [found[n] for n in names]
            if time.monotonic() > deadline:
                raise CapacityError(f"gcp: {', '.join(names)} not RUNNING after {WAIT_S:.0f}s: trying elsewhere")
            CANCEL.wait(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def _cluster(self, cluster_name: str, zone: str, instances: list[compute_v1.Instance]) -> Cluster:
        instances = sorted(instances, key=_rank)
        stamp = _stamp_of(instances[0])
        nodes = tuple(Node(
            name=i.name, rank=_rank(i), address=_address(i), workdir=f"{MOUNT}/trainpipe",
            data_dir=f"{MOUNT}/trainpipe/data", ckpt_dir=f"{MOUNT}/trainpipe/ckpt", python="python3",
        ) for i in instances)
        machine_type = _short(instances[0].machine_type)
        spot = instances[0].scheduling.provisioning_model == "SPOT"
        # owner also says where the nodes are, so later calls (preemption, liveness) go straight to the zone.
        owner = {"owner": stamp.get(LABEL_OWNER, ""), "project": self.project, "zone": zone, "region": _region(zone),
                 "instances": {i.name: str(i.id) for i in instances}, "instance_type": machine_type,
                 LEASE_TTL: stamp.get(LABEL_LEASE_TTL),
                 HOST_KEYS: {i.name: _stamp_of(i)[META_HOST_KEY] for i in instances if META_HOST_KEY in _stamp_of(i)}}
        return Cluster(name=cluster_name, provider=self.name, run_id=stamp.get(LABEL_RUN, "unknown"), nodes=nodes,
                       created_at=_created(stamp), owner=owner, instance_type=machine_type,
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
            found = _stamp_of(template)
            stamp = _Stamp(cluster.name, found.get(LABEL_RUN, cluster.run_id), found.get(LABEL_OWNER, ""),
                           found.get(LABEL_CREATED, ""), found.get(LABEL_LEASE_TTL, ""))
            # The survivors' service account and scopes: the replacement reaches the buckets as they do.
            account = GcpServiceAccount()
            if template.service_accounts:
                account = GcpServiceAccount(email=template.service_accounts[0].email,
                                            scopes=tuple(template.service_accounts[0].scopes) or account.scopes)
            started: list[compute_v1.Operation] = []
            try:
                for node in lost:
                    operation = self._node(
                        node.name, node.rank, _short(template.machine_type),
                        template.scheduling.provisioning_model == "SPOT", zone, template.resource_policies[0],
                        stamp, host_keys[node.name], account, doing)
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

    def _zone_instances(self, zone: str, cluster_name: str, doing: str) -> list[compute_v1.Instance]:
        request = compute_v1.ListInstancesRequest(project=self.project, zone=zone,
                                                  filter=self._label_filter(cluster_name))
        found = self._api(doing, lambda: list(self.instances.list(request=request, retry=None,
                                                                  timeout=API_TIMEOUT_S)))
        # The label is sanitised, so two cluster names may share it; the metadata holds the exact name.
        return sorted((i for i in found if _stamp_of(i).get(LABEL_CLUSTER) == cluster_name), key=_rank)

    def _all_instances(self, cluster_name: str | None, doing: str) -> list[tuple[str, compute_v1.Instance]]:
        """(zone, instance) of every trainpipe instance (of one cluster when named), across zones in one call."""
        request = compute_v1.AggregatedListInstancesRequest(project=self.project,
                                                            filter=self._label_filter(cluster_name))
        scopes = self._api(doing, lambda: list(self.instances.aggregated_list(request=request, retry=None,
                                                                               timeout=API_TIMEOUT_S)))
        found = [(_short(scope), i) for scope, listed in scopes for i in listed.instances]
        return sorted(((zone, i) for zone, i in found if self._in_scope(zone)
                       and (cluster_name is None or _stamp_of(i).get(LABEL_CLUSTER) == cluster_name)),
                      key=lambda found_in: (found_in[0], _rank(found_in[1])))

    def _all_policies(self, cluster_name: str | None, doing: str) -> list[tuple[str, compute_v1.ResourcePolicy]]:
        """(region, policy) of trainpipe's placement policies (of one cluster when named), across regions."""
        request = compute_v1.AggregatedListResourcePoliciesRequest(project=self.project)
        scopes = self._api(doing, lambda: list(self.policies.aggregated_list(request=request, retry=None,
                                                                              timeout=API_TIMEOUT_S)))
        found = []
        for scope, listed in scopes:
            for policy in listed.resource_policies:
                stamp = _policy_stamp(policy)
                if stamp and self._in_scope(_short(scope)) and cluster_name in (None, stamp[LABEL_CLUSTER]):
                    found.append((_short(scope), policy))
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
            policies = self._region_policy(cluster_name, _region(zone), doing)
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
        stamp = _policy_stamp(policy) if policy is not None else None
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
            stamp = _stamp_of(instance)
            by_cluster.setdefault(stamp[LABEL_CLUSTER], []).append(instance)
            stamps.setdefault(stamp[LABEL_CLUSTER], stamp)
        # Policies without instances are what a crashed teardown left: list them too, so the sweeper removes them.
        for _, policy in policies:
            owner = _policy_stamp(policy)
            if owner is not None:
                by_cluster.setdefault(owner[LABEL_CLUSTER], [])
                stamps.setdefault(owner[LABEL_CLUSTER], owner)
        return [ClusterRecord(
            name=name, provider=self.name, run_id=stamps[name].get(LABEL_RUN, "unknown"),
            created_at=_created(stamps[name]), nodes=len(found), processes=len(found),
            owner_alive=bool(found) and lease_alive([i.labels.get(LABEL_HEARTBEAT) for i in found],
                                                    stamps[name].get(LABEL_LEASE_TTL), _created(stamps[name])),
        ) for name, found in sorted(by_cluster.items())]

    # -- nodes --------------------------------------------------------------------------------------------------

    def _nodes_now(self, cluster: Cluster) -> dict[str, compute_v1.Instance]:
        doing = f"describe {cluster.name}"
        found = self._call(doing, lambda: self._zone_instances(cluster.owner["zone"], cluster.name, doing))
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
