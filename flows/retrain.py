"""retrain: plan → provision → verify → stage → train → sync → evaluate → promote → teardown (always) → report.

A preemption during training loops back, resuming from the latest committed checkpoint, at most
recovery.max_recoveries times within recovery.deadline_s: the lost nodes replaced alone → verify them → stage (the new
nodes filled from their peers) + restore → train on every node; or, where they cannot be (or recovery.replace is
cluster), teardown → provision → verify → stage + restore → train.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, unmapped
from prefect.logging.loggers import flow_run_logger
from prefect.runtime import flow_run as current_flow_run
from prefect.states import Completed, State

from infra.cancel import CANCEL, signals_cancel
from infra.compute.catalog import load_catalog
from infra.compute.providers import Cluster, Node
from infra.dataset.snapshot import snapshot_digest
from infra.job.environment import training_environment
from infra.job.plan import Plan, cluster_name_for
from infra.job.spec import JobSpec
from infra.job.summary import LAUNCHED_AT_VAR, RunSummary
from infra.lifecycle.hang import Hung
from infra.lifecycle.preemption_watch import Preempted
from infra.lifecycle.recovery import RECOVERY_PHASES, Recoveries, RecoveryRecord, narrowed
from infra.workspace import run_dir
from tasks import fanout
from tasks.capacity import nodes_held
from tasks.checkpoint import latest_committed_step, verify_committed_checkpoint
from tasks.cluster import provision_cluster, refuse_if_owned, teardown_cluster
from tasks.evaluate import Evaluation, evaluate_checkpoint
from tasks.node_output import start_loss_curve
from tasks.plan import plan_run
from tasks.promote import Decision, promote_checkpoint
from tasks.replace import Replaced, rejoin_node, replace_or_relaunch
from tasks.report import (
    publish_summary,
    record_failure,
    record_inputs,
    record_launch,
    record_resume,
    record_training,
    record_workload,
    restore_sources,
)
from tasks.results import Restored, Staged, StagedNode
from tasks.stage import restore_checkpoint, stage_node
from tasks.tracking import close_run, mirror_promotion, open_run, record_artifacts, tag_launch
from tasks.train import TrainLaunch, TrainOutcome, run_training
from tasks.verify import bench_cluster, check_training_env, verify_node
from tasks.workload import NodeReady, agreed_code_hash, agreed_image_digest, prepare_node, publish_code


def default_run_id(job_name: str, flow_run_id: str) -> str:
    return f"{job_name}-{flow_run_id.replace('-', '')[:10]}"


def teardown_on_crash(flow: Any, flow_run: Any, state: State[Any]) -> None:
    """Cancellation and crash skip the flow's finally; this hook tears the cluster down from the parameters alone."""
    if state.is_cancelled() or state.is_cancelling():
        CANCEL.cancel(f"Prefect cancelled flow run {flow_run.id}")  # what may still wait in this process stops
    job = JobSpec.model_validate(flow_run.parameters["job"])
    run_id = flow_run.parameters.get("run_id") or default_run_id(job.name, str(flow_run.id))
    flow_run_logger(flow_run, flow).warning("run %s ended %s: tearing down its cluster", run_id, state.type.value)
    teardown_cluster.fn(job.cluster.provider, cluster_name_for(run_id))


@flow(name="retrain", on_cancellation=[teardown_on_crash], on_crashed=[teardown_on_crash], log_prints=True)
def retrain(job: JobSpec, run_id: str | None = None) -> Any:
    """Run one retraining job to a committed (evaluated, promoted if better) checkpoint, and leave nothing running.

    The run ends Completed with its summary as the result; with promote, the state is named Promoted or Kept
    champion and its message says why."""
    CANCEL.reset()  # a process that runs flows one after another (tests, `serve`): this run starts uncancelled
    # SIGTERM (a Prefect cancel among them) and SIGINT (Ctrl-C) cancel the token every wait below checks, then unwind
    # this thread as Prefect does; a second one skips the checkpoint flush. Its nodes count against the global node
    # limit for the whole run, so runs together never exceed it.
    with signals_cancel(), nodes_held(job.cluster.nodes):
        summary = run_job(job, run_id or default_run_id(job.name, str(current_flow_run.id)))
    gate = summary.get("promotion")
    if not gate:
        return summary
    return Completed(name="Promoted" if gate["promoted"] else "Kept champion",
                     message=f"{gate['model']}@{gate['alias']}: {gate['reason']}", data=summary)


def run_job(job: JobSpec, run_id: str) -> dict[str, Any]:
    cluster_name = cluster_name_for(run_id)
    refuse_if_owned(job, cluster_name)  # another live run of this id: touch nothing, write no summary over its own
    summary = RunSummary(run_id=run_id, job=job.name, provider=job.cluster.provider, nodes=job.cluster.nodes,
                         started_at=launched_at())
    recoveries = Recoveries(job.recovery)
    checkpoint_url: str | None = None  # known once planned: a failed or cancelled run names its latest commit
    start_loss_curve(run_id)
    phase = Phases(summary)  # the run's own phases; a recovery's are timed into its record too

    def own_teardown() -> int:
        # The run's own teardown (no recovery's time to resume), which a second Ctrl-C does not interrupt.
        with CANCEL.shield(), phase("teardown"):
            return teardown_cluster(job.cluster.provider, cluster_name)

    def recorded(exc: BaseException) -> None:
        record_failure(summary, exc, checkpoint_url, cancelled=CANCEL.reason if CANCEL.cancelled else None)

    with run_closed(summary, own_teardown, recorded, recoveries, run_dir(run_id)):
        with phase("plan"):
            plan: Plan = plan_run(job, run_id)
            checkpoint_url = plan.checkpoint_url
            code_url = publish_code(job, plan)
        open_run(job, run_id, summary)  # the MLflow run, continued where this run id has one (tracking only)
        summary.dataset = plan.dataset.summary()
        resume_step, recovery, replaced = plan.resume_step, None, None
        while True:
            try:
                cluster, staged, outcome, launch = train_on_a_cluster(job, plan, code_url, summary, cluster_name,
                                                                      resume_step, recovery, replaced)
                _trained(summary, recovery, outcome.first_step_at, outcome.steps_s)
                break
            except Preempted as preempted:
                _trained(summary, recovery, preempted.first_step_at, preempted.steps_s)
                recovery = recoveries.begin(preempted.nodes, preempted.reason, preempted.with_notice,
                                            preempted.step_reached, preempted.detected_at,
                                            hung=isinstance(preempted, Hung))
                resume_step = latest_committed_step(plan.checkpoint_url)
                # Only the lost nodes replaced, the survivors kept as they are ...
                with Phases(summary, recovery)("provision"):
                    replaced = replace_or_relaunch(job, preempted, recovery)
                if replaced is None:
                    # ... or the whole cluster: tear down what is left, launch again (elsewhere, by the failover).
                    with Phases(summary, recovery)("teardown"):
                        teardown_cluster.with_options(task_run_name=f"recovery-{recovery.number}: teardown after "
                                                      f"{preempted}")(job.cluster.provider, cluster_name,
                                                                      keep_data=True)
                    job = _avoiding(job, plan, recoveries, summary.attempts)
        with phase("sync"):
            verified = verify_committed_checkpoint(cluster, plan.checkpoint_url, job.checkpoints.format,
                                                   secrets=job.training.secrets, storage=job.storage)
        record_training(summary, staged, outcome, verified, plan.checkpoint_url)
        # The clock's last step: a script whose progress comes from its log lines has no point times of its own.
        evaluate_and_promote(job, plan, cluster, launch, verified.step, summary, phase, outcome.last_step_at)
        summary.status = "completed"
    return summary.to_dict()


@contextmanager
def run_closed(summary: RunSummary, teardown: Callable[[], int], record: Callable[[BaseException], None],
               recoveries: Recoveries, directory: Path) -> Iterator[None]:
    """Around a run: whatever happened, the cluster torn down, then its failure recorded and the summary published.

    The failure is recorded after the teardown: until the nodes are gone their syncers may still commit (a second
    Ctrl-C skips the flush, not the syncers already uploading), and the summary names the latest commit that exists
    once nothing can add another. A teardown that fails (after its own retries) is logged and recorded in the
    summary, and the summary is published all the same. It is raised only when the run itself succeeded (nodes may be
    left: the run has not); when the run failed, the run's own error is the one raised, not hidden behind the
    teardown's."""
    failure: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        failure = exc
        CANCEL.interrupted(exc)  # a SIGTERM (Prefect's TerminationSignal) is a cancel: the status says so
        raise
    finally:
        teardown_error: Exception | None = None
        try:
            summary.nodes_left = teardown()
        except Exception as exc:
            teardown_error = exc
            summary.teardown_error = f"{type(exc).__name__}: {exc}"
            get_run_logger().error("teardown of run %s failed: %s: `trainpipe status` shows what is left, `trainpipe "
                                   "down` ends it", summary.run_id, summary.teardown_error)
        if failure is not None or teardown_error is not None:
            record(failure or teardown_error)
        summary.recoveries = [r.to_dict() for r in recoveries.records]
        summary.finish()  # the cost and phases the MLflow run ends with (publish_summary stamps the end again)
        close_run(summary)
        publish_summary(summary, directory)
        record_artifacts(summary, directory)
        if teardown_error is not None and failure is None:
            raise teardown_error


def train_on_a_cluster(job: JobSpec, plan: Plan, code_url: str | None, summary: RunSummary, cluster_name: str,
                       resume_step: int | None, recovery: RecoveryRecord | None, replaced: Replaced | None = None
                       ) -> tuple[Cluster, list[Staged], TrainOutcome, TrainLaunch]:
    """provision → verify → stage (+ code, setup, restore) → train, once; a recovery records how long each step
    took it.

    replaced: the cluster of a replace-one recovery instead of a new one. Only its new nodes are verified and get the
    code and the setup; the survivors rejoin as they are (the cluster bench is not rerun); every node stages (the
    survivors' caches make theirs a no-op) and restores."""
    phase = Phases(summary, recovery)
    if replaced is None:
        with phase("provision"):
            cluster = provision_cluster(job, cluster_name, summary.run_id)
        record_launch(summary, cluster)
    else:
        cluster = replaced.cluster
    new = [node for node in cluster.nodes if replaced is None or replaced.is_new(node)]
    survivors = [node for node in cluster.nodes if node not in new]
    attempt = recovery.number if recovery is not None else 0
    with phase("verify"):
        ports = verify_nodes(job, plan, cluster, new, survivors, attempt, resume_step, summary)
    launch = TrainLaunch(plan.checkpoint_url, plan.dataset_url, ports[cluster.head.name], plan.workload.config_hash,
                         attempt=attempt, attempt_id=f"{attempt}-{uuid.uuid4().hex[:8]}")
    with phase("stage"):
        nodes = stage_nodes(job, plan, cluster, code_url, launch, new, survivors, resume_step, summary, phase)
    record_nodes(summary, plan, cluster, recovery, nodes)
    with phase("train"):
        resume_from = {node.name: r.path for node, r in zip(cluster.nodes, nodes.restored, strict=False)}
        init_from = {node.name: w.path for node, w in zip(cluster.nodes, nodes.warm, strict=False)}
        launch = replace(launch, resume_from=resume_from, init_from=init_from,
                         lineage=lineage_of(plan, cluster, summary, launch.attempt_id))
        tag_launch(summary.run_id, launch.lineage, summary, attempt)
        outcome = run_training(job, cluster, launch)
    return cluster, nodes.staged, outcome, launch


def verify_nodes(job: JobSpec, plan: Plan, cluster: Cluster, new: list[Node], survivors: list[Node], attempt: int,
                 resume_step: int | None, summary: RunSummary) -> dict[str, int]:
    """The new nodes probed (room, a free port), the survivors rejoined, and a new cluster benched: the port each
    node's trainer listens on, by node name."""
    # Remote access reads every batch from the store: nothing is staged, so nodes need no room for the dataset.
    staging = job.dataset.access == "staged"
    # Each node needs room for what it will hold (split: its share, not the whole dataset): its disk budget (the
    # checkpoints and replicas beside the data), which plan could hold only against the disks it knows.
    need_bytes = [(plan.dataset.node_bytes[node.rank] if staging else 0) + plan.inputs_bytes for node in new]
    budgets = [plan.disk[node.rank] if plan.disk else None for node in new]
    probing = verify_node.map(unmapped(cluster), new, [budget.total if budget else need
                                                       for budget, need in zip(budgets, need_bytes, strict=True)],
                              [budget.render() if budget else None for budget in budgets])
    # The training environment of every new node has torch (checked in it, beside the probe): nothing installed.
    checking = check_training_env.map(unmapped(job), unmapped(cluster), new)
    rejoined = (rejoin_node.map(unmapped(cluster), survivors, unmapped(attempt),
                                unmapped(resume_step is None)).result() if survivors else [])
    ports = {node.name: port for node, port in zip(survivors, rejoined, strict=True)}
    ports.update({node.name: probe.free_port for node, probe in zip(new, probing.result(), strict=True)})
    record_training_env(summary, job, cluster, {node.name: found for node, found in zip(new, checking.result(),
                                                                                        strict=True)})
    if not survivors:
        summary.cluster_bench = bench_cluster(job, cluster)
    return ports


@dataclass(frozen=True)
class NodesReady:
    """What the stage phase left on the nodes: each node's staging, checkpoint restore and warm start (in rank order;
    empty where there were none), and each new node's code and setup."""

    staged_nodes: list[StagedNode]
    restored: list[Restored]
    warm: list[Restored]
    ready: list[NodeReady]

    @property
    def staged(self) -> list[Staged]:
        return [s.dataset for s in self.staged_nodes if s.dataset is not None]


def stage_nodes(job: JobSpec, plan: Plan, cluster: Cluster, code_url: str | None, launch: TrainLaunch,
                new: list[Node], survivors: list[Node], resume_step: int | None, summary: RunSummary,
                phase: Phases) -> NodesReady:
    """The code and the setup on the new nodes, beside the dataset and the inputs on every node, then the checkpoint
    (a resume's or a warm start's); through the peers' servers when the cluster fans out."""
    staging = job.dataset.access == "staged"
    inputs = {name: input_plan.snapshot_url for name, input_plan in plan.inputs.items()}
    fan, why = fanout.decide(job.dataset.fanout, len(cluster.nodes), summary.cluster_bench,
                             [plan.dataset_url, *(i.url for i in plan.inputs.values())])
    summary.dataset["fanout"] = {"on": fan, "why": why}
    get_run_logger().info("fan-out staging: %s", why)
    # The peers serve the code archive (when its sha256 is known), the dataset's and the inputs' shares, then the
    # checkpoint's files a resume restores; they stay up until every node holds its code.
    sharing_code = code_url is not None and plan.workload.code_sha256 is not None
    exchanging = fan and (staging or bool(inputs) or resume_step is not None or sharing_code)
    # Pruned after the stage, the share dirs keep the code archive: a later replacement takes it from the survivors.
    keep = [fanout.code_share(plan.workload.code_sha256)] if sharing_code else []
    with (fanout.peer_servers(cluster, keep=keep) if exchanging else nullcontext(([], None))) as peers:
        # The code and the setup go their own way beside the dataset: neither waits for the other. Survivors
        # have theirs (and serve the archive from their share dirs still).
        preparing = prepare_node.map(unmapped(job), unmapped(cluster), new, unmapped(code_url),
                                     unmapped(plan.workload.code_sha256), unmapped(launch),
                                     peers=unmapped(peers[0]), peer_env=unmapped(peers[1]))
        with phase.recovery_part("stage"):
            # The dataset and the inputs one after the other on each node, through its one cache.
            nodes_staged = (stage_node.map(unmapped(cluster), cluster.nodes,
                                           unmapped(plan.dataset.snapshot_url if staging else None),
                                           unmapped(plan.dataset.shard), unmapped(inputs),
                                           peers=unmapped(peers[0]), peer_env=unmapped(peers[1]),
                                           holders=unmapped([node.rank for node in survivors]),
                                           secrets=unmapped(job.training.secrets),
                                           storage=unmapped(job.storage)).result()
                            if staging or inputs else [])
        restored, warm = restore_nodes(job, plan, cluster, survivors, resume_step, peers, phase)
        summary.fanout = fanout.outcome(fan, why, exchanging, peers[0], nodes_staged, restored)
        get_run_logger().info("fanout: %s", summary.fanout)
        return NodesReady(nodes_staged, restored, warm, preparing.result())


def restore_nodes(job: JobSpec, plan: Plan, cluster: Cluster, survivors: list[Node], resume_step: int | None,
                  peers: tuple[list[str], dict[str, str] | None], phase: Phases
                  ) -> tuple[list[Restored], list[Restored]]:
    """Every node's copy of the run's latest commit (a resume), and of the checkpoint a warm start begins from."""
    with phase.recovery_part("restore"):
        # A survivor's saves newer than the commit are dropped (prune): never committed, and misleading.
        restored = (restore_checkpoint.map(unmapped(cluster), cluster.nodes, unmapped(plan.checkpoint_url),
                                           unmapped(job.checkpoints.format), peers=unmapped(peers[0]),
                                           peer_env=unmapped(peers[1]),
                                           prune=unmapped(bool(survivors)),
                                           holders=unmapped([node.rank for node in survivors]),
                                           secrets=unmapped(job.training.secrets),
                                           storage=unmapped(job.storage)).result()
                    if resume_step is not None else [])
    # A warm start: only when nothing of this run is committed yet (a resume continues from its own commit).
    warm = (restore_checkpoint.map(unmapped(cluster), cluster.nodes, unmapped(plan.init_from.run_url),
                                   unmapped(job.checkpoints.format), step=unmapped(plan.init_from.step),
                                   dest=[node.path("init-from") for node in cluster.nodes],
                                   secrets=unmapped(job.training.secrets),
                                           storage=unmapped(job.storage)).result()
            if plan.init_from is not None and resume_step is None else [])
    return restored, warm


def record_nodes(summary: RunSummary, plan: Plan, cluster: Cluster, recovery: RecoveryRecord | None,
                 nodes: NodesReady) -> None:
    """What the stage phase did, into the summary (warm start, code, inputs, resume) and a recovery's record (the
    bytes it reused and restored)."""
    if nodes.warm:
        summary.init_from = plan.init_from.url if plan.init_from is not None else None
    record_workload(summary, plan, nodes.ready, agreed_code_hash(nodes.ready))
    digest = agreed_image_digest(nodes.ready)
    if digest is not None:  # new nodes pulled the image (a replace-one's survivors hold theirs) and checked it
        summary.training_env.update(digest=digest, pull_s=max(r.pull_s for r in nodes.ready))
        summary.training_env.setdefault("nodes", {}).update({r.node: r.environment for r in nodes.ready
                                                             if r.environment})
    record_inputs(summary, plan, nodes.staged_nodes)
    if nodes.restored:
        record_resume(summary, nodes.restored, initial=recovery is None)
    if recovery is not None:
        recovery.reused_bytes = sum(s.skipped_bytes for s in nodes.staged) + sum(
            i.skipped_bytes for n in nodes.staged_nodes for i in n.inputs.values())
        recovery.restore_bytes = restore_sources(nodes.restored)
        recovery.resumed(nodes.restored[0].step if nodes.restored else None, cluster.price_per_hour)


def record_training_env(summary: RunSummary, job: JobSpec, cluster: Cluster, found: dict[str, dict[str, str]]) -> None:
    """Where the training runs (the summary's training_env): kind, image, python, and what verify found per node."""
    environment = training_environment(job, cluster, cluster.head)
    summary.training_env = {"kind": environment.kind.value, "image": environment.image,
                            "python": environment.python, **{k: v for k, v in summary.training_env.items()
                                                             if k in ("digest", "pull_s")},
                            "nodes": {**summary.training_env.get("nodes", {}),
                                      **{name: facts for name, facts in found.items() if facts}}}


def lineage_of(plan: Plan, cluster: Cluster, summary: RunSummary, attempt_id: str) -> dict[str, Any]:
    """Where this run's checkpoints come from (infra.checkpoints.lineage.Lineage): every manifest records it."""
    return {
        "run_id": plan.run_id, "attempt": attempt_id,
        "dataset": {"url": plan.dataset.url, "snapshot_digest": snapshot_digest(plan.dataset.snapshot)},
        "inputs": {name: {"url": prefix.url, "snapshot_digest": snapshot_digest(prefix.snapshot)}
                   for name, prefix in plan.inputs.items()},
        "code_sha256": plan.workload.code_sha256, "config_hash": plan.workload.config_hash,
        "parent": plan.init_from.url if plan.init_from is not None else None,
        "cluster": {"provider": cluster.provider, "instance_type": cluster.instance_type, "nodes": len(cluster.nodes),
                    "network_gbps": summary.cluster_bench.slowest_link_gbps if summary.cluster_bench else None},
        "environment": environment_lineage(summary.training_env),
    }


def environment_lineage(env: dict[str, Any]) -> dict[str, Any] | None:
    """The training environment as a manifest's lineage records it (infra.checkpoints.lineage.LineageEnvironment)."""
    if not env:
        return None
    torches = sorted({node["torch"] for node in env.get("nodes", {}).values()})
    return {"kind": env["kind"], "image": env.get("image"), "digest": env.get("digest"), "python": env.get("python"),
            "torch": ", ".join(torches) or None}


def evaluate_and_promote(job: JobSpec, plan: Plan, cluster: Cluster, launch: TrainLaunch, step: int,
                         summary: RunSummary, phase: Phases, last_step_at: float | None) -> Decision | None:
    """The gate after the final commit, on the cluster still up: evaluate the committed step, then move the alias
    only if it beats the champion. A failure here fails the run; the checkpoint stays committed."""
    if job.evaluate is None:
        return None
    with phase("evaluate"):
        evaluation: Evaluation = evaluate_checkpoint(job, cluster, launch, step)
    summary.eval = evaluation.to_dict()
    if job.promote is None:
        return None
    with phase("promote"):
        decision = promote_checkpoint(job.promote, evaluation, job.checkpoints.url, plan.run_id)
    summary.promotion = {**decision.to_dict(), "decided_after_training_s":
                         round(time.time() - last_step_at, 3) if last_step_at is not None else None}
    mirror_promotion(job, plan.run_id, decision.promoted, decision.model, decision.alias, summary)
    return decision


def launched_at() -> float:
    """When the command that launched this run started (it says so in TRAINPIPE_LAUNCHED_AT), else now: the run's
    overhead counts the command's own start and the Prefect server's too."""
    value = os.environ.get(LAUNCHED_AT_VAR)
    now = time.time()
    try:
        return min(now, float(value)) if value else now
    except ValueError:
        return now


def _trained(summary: RunSummary, recovery: RecoveryRecord | None, first_step_at: float | None,
             steps_s: float) -> None:
    summary.trained(first_step_at, steps_s)
    if recovery is not None:
        recovery.first_step(first_step_at)


@dataclass(frozen=True)
class Phases:
    """One context manager per pipeline phase: `with phase("verify"):` times it into the run summary and, within a
    recovery, into the recovery's record too, so its time to resume can be split by phase.

    The stage phase is the exception: the summary times it whole (code, setup, dataset and restore side by side),
    while a recovery splits it into the dataset's staging and the checkpoint's restore (recovery_part)."""

    summary: RunSummary
    recovery: RecoveryRecord | None = None

    def __call__(self, name: str) -> AbstractContextManager[None]:
        stack = ExitStack()
        stack.enter_context(self.summary.phase(name))
        if name in _WHOLE_IN_RECOVERY:
            stack.enter_context(self.recovery_part(name))
        return stack

    def recovery_part(self, name: str) -> AbstractContextManager[None]:
        """A part of a phase only a recovery times on its own (the summary's phase around it times it whole)."""
        return self.recovery.phase(name) if self.recovery is not None else nullcontext()


# The phases a recovery times exactly as the summary does; its stage and restore are parts of the summary's stage.
_WHOLE_IN_RECOVERY = tuple(name for name in RECOVERY_PHASES if name not in ("stage", "restore"))


def _avoiding(job: JobSpec, plan: Plan, recoveries: Recoveries, attempts: list[dict[str, Any]]) -> JobSpec:
    """The job with the failover policy applied: where the preempted cluster ran may be blocked for the next."""
    if not plan.candidates:
        return job  # local and ssh: the same machines again
    launched = next((a for a in reversed(attempts) if a["outcome"] == "launched"), None)
    if launched is not None:
        recoveries.block(launched["region"], launched["zone"])
    cluster = narrowed(job.cluster, load_catalog(), recoveries.blocked)
    return job.model_copy(update={"cluster": cluster})
