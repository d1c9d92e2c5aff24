"""Train: the job's command under torchrun on every node, with a checkpoint syncer beside it, until all nodes finish
or one fails."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger, task

from infra.checkpoints.lineage import Lineage
from infra.compute.access.remote import Process, RemoteError, Runner, last_error, wait_all
from infra.compute.providers import Cluster, Node, get_provider
from infra.job.spec import JobSpec
from infra.lifecycle.preemption_watch import PreemptionWatch, TrainingError
from infra.node.sync import STOP_FILE
from infra.workload.contract import NodeContext, input_dir, render_command
from infra.workload.progress import Point
from tasks.chaos import arm_chaos
from tasks.node_output import TrainingProgress, node_line_sink
from tasks.policy import NO_RETRIES
from tasks.results import CheckpointSave, Committed, Uploaded, checkpoint_saves, sync_results
from tasks.secrets import job_secrets

SYNC_FLUSH_TIMEOUT_S = 600.0
# Beyond the flush deadline: the script's own exit (process group teardown, torchrun's agent shutting down).
TRAINER_EXIT_GRACE_S = 10.0
METRICS_POLL_S = 1.0
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


def node_context(job: JobSpec, cluster: Cluster, node: Node, launch: TrainLaunch) -> NodeContext:
    return NodeContext(
        data_dir=node.data_dir, data_url=launch.dataset_url, data_shards=node.path("data-files.txt"),
        checkpoint_dir=node.ckpt_dir, resume_from=launch.resume_from.get(node.name, ""),
        init_from=launch.init_from.get(node.name, ""),
        metrics_file=node.metrics_file, run_id=cluster.run_id, attempt=launch.attempt, node_rank=node.rank,
        num_nodes=len(cluster.nodes), node_ips=tuple(n.address for n in cluster.nodes), sync_dir=node.sync_dir,
        inputs={name: input_dir(node.workdir, name) for name in job.inputs})


def workload_env(job: JobSpec, context: NodeContext) -> dict[str, str]:
    """Everything the script's processes (and the setup commands) get in their environment; the job's secrets are
    resolved here, as each node command starts, and kept nowhere else."""
    return {"OMP_NUM_THREADS": str(job.training.threads_per_proc), "PYTHONUNBUFFERED": "1",
            **job.training.env, **job_secrets(job), **context.environment()}


def torchrun_argv(job: JobSpec, cluster: Cluster, node: Node, launch: TrainLaunch) -> list[str]:
    return [
        node.python, "-m", "torch.distributed.run",
        "--nnodes", str(len(cluster.nodes)), "--nproc-per-node", str(job.cluster.procs_per_node),
        "--node-rank", str(node.rank), "--master-addr", cluster.head.address,
        "--master-port", str(launch.rendezvous_port), "--max-restarts", "0",
        # Everything after `--` is the script's: its own options never reach torchrun's parser (where `--run` would
        # be taken for an abbreviation of torchrun's --run-path).
        "--", *render_command(job.training.command, node_context(job, cluster, node, launch)),
    ]


def syncer_argv(job: JobSpec, cluster: Cluster, node: Node, launch: TrainLaunch) -> list[str]:
    return [
        node.python, "-m", "infra.node", "sync", "--ckpt-dir", node.ckpt_dir, "--sync-dir", node.sync_dir,
        "--url", launch.checkpoint_url, "--node-rank", str(node.rank), "--nodes", str(len(cluster.nodes)),
        "--procs-per-node", str(job.cluster.procs_per_node), "--attempt", launch.attempt_id,
        "--config-hash", launch.config_hash, "--keep", str(job.checkpoints.keep),
        "--format", job.checkpoints.format, "--flush-deadline", str(job.checkpoints.flush_deadline_s),
        "--poll", str(job.checkpoints.sync_poll_s), "--stop-file", f"{node.sync_dir}/{STOP_FILE}",
        "--metrics-file", node.metrics_file,
        *(["--lineage", lineage_path(node)] if launch.lineage is not None else []),
    ]


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


def _wait_all(trainers: dict[str, Process], deadline: float, watch: PreemptionWatch,
              poll: Any) -> None:
    """Wait for every trainer; the first failure, a preemption or the deadline stops the rest and raises."""
    def each_round() -> None:
        watch.reading(poll.runner.node_name, poll)  # the head gone without notice is the watch's call, not a failure
        watch.poll()

    wait_all(
        trainers, deadline, poll=each_round,
        failed=lambda name, code, process: watch.explain(
            TrainingError(f"{name}: training exited {code}; its last output:\n{failure_tail(process)}")),
        overdue=lambda pending: TrainingError(
            f"training still running after training.timeout_s on {', '.join(pending)}: "
            "raise training.timeout_s or check the nodes' logs"))


def _last_error(process: Process) -> str:
    return last_error(process, ("sync:", "restore:"))


def _stop_syncers(runners: dict[str, Runner], syncers: dict[str, Process], nodes: tuple[Node, ...],
                  timeout_s: float = SYNC_FLUSH_TIMEOUT_S) -> None:
    """Ask every syncer to flush what is complete and exit; a syncer that fails means checkpoints were not saved."""
    started = [node for node in nodes if node.name in syncers]
    for node in started:
        runners[node.name].write_text(f"{node.sync_dir}/{STOP_FILE}", "stop\n")
    failures = []
    for node in started:
        try:
            code = syncers[node.name].wait(timeout_s)
        except TimeoutError:
            syncers[node.name].terminate()
            failures.append(f"{node.name}: checkpoint syncer did not flush within {timeout_s:.0f}s")
            continue
        if code != 0:
            failures.append(f"{node.name}: checkpoint syncer exited {code}: {_last_error(syncers[node.name])}")
    if failures:
        raise TrainingError("; ".join(failures))


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
    provider = get_provider(cluster.provider)
    runners = {node.name: provider.runner(cluster, node) for node in cluster.nodes}
    watch = PreemptionWatch(provider, cluster, runners, progress, job.recovery.confirm_s, logger)
    metrics = _MetricsPoll(progress, runners[cluster.head.name], cluster.head.metrics_file)
    sync_events: list[dict[str, Any]] = []
    started = time.monotonic()
    syncers: dict[str, Process] = {}
    trainers: dict[str, Process] = {}
    code_dir = {node.name: node.code_dir if job.training.code is not None else None for node in cluster.nodes}
    try:
        for node in cluster.nodes:
            write_lineage(runners[node.name], node, launch)
            syncers[node.name] = runners[node.name].start(
                syncer_argv(job, cluster, node, launch),
                on_line=node_line_sink(logger, f"{node.name} sync", sync_events.append),
                log_path=node.path("logs", "sync.log"))
        for node in cluster.nodes:
            env = workload_env(job, node_context(job, cluster, node, launch))
            trainers[node.name] = runners[node.name].start(
                torchrun_argv(job, cluster, node, launch), env=env, cwd=code_dir[node.name],
                on_line=node_line_sink(logger, node.name, follow=progress.follow if node == cluster.head else None),
                log_path=node.path("logs", "train.log"))
        arm_chaos(job, launch.attempt, watch)  # tests and drills only: nothing without the job's `chaos:` section
        _wait_all(trainers, started + job.training.timeout_s, watch, metrics)
    except BaseException:
        # SIGTERM first: each script finishes its save in flight (and a last one if the deadline allows) ...
        deadline_s = job.checkpoints.flush_deadline_s
        for process in trainers.values():
            process.terminate(grace_s=deadline_s + TRAINER_EXIT_GRACE_S)
        # ... then the syncers flush what completed, within the same deadline: committed checkpoints are what the
        # next attempt resumes from.
        try:
            _stop_syncers(runners, syncers, cluster.nodes, timeout_s=deadline_s)
        except (TrainingError, RemoteError) as flush_error:
            logger.error("after the training failure, checkpoint flush failed too: %s", flush_error)
        raise
    _stop_syncers(runners, syncers, cluster.nodes)
    metrics(force=True)
    return TrainOutcome(points=progress.points, facts=progress.facts,
                        checkpoint_events=checkpoint_saves(progress.checkpoint_events),
                        sync_events=sync_results(sync_events), seconds=time.monotonic() - started,
                        first_step_at=progress.clock.first_step_at, steps_s=progress.clock.steps_s())
