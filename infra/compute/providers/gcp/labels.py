"""How a GCP cluster is found again and whose it is: the labels (sanitised values, for list filters) and metadata
(exact values) every instance carries, the stamp in a placement policy's description, and the RFC 1035 names of
instances and policies derived from the cluster's name."""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime

from infra.compute.providers.gcp.api import compute_v1
from infra.compute.providers.owner import Stamp, StampKeys

# Label (and metadata) keys: underscores, not hyphens, so that list filters (`labels.KEY = "…"`) parse them whole.
LABEL_CLUSTER = "trainpipe_cluster"
LABEL_RUN = "trainpipe_run_id"
LABEL_OWNER = "trainpipe_owner"
LABEL_CREATED = "trainpipe_created_at"
LABEL_RANK = "trainpipe_rank"
LABEL_LEASE_TTL = "trainpipe_lease_ttl_s"  # how old the heartbeat may get before the run counts as gone
# A label only (renewed in place; metadata would shadow it in stamp_of): unix time of the orchestrator's latest
# renewal (cloud.lease_alive).
LABEL_HEARTBEAT = "trainpipe_heartbeat"
# Metadata only (a fingerprint is no label value): the SHA256 fingerprint of the host key the startup-script installs.
META_HOST_KEY = "trainpipe_host_key"
META_BOOT_IMAGE = "trainpipe_boot_image"  # the image the cluster's nodes booted: what a replacement boots
POLICY_MARK = "trainpipe cluster placement "  # + the cluster's stamp as JSON: how our policies are recognised


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


def stamp_of(instance: compute_v1.Instance) -> dict[str, str]:
    """The cluster stamp of an instance: exact values from the metadata, sanitised labels where metadata lacks one."""
    return {**dict(instance.labels), **{item.key: item.value for item in instance.metadata.items}}


def policy_stamp(policy: compute_v1.ResourcePolicy) -> dict[str, str] | None:
    if not policy.description.startswith(POLICY_MARK):
        return None
    try:
        stamp = json.loads(policy.description[len(POLICY_MARK):])
    except json.JSONDecodeError:
        return None
    return stamp if isinstance(stamp, dict) and LABEL_CLUSTER in stamp else None


def created_time(stamp: dict[str, str]) -> float:
    try:
        return datetime.fromisoformat(stamp[LABEL_CREATED]).timestamp()
    except (KeyError, ValueError):
        return 0.0


def rank_of(instance: compute_v1.Instance) -> int:
    return int(stamp_of(instance).get(LABEL_RANK, "0"))


def address_of(instance: compute_v1.Instance) -> str:
    for interface in instance.network_interfaces:
        for access in interface.access_configs:
            if access.nat_i_p:
                return str(access.nat_i_p)
    return cluster_address_of(instance)


def cluster_address_of(instance: compute_v1.Instance) -> str:
    """The first interface's address in its VPC subnet: what the nodes reach each other by (the NAT address is not
    bound on the instance)."""
    return str(instance.network_interfaces[0].network_i_p) if instance.network_interfaces else ""


# The stamp (owner.Stamp) is exact in metadata and policy descriptions, sanitised (stamp_labels) in labels.
STAMP_KEYS = StampKeys(LABEL_CLUSTER, LABEL_RUN, LABEL_OWNER, LABEL_CREATED, LABEL_LEASE_TTL)


def stamp_labels(stamp: Stamp) -> dict[str, str]:
    return stamp.keyed(STAMP_KEYS, label_value)
