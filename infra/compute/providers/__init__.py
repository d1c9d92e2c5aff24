"""Providers by name: the caller asks for one and never branches on which it got.

Each provider owns its module (or package, netns) and its errors (aws_errors, gcp_errors); cloud holds what the
clouds share (boot script, heartbeat), launcher who launched a cluster. May import: access, catalog, optimizer,
failover, job, lifecycle (lease renewal), the node agent's process tags and notices, and the shared infra modules.
"""

from __future__ import annotations

from collections.abc import Callable

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
)
from infra.compute.providers.local import LocalProvider


def _aws() -> Provider:
    # Imported on first use: it pulls in boto3 and the optimizer, which most commands never need.
    from infra.compute.providers.aws import AwsProvider

    return AwsProvider()


def _gcp() -> Provider:
    from infra.compute.providers.gcp import GcpProvider

    return GcpProvider()


def _ssh() -> Provider:
    from infra.compute.providers.ssh import SshProvider

    return SshProvider()


def _netns() -> Provider:
    from infra.compute.providers.netns.provider import NetnsProvider

    return NetnsProvider()


_FACTORIES: dict[str, Callable[[], Provider]] = {
    "local": LocalProvider,
    "aws": _aws,
    "gcp": _gcp,
    "ssh": _ssh,
    "netns": _netns,
}


def get_provider(name: str) -> Provider:
    try:
        return _FACTORIES[name]()
    except KeyError:
        raise InvalidRequestError(f"unknown provider '{name}': use one of {', '.join(sorted(_FACTORIES))}") from None


def all_providers() -> list[Provider]:
    return [factory() for factory in _FACTORIES.values()]


__all__ = [
    "CapacityError", "Cluster", "ClusterRecord", "InvalidRequestError", "LaunchError", "Node", "PriceError",
    "Provider", "QuotaError", "all_providers", "get_provider",
]
