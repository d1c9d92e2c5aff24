"""Replace only what was lost: after a preemption the lost nodes are replaced in the cluster's own placement and the
survivors rejoin as they are (their trainers and syncers ended by the train task; their dirs, staged data, code,
setup, local checkpoints and lease watchdogs kept). Where the placement cannot take new nodes the flow relaunches the
whole cluster instead, and the recovery's record says why."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefect import get_run_logger, task

from infra.compute.providers import Cluster, Node, ReplacementUnavailable, agent_for, provider_of
from infra.job.spec import JobSpec
from infra.lifecycle.hang import Hung
from infra.lifecycle.preemption_watch import CHAOS_TRIGGER, Preempted
from infra.lifecycle.recovery import RecoveryRecord
from infra.node.events import NodeEvent
from infra.node.preemption_notice import NOTICE_FILE
from infra.node.protocol import RejoinRequest
from tasks.cluster import run_agent_store, start_lease
from tasks.node_output import last_event, node_line_sink
from tasks.policy import NO_RETRIES, TRANSIENT_RETRIES


@dataclass(frozen=True)
class Replaced:
    """The cluster after a replacement, and which of its nodes are new (the rest survived)."""

    cluster: Cluster
    new: tuple[str, ...]

    def is_new(self, node: Node) -> bool:
        return node.name in self.new


@task(name="replace-nodes", **NO_RETRIES)
def replace_lost_nodes(lost_from: Cluster, lost: Sequence[str], lease_ttl_s: float,
                       agent_store: str | None = None) -> Replaced:
    """The provider's replace_nodes, then the new nodes' lease watchdogs, and the lease keeper on the new membership.

    Not retried: a placement without room now is the whole relaunch's to handle (ReplacementUnavailable)."""
    provider = provider_of(lost_from)
    cluster_name = lost_from.name
    cluster = provider.describe(cluster_name)  # its record as the provider keeps it now, not as training began
    if cluster is None:
        raise ReplacementUnavailable(f"{cluster_name}: no cluster record: there is nothing to replace nodes in")
    replaced = provider.with_agent_store(agent_store).replace_nodes(cluster, lost)
    new = [node for node in replaced.nodes if node.name in lost]
    start_lease(provider, replaced, lease_ttl_s, new)
    get_run_logger().info("replaced %s in %s; %d nodes kept as they were", ", ".join(n.name for n in new),
                          cluster_name, len(replaced.nodes) - len(new))
    return Replaced(replaced, tuple(node.name for node in new))


def replace_or_relaunch(job: JobSpec, preempted: Preempted, recovery: RecoveryRecord) -> Replaced | None:
    """Replace only the lost nodes unless recovery.replace is cluster; None: relaunch the whole cluster (the record
    says why when a replacement was tried)."""
    if isinstance(preempted, Hung):
        recovery.restarted_in_place()  # every node is there: the ranks start again where they are
        return Replaced(preempted.cluster, ())
    if job.recovery.replace == "cluster":
        return None
    try:
        replaced = replace_lost_nodes.with_options(task_run_name=f"recovery-{recovery.number}: replace after "
                                                   f"{preempted}")(preempted.cluster, list(preempted.nodes),
                                                                   job.cluster.lease_ttl_s,
                                                                   run_agent_store(job, preempted.cluster.run_id))
    except ReplacementUnavailable as unavailable:
        recovery.fell_back(str(unavailable))
        get_run_logger().warning("recovery %d: the lost nodes cannot be replaced alone (%s): relaunching the whole "
                                 "cluster", recovery.number, unavailable)
        return None
    recovery.replaced_nodes(replaced.new)
    return replaced


@task(name="rejoin-node", **TRANSIENT_RETRIES)
def rejoin_node(cluster: Cluster, node: Node, attempt: int, fresh_start: bool) -> int:
    """A survivor ready for attempt `attempt` (infra/node/rejoin.py): what the attempt that ended would mislead it with
    removed, its metrics set aside; fresh_start (nothing committed to resume from): its local saves go too. Returns a
    free port on the node (the head's is the rendezvous port)."""
    request = RejoinRequest(clear=(node.sync_dir, *([node.ckpt_dir] if fresh_start else [])),
                            remove=(node.path(NOTICE_FILE), node.path(CHAOS_TRIGGER)),
                            set_aside=(node.metrics_file,), suffix=f"attempt-{attempt - 1}")
    result = agent_for(cluster, node).run(request, timeout=120, on_line=node_line_sink(get_run_logger(), node.name))
    return int(last_event(result.output, NodeEvent.REJOINED)["free_port"])
