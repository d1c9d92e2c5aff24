"""How an Azure cluster is named and found again: one resource group per cluster, named after it and tagged with whose
it is (the sweeper lists groups by tag), the fixed names of what the group holds, and the tags every VM carries."""

from __future__ import annotations

import hashlib
import re
from datetime import datetime
from typing import Any

from infra.compute.providers.owner import StampKeys

# Tag names: ARM forbids <>%&\?/ in them; values take any text up to 256 characters, so they hold exact values.
TAG_CLUSTER = "trainpipe-cluster"
TAG_RUN = "trainpipe-run-id"
TAG_OWNER = "trainpipe-owner"
TAG_CREATED = "trainpipe-created-at"
TAG_LEASE_TTL = "trainpipe-lease-ttl-s"
TAG_HEARTBEAT = "trainpipe-heartbeat"  # on the group: unix time of the orchestrator's latest renewal
TAG_NODES = "trainpipe-nodes"  # on the group: how many nodes the cluster has (an evicted VM is deleted at once)
TAG_RANK = "trainpipe-rank"  # on each VM
TAG_HOST_KEY = "trainpipe-host-key"  # on each VM: the SHA256 fingerprint of the host key its boot script installs

# What a cluster's group holds besides its nodes.
VNET, SUBNET, NSG = "trainpipe-vnet", "nodes", "trainpipe-nsg"
PPG, AVAILABILITY_SET = "trainpipe-ppg", "trainpipe-avset"
VNET_PREFIX, SUBNET_PREFIX = "10.0.0.0/16", "10.0.0.0/20"  # room for the spec's 1024 nodes


def _hash8(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _cut(text: str, limit: int, whole: str) -> str:
    return text if len(text) <= limit else f"{text[:limit - 9]}-{_hash8(whole)}"


def group_name(cluster_name: str) -> str:
    """The cluster's resource group: letters, digits, - _ . ( ), at most 90, not ending in a period."""
    base = re.sub(r"[^-\w.()]", "-", f"trainpipe-{cluster_name}").rstrip(".")
    return _cut(base, 90, cluster_name)


def vm_name(cluster_name: str, rank: int) -> str:
    """A VM name that is also a valid Linux host name: letters, digits and hyphens, at most 64."""
    base = re.sub(r"-+", "-", re.sub(r"[^A-Za-z0-9-]", "-", cluster_name)).strip("-") or "tp"
    suffix = f"-node-{rank}"
    return _cut(base, 64 - len(suffix), cluster_name) + suffix


def nic_name(vm: str) -> str:
    return f"{vm}-nic"


def public_ip_name(vm: str) -> str:
    return f"{vm}-ip"


def resource_id(subscription: str, group: str, kind: str, name: str) -> str:
    return f"/subscriptions/{subscription}/resourceGroups/{group}/providers/{kind}/{name}"


def created_time(tags: dict[str, str]) -> float:
    try:
        return datetime.fromisoformat(tags[TAG_CREATED]).timestamp()
    except (KeyError, ValueError):
        return 0.0


def tags_of(resource: dict[str, Any]) -> dict[str, str]:
    return dict(resource.get("tags") or {})


def rank_of(vm: dict[str, Any]) -> int:
    return int(tags_of(vm).get(TAG_RANK, "0"))


# The stamp (owner.Stamp) on the cluster's group and on every VM, exact (tag values take any text).
STAMP_KEYS = StampKeys(TAG_CLUSTER, TAG_RUN, TAG_OWNER, TAG_CREATED, TAG_LEASE_TTL)
