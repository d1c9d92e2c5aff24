"""Train: the job's command under torchrun on every node, with a checkpoint syncer beside it, until all nodes finish
or one fails."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger, task

from infra.cancel import CANCEL
from infra.checkpoints.lineage import Lineage
from infra.compute.access.agent import NodeAgent
from infra.compute.access.remote import Process, RemoteError, Runner, stop_all, wait_all
from infra.compute.providers import Cluster, Node, provider_of
from infra.job.environment import training_environment
from infra.job.spec import JobSpec
from infra.lifecycle.preemption_watch import Preempted, PreemptionWatch, TrainingError
from infra.node.events import Event, NodeEvent
from infra.node.protocol import SyncRequest, TorchrunRequest
from infra.node.sync import STOP_FILE
from infra.workload.contract import NodeContext, input_dir, render_command
from infra.workload.progress import Point
from tasks.chaos import arm_chaos
from tasks.fanout import peer_credentials, replica_fields
from tasks.hang import HangCheck
from tasks.node_output import TrainingProgress, node_line_sink
from tasks.policy import NO_RETRIES
from tasks.results import CheckpointSave, Committed, Uploaded, checkpoint_saves, sync_results
from tasks.secrets import job_secrets
from tasks.syncers import STOP_GRACE_S, Syncers
from tasks.tracking import node_tracking_env, record_sink, tracking_secret_names, tracking_secrets

# Beyond the flush deadline: the script's own exit (process group teardown, torchrun's agent shutting down).
TRAINER_EXIT_GRACE_S = 10.0
# The node's launcher ends every rank (SIGKILL included) this long after the flush deadline: within the trainer's
# bound above, so a rank hung at exit is gone before the trainer is killed from here, never left behind it.
LAUNCHER_EXIT_GRACE_S = TRAINER_EXIT_GRACE_S / 2
STRAGGLER_GRACE_S = 10.0  # a rank hung at exit after its node's work is saved: SIGKILL after this
METRICS_POLL_S = 1.0
DISK_FULL_REPORT_S = 5.0  # a syncer's round (checkpoints.sync_poll_s) and its event's way here
FAILURE_LINES = 12  # of the failed command's output, in the error that ends the run
# torchrun's own report of a failed worker follows the worker's traceback: the script's lines are the ones above it.
_TORCHRUN_REPORT = ("] failed (exitcode:", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
                    "Root Cause (first observed")


@dataclass(frozen=True)
class TrainLaunch:
    """What the flow decided before training: where to meet, what to resume from, which attempt this is."""

    checkpoint_url: str
    dataset_url: str
    rendezvous_port: int
    config_hash: str
    attempt: int = 0  # 0 for the run's first launch, one more per recovery (TRAINPIPE_ATTEMPT)
    attempt_id: str = ""  # unique per launch, reruns included: commits take only this attempt's records
    resume_from: dict[str, str] = field(default_factory=dict)  # node name → restored checkpoint on that node
    init_from: dict[str, str] = field(default_factory=dict)  # node name → training.init_from restored on that node
    lineage: dict[str, Any] | None = None  # a Lineage: the syncers record it in every manifest they commit


@dataclass
class TrainOutcome:
    points: list[Point]
    facts: dict[str, Any]
    checkpoint_events: list[CheckpointSave]  # the script's (trainer.checkpoint's) saves
    sync_events: list[Uploaded | Committed]  # the syncers' uploads and commits
    seconds: float
    first_step_at: float | None  # unix time the first step ended
    steps_s: float  # the training steps' own time
    last_step_at: float | None = None  # unix time the last logged step ended (or its line arrived)
    warnings: list[str] = field(default_factory=list)  # e.g. a node whose ranks hung at exit and were stopped


def node_context(job: JobSpec, cluster: Cluster, node: Node, launch: TrainLaunch) -> NodeContext:
    return NodeContext(
        data_dir=node.data_dir, data_url=launch.dataset_url, data_shards=node.path("data-files.txt"),
        checkpoint_dir=node.ckpt_dir, resume_from=launch.resume_from.get(node.name, ""),
        init_from=launch.init_from.get(node.name, ""),
        metrics_file=node.metrics_file, run_id=cluster.run_id, attempt=launch.attempt, node_rank=node.rank,
        num_nodes=len(cluster.nodes), node_ips=tuple(n.cluster_address for n in cluster.nodes), sync_dir=node.sync_dir,
        inputs={name: input_dir(node.workdir, name) for name in job.inputs})


# PYTHONFAULTHANDLER: a rank's stacks on SIGABRT (and on a crash), which a hang's dump asks for (infra/node/stacks.py).
_FIXED_VARS = ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER")


def workload_env(job: JobSpec, context: NodeContext) -> dict[str, str]:
    """Everything the script's processes (and the setup commands) get in their environment; the job's secrets are
    resolved here, as each node command starts, and kept nowhere else."""
    fixed = dict(zip(_FIXED_VARS, (str(job.training.threads_per_proc), "1", "1"), strict=True))
    return {**fixed, **job.training.env, **job_secrets(job), **node_tracking_env(job, context.run_id),
            **tracking_secrets(job), **context.environment()}


def workload_env_names(job: JobSpec, context: NodeContext, *more: str) -> tuple[str, ...]:
    """The names of workload_env's variables (no secret resolved): what a container's env file carries."""
    return tuple(sorted({*_FIXED_VARS, *job.training.env, *job.training.secrets, *context.environment(),
                         *node_tracking_env(job, context.run_id), *tracking_secret_names(job), *more}))


def torchrun_request(job: JobSpec, cluster: Cluster, node: Node, launch: TrainLaunch) -> TorchrunRequest:
    """torchrun in the job's training environment on this node, plus an event once every rank of the node exited 0
    (see infra.node.torchrun)."""
    context = node_context(job, cluster, node, launch)
    return TorchrunRequest(
        training_env=training_environment(job, cluster, node), env_names=workload_env_names(job, context),
        nnodes=len(cluster.nodes), nproc_per_node=job.cluster.procs_per_node, node_rank=node.rank,
        master_addr=cluster.head.cluster_address, master_port=launch.rendezvous_port, max_restarts=0,
        stop_grace_s=job.checkpoints.flush_deadline_s + LAUNCHER_EXIT_GRACE_S,
        script=tuple(render_command(job.training.command, context)))


def syncer_request(job: JobSpec, cluster: Cluster, node: Node, launch: TrainLaunch) -> SyncRequest:
    checkpoints = job.checkpoints
    return SyncRequest(
        ckpt_dir=node.ckpt_dir, sync_dir=node.sync_dir, url=launch.checkpoint_url, node_rank=node.rank,
        nodes=len(cluster.nodes), procs_per_node=job.cluster.procs_per_node, attempt=launch.attempt_id,
        config_hash=launch.config_hash, keep=checkpoints.keep, format=checkpoints.format,
        flush_deadline_s=checkpoints.flush_deadline_s, poll_s=checkpoints.sync_poll_s,
        stop_file=f"{node.sync_dir}/{STOP_FILE}", metrics_file=node.metrics_file,
        store_outage_s=checkpoints.store_outage_s, commit_timeout_s=checkpoints.final_upload_timeout_s,
        # The registry `model promote` and the promote section move aliases in: retention keeps what they name.
        registry_url=checkpoints.url,
        lineage=lineage_path(node) if launch.lineage is not None else None,
        **(replica_fields(node) if job.peer_replica else {}),
    )


def syncer_env(job: JobSpec) -> dict[str, str]:
    """The syncers' environment: the job's secrets (store credentials given as secrets among them), resolved here as
    the syncers start, and the peer replicas' credentials (the same on every restart)."""
    return {**job_secrets(job), **(peer_credentials() if job.peer_replica else {})}


def lineage_path(node: Node) -> str:
    return node.path("lineage.json")


def write_lineage(runner: Runner, node: Node, launch: TrainLaunch) -> None:
    """The launch's lineage on the node, for its syncer (checked here: a bad one fails before training starts)."""
    if launch.lineage is not None:
        runner.write_text(lineage_path(node), Lineage.model_validate(launch.lineage).model_dump_json())


def failure_tail(process: Process, lines: int = FAILURE_LINES) -> str:
    """The command's own last lines (above torchrun's report of the failure): what tells the user what broke."""
    kept = [line.rstrip() for line in process.tail(400).splitlines() if line.strip()]
    cut = next((i for i, line in enumerate(kept) if any(mark in line for mark in _TORCHRUN_REPORT)), len(kept))
    own = kept[:cut] or kept
    # A worker's traceback ends the script's own output; the torchrun agent's warnings around it are noise.
    own = [line for line in own if "torch.distributed.elastic" not in line] or own
    return "\n".join(f"    {line}" for line in own[-lines:]) or "    (no output)"


class _ExitGrace:
    """Asked each round of the wait: True once some node's ranks all exited 0 and the rest have had exit_grace_s
    since every announced checkpoint was committed (their work is saved; what they still do is exiting).

    torchrun's agent of a node whose ranks are done waits for the others in its exit barrier: its RANKS_EXITED event,
    not its exit, says that node is done."""

    def __init__(self, syncers: Syncers, nodes: int, grace_s: float) -> None:
        self.syncers, self.nodes, self.grace_s = syncers, nodes, grace_s
        self.done: set[str] = set()  # nodes whose ranks all exited 0
        self.since: float | None = None
        self.step: int | None = None

    def on_event(self, node: str) -> Callable[[Event], None]:
        def record(event: Event) -> None:
            if event.kind is NodeEvent.RANKS_EXITED:
                self.done.add(node)
        return record

    def __call__(self, pending: list[str]) -> bool:
        step = self.syncers.newest_settled()
        some_done = len(pending) < self.nodes or bool(self.done)
        if not some_done or step is None or step != self.step:
            # Nothing done or committed yet, or a newer checkpoint since: the grace starts (again) from this commit.
            self.since, self.step = (time.monotonic(), step) if some_done and step is not None else (None, None)
            return False
        return self.since is not None and time.monotonic() - self.since >= self.grace_s

    def hung(self, pending: list[str]) -> list[str]:
        """Of the nodes still running at the end of the grace, those whose ranks never said they exited."""
        return [name for name in pending if name not in self.done]


def _wait_all(trainers: dict[str, Process], deadline: float, watch: PreemptionWatch, syncers: Syncers,
              poll: Any, exit_grace: _ExitGrace, hang: HangCheck) -> list[str]:
    """Wait for every trainer; the first failure, a dead syncer that cannot be restarted, a preemption, a hang or
    the deadline stops the rest and raises. Returns the nodes whose ranks still ran exit_grace_s after another
    node's all exited 0 with the newest checkpoint committed."""
    def each_round() -> None:
        watch.reading(poll.runner.node_name, poll)  # the head gone without notice is the watch's call, not a failure
        watch.poll()
        try:
            syncers.poll(going=watch.noticed_now)
        except TrainingError as error:
            raise watch.explain(error) from None  # a syncer on a preempted node dies with it
        hang()

    def failed(name: str, code: int, process: Process) -> TrainingError:
        tail = failure_tail(process)
        failure = watch.explain(TrainingError(f"{name}: training exited {code}; its last output:\n{tail}"))
        if isinstance(failure, Preempted):
            return failure
        # A script that failed on a full disk: the node, the path and the bytes free say more than its traceback.
        # Its syncer says so within a round of its own; waited for only when the script says it ran out of space.
        full = syncers.disk_full(wait_s=DISK_FULL_REPORT_S if os.strerror(errno.ENOSPC) in tail else 0.0)
        return failure if full is None else TrainingError(f"{full}; {name}'s last output:\n{tail}")

    return wait_all(
        trainers, deadline, poll=each_round, stragglers=exit_grace, failed=failed,
        overdue=lambda pending: TrainingError(
            f"training still running after training.timeout_s on {', '.join(pending)}: "
            "raise training.timeout_s or check the nodes' logs"))


def _hung_at_exit(job: JobSpec, cluster: Cluster, names: list[str], step: int | None) -> str:
    nodes = [node for node in cluster.nodes if node.name in names]
    ranks = ", ".join(f"{node.name} (global ranks {node.rank * job.cluster.procs_per_node}-"
                      f"{(node.rank + 1) * job.cluster.procs_per_node - 1})" for node in nodes)
    return (f"{ranks} still running {job.training.exit_grace_s:g}s (training.exit_grace_s) after another node's "
            f"ranks all exited 0 with step {step} committed: stopped; the run completes. Check the script's exit "
            "(a rank that hangs at exit)")


class _MetricsPoll:
    """Reads the head node's metrics file every METRICS_POLL_S from the wait loop."""

    def __init__(self, progress: TrainingProgress, runner: Runner, path: str) -> None:
        self.progress, self.runner, self.path = progress, runner, path
        self._next = 0.0

    def __call__(self, force: bool = False) -> None:
        if not force and time.monotonic() < self._next:
            return
        self._next = time.monotonic() + METRICS_POLL_S
        self.progress.poll_metrics(self.runner, self.path)


@task(name="train", **NO_RETRIES)
def run_training(job: JobSpec, cluster: Cluster, launch: TrainLaunch) -> TrainOutcome:
    """Not retried as a task: a preemption is recovered by the flow, any other failure resumes on the next run."""
    logger = get_run_logger()
    progress = TrainingProgress(cluster.run_id)
    progress.on_record = record_sink(cluster.run_id)  # streamed to the run's MLflow run as read (None: untracked)
    provider = provider_of(cluster)
    runners = {node.name: provider.runner(cluster, node) for node in cluster.nodes}
    watch = PreemptionWatch(provider, cluster, runners, progress, job.recovery.confirm_s, logger,
                            job.recovery.control_plane_outage_s)
    metrics = _MetricsPoll(progress, runners[cluster.head.name], cluster.head.metrics_file)
    syncers = Syncers(runners, cluster.nodes, lambda node: syncer_request(job, cluster, node, launch),
                      lambda node, on_event: node_line_sink(logger, f"{node.name} sync", on_event), logger,
                      env=syncer_env(job))
    exit_grace = _ExitGrace(syncers, len(cluster.nodes), job.training.exit_grace_s)
    upload_s = job.checkpoints.final_upload_timeout_s
    started = time.monotonic()
    trainers: dict[str, Process] = {}
    hang = HangCheck(job.training.hang_timeout_s, cluster, runners, trainers, progress, syncers.checkpoints_found,
                     launch.attempt, logger)
    warnings: list[str] = []
    code_dir = {node.name: node.code_dir if job.training.code is not None else None for node in cluster.nodes}
    try:
        for node in cluster.nodes:
            write_lineage(runners[node.name], node, launch)
        syncers.start()
        for node in cluster.nodes:
            env = workload_env(job, node_context(job, cluster, node, launch))
            trainers[node.name] = NodeAgent(runners[node.name], node.python, env).start(
                torchrun_request(job, cluster, node, launch), cwd=code_dir[node.name],
                on_line=node_line_sink(logger, node.name, exit_grace.on_event(node.name),
                                       follow=progress.follow if node == cluster.head else None),
                log_path=node.path("logs", "train.log"))
        arm_chaos(job, launch.attempt, watch)  # tests and drills only: nothing without the job's `chaos:` section
        pending = _wait_all(trainers, started + job.training.timeout_s, watch, syncers, metrics, exit_grace, hang)
        if pending:
            warnings.append(_hung_at_exit(job, cluster, exit_grace.hung(pending), exit_grace.step))
            logger.warning("%s", warnings[-1])
            # The hung ones, and torchrun's agents waiting for them in the exit barrier.
            stop_all({name: trainers[name] for name in pending}, STRAGGLER_GRACE_S)
    except BaseException as failure:
        CANCEL.interrupted(failure)  # a second signal during the flush below then skips it
        watch.disarm()
        # SIGTERM first, to every node at once: each script finishes its save in flight (and a last one if the
        # deadline allows; a collective one needs every rank signalled) ...
        deadline_s = job.checkpoints.flush_deadline_s
        stopping = time.monotonic()
        codes = stop_all(trainers, deadline_s + TRAINER_EXIT_GRACE_S)
        logger.info("trainers stopped: %d in %.1fs (their one bound: %gs), exit codes %s", len(codes),
                    time.monotonic() - stopping, deadline_s + TRAINER_EXIT_GRACE_S, codes)
        # ... then the syncers upload and commit what completed (final_upload_timeout_s, however long the save
        # deadline): committed checkpoints are what the next attempt resumes from. A lost node's part never comes:
        # then only the save deadline, and the others are told not to wait for its part at all.
        lost = failure.lost if isinstance(failure, Preempted) else ()
        timeout_s, grace_s = (deadline_s, 0.0) if lost else (upload_s, STOP_GRACE_S)
        try:
            syncers.stop(timeout_s, grace_s, lost=lost)
        except (TrainingError, RemoteError) as flush_error:
            logger.error("after the training failure, checkpoint flush failed too: %s", flush_error)
        raise
    watch.disarm()  # training is over: nothing more to inject, but a node lost now is still a preemption
    syncers.stop(upload_s, each_round=watch.poll)
    metrics(force=True)
    return TrainOutcome(points=progress.points, facts=progress.facts,
                        checkpoint_events=checkpoint_saves(progress.checkpoint_events),
                        sync_events=sync_results(syncers.events), seconds=time.monotonic() - started,
                        first_step_at=progress.clock.first_step_at, steps_s=progress.clock.steps_s(),
                        last_step_at=progress.clock.last[1] if progress.clock.last is not None else None,
                        warnings=warnings)
