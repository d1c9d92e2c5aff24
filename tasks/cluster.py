"""Provision and tear down the cluster."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from prefect import get_run_logger, task
from prefect.exceptions import MissingContextError

from infra.cancel import CANCEL
from infra.compute.access.agent import NodeAgent
from infra.compute.access.agent_store import agent_store_url
from infra.compute.providers import (
    Cluster,
    Node,
    Provider,
    launch_cluster,
    provider_for,
    provider_of,
    terminate_cluster,
)
from infra.compute.renewal import RENEWALS_PER_TTL
from infra.job.plan import checkpoint_url_for
from infra.job.spec import JobSpec
from infra.lifecycle.lease import LeaseKeeper
from infra.lifecycle.ownership import Owner, claim, refuse_live_owner
from infra.node.protocol import WatchRequest
from infra.node.sync import STOP_FILE
from infra.node.watchdog import LEASE_FILE
from tasks.policy import TRANSIENT_RETRIES

_lease_keepers: dict[str, LeaseKeeper] = {}


def start_lease(provider: Provider, cluster: Cluster, ttl_s: float, nodes: Sequence[Node] | None = None) -> None:
    """Start the watchdog of `nodes` (default: every node), then keep every node's lease fresh from this process for
    as long as it lives.

    One keeper per cluster name: a retried provision replaces the keeper of the attempt it tore down (else that
    keeper would renew leases for ever, in a long-lived `trainpipe serve` above all), a replacement of lost nodes
    replaces it with one that follows the new membership (the survivors' watchdogs run on: only the new nodes get
    one), and a start that fails stops the keeper it began."""
    _stop_lease(cluster.name)
    _lease_keepers[cluster.name] = LeaseKeeper(provider, cluster, ttl_s / RENEWALS_PER_TTL).start()
    try:
        claim(provider, cluster, cluster.nodes if nodes is None else nodes, Owner.me(cluster.run_id, ttl_s))
        for node in cluster.nodes if nodes is None else nodes:
            NodeAgent(provider.runner(cluster, node), node.python).start(
                watch_request(provider, node, ttl_s), log_path=node.path("logs", "watch.log"))
    except BaseException:
        _stop_lease(cluster.name)
        raise


def watch_request(provider: Provider, node: Node, ttl_s: float) -> WatchRequest:
    """The node's watchdog: the lease's TTL and what to do when it expires, and where preemption notices come from."""
    return WatchRequest(lease=node.path(LEASE_FILE), ttl_s=ttl_s, on_expire=provider.lease_expiry,
                        notice_source=provider.notice_source, notice_url=provider.notice_url, workdir=node.workdir,
                        stop_sync_file=f"{node.sync_dir}/{STOP_FILE}")


def _stop_lease(cluster_name: str) -> None:
    keeper = _lease_keepers.pop(cluster_name, None)
    if keeper is not None:
        keeper.stop()


@task(name="check-cluster-owner", **TRANSIENT_RETRIES)
def refuse_if_owned(job: JobSpec, cluster_name: str) -> None:
    """Before the run touches anything (its plan, its run folder, the cluster): ClusterInUse when another run's
    orchestrator owns the cluster and is alive (a cron overlap, a manual resume while the first run trains)."""
    refuse_live_owner(provider_for(job.cluster), cluster_name)


@task(name="provision-cluster", **TRANSIENT_RETRIES)
def provision_cluster(job: JobSpec, cluster_name: str, run_id: str) -> Cluster:
    logger = get_run_logger()
    # Asked again right before the teardown below: another orchestrator may have taken the name since the run began.
    refuse_live_owner(provider_for(job.cluster), cluster_name)
    _stop_lease(cluster_name)
    if terminate_cluster(job.cluster.provider, cluster_name).found:
        # A crashed earlier attempt of this run left it: started clean rather than adopting half-dead processes.
        logger.warning("cluster %s was left from an earlier attempt: torn down first", cluster_name)
    cluster = launch_cluster(job.cluster, cluster_name, run_id, run_agent_store(job, run_id))
    provider = provider_of(cluster)
    start_lease(provider, cluster, job.cluster.lease_ttl_s)
    logger.info("launched %s on %s: %s", cluster.name, provider.name, ", ".join(n.name for n in cluster.nodes))
    return cluster


def run_agent_store(job: JobSpec, run_id: str) -> str:
    """Where the run's nodes fetch the agent's wheels from: beside its checkpoints, as its code."""
    return agent_store_url(checkpoint_url_for(job, run_id))


@task(name="teardown-cluster", **TRANSIENT_RETRIES)
def teardown_cluster(provider_name: str, cluster_name: str, keep_data: bool = False) -> int:
    """Terminate (idempotent, so a transient failure is retried with backoff) and return how many nodes are still
    alive afterwards: the answer must be 0.

    keep_data: a recovery's teardown, after which the same machines (where the provider has them) keep their
    staged data for the relaunch."""
    _stop_lease(cluster_name)
    with CANCEL.shield():  # a cancel asks for this teardown: its waits keep their own deadlines
        alive = terminate_cluster(provider_name, cluster_name, keep_data).nodes_left
    _logger().info("teardown of %s: %d nodes left running", cluster_name, alive)
    return alive


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The task's logger; the flow's crash and cancellation hooks call teardown outside any run context."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)
