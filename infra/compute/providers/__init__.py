"""Providers by name: the caller asks for one and never branches on which it got.

The registry is the table of providers (name, class, what the job spec needs of it). Each provider owns its module
(local) or package (aws, gcp, ssh, netns: the provider, its errors, its config section); cloud holds what the
clouds share (boot script, heartbeat), launcher who launched a cluster. May import: access, catalog, optimizer,
failover, job, lifecycle (lease renewal), the node agent's process tags and notices, and the shared infra modules.
"""

from __future__ import annotations

from infra.compute.providers.base import (
    CapacityError,
    Cluster,
    ClusterRecord,
    InvalidRequestError,
    LaunchError,
    Node,
    PriceError,
    Provider,
    QuotaError,
    ReplacementUnavailable,
)
from infra.compute.providers.registry import PROVIDER_NAMES, PROVIDERS, provider_entry


def get_provider(name: str) -> Provider:
    entry = provider_entry(name)
    if entry is None:
        raise InvalidRequestError(f"unknown provider '{name}': use one of {', '.join(sorted(PROVIDER_NAMES))}")
    return entry.create()


def all_providers() -> list[Provider]:
    return [entry.create() for entry in PROVIDERS]


__all__ = [
    "CapacityError", "Cluster", "ClusterRecord", "InvalidRequestError", "LaunchError", "Node", "PriceError",
    "Provider", "QuotaError", "ReplacementUnavailable", "all_providers", "get_provider",
]
