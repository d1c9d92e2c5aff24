"""How a Nebius cluster is found again and whose it is: the labels its GPU cluster and every instance carry, and the
names of both, derived from the cluster's name.

Label values are kept to what Nebius takes everywhere (lowercase letters, digits, '-', '_', '.'; at most 63): the
cluster's name as is when it fits (trainpipe's own names do), else cut with a hash of the whole; times as unix
seconds; the pinned host key's SHA256 fingerprint as hex, in two labels (64 hex digits do not fit one).
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Any

from infra.compute.providers.owner import Stamp, StampKeys

LABEL_CLUSTER = "trainpipe-cluster"
LABEL_RUN = "trainpipe-run-id"
LABEL_OWNER = "trainpipe-owner"
LABEL_CREATED = "trainpipe-created-at"  # unix seconds
LABEL_LEASE_TTL = "trainpipe-lease-ttl-s"  # how old the heartbeat may get before the run counts as gone
LABEL_RANK = "trainpipe-rank"
# On the GPU cluster only, renewed in place: unix time of the orchestrator's latest renewal (cloud.lease_alive).
LABEL_HEARTBEAT = "trainpipe-heartbeat"
LABEL_HOST_KEY = ("trainpipe-host-key-1", "trainpipe-host-key-2")  # the pinned fingerprint, hex, in two halves
NAME_MAX = 63


def _hash8(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def label_value(text: str) -> str:
    value = re.sub(r"[^a-z0-9_.-]", "-", text.lower())
    return value if len(value) <= NAME_MAX else f"{value[:54]}-{_hash8(text)}"


def resource_name(cluster_name: str, suffix: str) -> str:
    """A name for the cluster's GPU cluster or instance (unique in the project, so a retried launch finds it)."""
    base = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", cluster_name.lower())).strip("-") or "tp"
    name = f"{base}-{suffix}"
    if len(name) <= NAME_MAX:
        return name
    keep = NAME_MAX - len(suffix) - 10
    return f"{base[:keep].rstrip('-')}-{_hash8(cluster_name)}-{suffix}"


def fingerprint_labels(fingerprint: str) -> dict[str, str]:
    digest = base64.b64decode(fingerprint.removeprefix("SHA256:") + "=" * (-len(fingerprint) % 4)).hex()
    return {LABEL_HOST_KEY[0]: digest[:32], LABEL_HOST_KEY[1]: digest[32:]}


def fingerprint_of(labels: dict[str, str]) -> str | None:
    halves = [labels.get(key) for key in LABEL_HOST_KEY]
    if not all(halves):
        return None
    digest = bytes.fromhex("".join(h for h in halves if h))
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def labels_of(resource: Any) -> dict[str, str]:
    return dict(resource.metadata.labels)


def rank_of(instance: Any) -> int:
    try:
        return int(labels_of(instance).get(LABEL_RANK, "0"))
    except ValueError:
        return 0


def created_time(labels: dict[str, str]) -> float:
    try:
        return float(labels[LABEL_CREATED])
    except (KeyError, ValueError):
        return 0.0


def address(interface_address: str) -> str:
    """An address as the API gives it (192.168.0.5/32) without its prefix length."""
    return interface_address.split("/", 1)[0]


# The stamp (owner.Stamp) on the GPU cluster and on every instance.
STAMP_KEYS = StampKeys(LABEL_CLUSTER, LABEL_RUN, LABEL_OWNER, LABEL_CREATED, LABEL_LEASE_TTL)


def stamp_labels(stamp: Stamp) -> dict[str, str]:
    return stamp.keyed(STAMP_KEYS, label_value)
