"""Providers by name: the caller asks for one and never branches on which it got.

The table lists the providers (name, class, what the cluster spec needs of it). Each provider owns its module
(local) or package (aws, gcp, ssh, netns: the provider, its errors, its config section); cloud holds what the
clouds share (boot script, heartbeat), owner who launched a cluster. May import the rest of compute (access,
catalog, optimizer, failover, the cluster spec, renewal) and the rooms below it: the node agent's process tags and
notices, the dataset's staging cache, the shared infra modules; never the job or the lifecycle
(tests/test_layering.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infra.compute.access.agent import NodeAgent
from infra.compute.access.remote import Runner
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
from infra.compute.providers.table import PROVIDER_NAMES, PROVIDERS, ProviderEntry, provider_entry

if TYPE_CHECKING:  # the cluster spec imports the providers' config sections, which import this package
    from infra.compute.spec import ClusterSpec


def _create(entry: ProviderEntry) -> Provider:
    module, _, cls = entry.implementation.partition(":")
    return getattr(importlib.import_module(module), cls)()  # type: ignore[no-any-return]


def get_provider(name: str) -> Provider:
    entry = provider_entry(name)
    if entry is None:
        raise InvalidRequestError(f"unknown provider '{name}': use one of {', '.join(sorted(PROVIDER_NAMES))}")
    return _create(entry)


def provider_of(cluster: Cluster) -> Provider:
    """The provider that made this cluster: the one place a launched cluster is mapped back to its provider, so no
    caller looks one up by name again (a cluster record read from disk names its provider, opaque to the rest)."""
    return get_provider(cluster.provider)


def runner_for(cluster: Cluster, node: Node) -> Runner:
    """How the orchestrator reaches one node of the cluster, whatever the provider."""
    return provider_of(cluster).runner(cluster, node)


def agent_for(cluster: Cluster, node: Node, env: Mapping[str, str] | None = None) -> NodeAgent:
    """The node's agent (infra.node.protocol's one client), its commands given env (the job's secrets, store
    credentials) on the runner's own channel."""
    return NodeAgent(runner_for(cluster, node), node.python, env)


def provider_for(spec: ClusterSpec) -> Provider:
    """The provider a cluster spec names: how a cluster is planned and launched, before there is one."""
    return get_provider(spec.provider)


def launch_cluster(spec: ClusterSpec, cluster_name: str, run_id: str, agent_store: str | None = None) -> Cluster:
    """Launch a cluster on the provider its spec names (every node or none; LaunchError says why not); agent_store:
    see Provider.agent_store."""
    return provider_for(spec).with_agent_store(agent_store).launch(cluster_name, spec, run_id)


def check_site(spec: ClusterSpec) -> None:
    """ValueError naming what the provider's site has when it can never hold the cluster as asked (asked at plan)."""
    provider_for(spec).check_site(spec)


@dataclass(frozen=True)
class TornDown:
    found: bool  # something of the cluster was running or left behind, and is now gone
    nodes_left: int  # its nodes still alive afterwards: must be 0


def terminate_cluster(provider_name: str, cluster_name: str, keep_data: bool = False) -> TornDown:
    """Tear a cluster down by its names alone (all a crashed run's hooks and the CLI have), idempotently, and count
    what is still alive afterwards. keep_data: a recovery's teardown, after which the same machines (where the
    provider has them) keep their staged data for the relaunch."""
    provider = get_provider(provider_name)
    found = provider.terminate_keeping_data(cluster_name) if keep_data else provider.terminate(cluster_name)
    left = provider.describe(cluster_name)
    return TornDown(found, sum(provider.nodes_alive(left).values()) if left else 0)


def all_providers() -> list[Provider]:
    return [_create(entry) for entry in PROVIDERS]


__all__ = [
    "CapacityError", "Cluster", "ClusterRecord", "InvalidRequestError", "LaunchError", "Node", "PriceError",
    "Provider", "QuotaError", "ReplacementUnavailable", "TornDown", "agent_for", "all_providers", "check_site",
    "get_provider", "launch_cluster", "provider_for", "provider_of", "runner_for", "terminate_cluster",
]
