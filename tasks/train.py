"""Train: torchrun on every node, with a checkpoint syncer beside it, until all nodes finish or one fails."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger, task

from infra.providers import Cluster, Node, get_provider
from infra.remote import Process, RemoteError, Runner, last_error, wait_all
from infra.spec import JobSpec
from tasks.node_output import TrainingProgress, node_line_sink
from tasks.policy import NO_RETRIES
from tasks.preemption import PreemptionWatch, TrainingError

STOP_SYNC = ".stop-sync"
SYNC_FLUSH_TIMEOUT_S = 600.0
# Beyond the flush deadline: the trainer's own exit (process group teardown, torchrun's agent shutting down).
TRAINER_EXIT_GRACE_S = 10.0
# Checkpoint mode direct blocks training until the syncer has uploaded each step, so its scan interval would be paid
# on every checkpoint: the default (half a second) is fine for a syncer working in the background, not here.
DIRECT_SYNC_POLL_S = 0.05


@dataclass(frozen=True)
class TrainLaunch:
    """What the flow decided before training: where to meet, where to resume from."""

    checkpoint_url: str
    rendezvous_port: int
    resume_dirs: dict[str, str] = field(default_factory=dict)  # node name → local step dir
    dataset_url: str | None = None  # read in place by the trainer (dataset.access remote); None: the staged copy


@dataclass
class TrainOutcome:
    metrics: list[dict[str, Any]]
    checkpoint_events: list[dict[str, Any]]
    seconds: float


def trainer_argv(job: JobSpec, cluster: Cluster, node: Node, launch: TrainLaunch) -> list[str]:
    training, model = job.training, job.training.model
    argv = [
        node.python, "-m", "torch.distributed.run",
        "--nnodes", str(len(cluster.nodes)), "--nproc-per-node", str(job.cluster.procs_per_node),
        "--node-rank", str(node.rank), "--master-addr", cluster.head.address,
        "--master-port", str(launch.rendezvous_port), "--max-restarts", "0",
        "-m", "trainer.train",
        *(("--data-url", launch.dataset_url) if launch.dataset_url is not None else ("--data-dir", node.data_dir)),
        "--ckpt-dir", node.ckpt_dir, "--metrics-file", node.path("logs", "metrics.jsonl"),
        "--steps", str(training.steps), "--ckpt-every", str(job.checkpoints.every_steps),
        "--ckpt-mode", job.checkpoints.mode, "--flush-deadline-s", str(job.checkpoints.flush_deadline_s),
        "--keep-local", str(job.checkpoints.keep_local), "--batch-size", str(training.batch_size),
        "--lr", str(training.lr), "--warmup-steps", str(training.warmup_steps), "--seed", str(training.seed),
        "--vocab-size", str(model.vocab_size), "--d-model", str(model.d_model), "--n-layers", str(model.n_layers),
        "--n-heads", str(model.n_heads), "--seq-len", str(model.seq_len), "--threads", str(training.threads_per_proc),
        "--done-file", node.path("logs", "train.done"),
    ]
    if node.name in launch.resume_dirs:
        argv += ["--resume-from", launch.resume_dirs[node.name]]
    return argv


def syncer_argv(job: JobSpec, cluster: Cluster, node: Node, checkpoint_url: str) -> list[str]:
    argv = [
        node.python, "-m", "infra.node", "sync", "--ckpt-dir", node.ckpt_dir, "--url", checkpoint_url,
        "--node-rank", str(node.rank), "--nodes", str(len(cluster.nodes)),
        "--world-size", str(len(cluster.nodes) * job.cluster.procs_per_node),
        "--config-hash", job.config_hash(), "--keep", str(job.checkpoints.keep),
        "--flush-deadline", str(job.checkpoints.flush_deadline_s),
        "--stop-file", node.path("ckpt", STOP_SYNC),
    ]
    if job.checkpoints.mode == "direct":
        argv += ["--poll", str(DIRECT_SYNC_POLL_S)]
    return argv


def chaos_argv(node: Node, trigger: str, notice_s: float) -> list[str]:
    return [node.python, "-m", "infra.node", "chaos", "--trigger", trigger, "--workdir", node.workdir,
            "--notice-s", str(notice_s)]


def _wait_all(trainers: dict[str, Process], deadline: float, watch: PreemptionWatch) -> None:
    """Wait for every trainer; the first failure, a preemption or the deadline stops the rest and raises."""
    wait_all(
        trainers, deadline, poll=watch.poll,
        failed=lambda name, code, process: watch.explain(
            TrainingError(f"{name}: training exited {code}: {_last_error(process)}")),
        overdue=lambda pending: TrainingError(
            f"training still running after training.timeout_s on {', '.join(pending)}: "
            "raise training.timeout_s or check the nodes' logs"))


def _last_error(process: Process) -> str:
    return last_error(process, ("trainer error (", "restore:", "sync:"))


def _stop_syncers(runners: dict[str, Runner], syncers: dict[str, Process], nodes: tuple[Node, ...],
                  timeout_s: float = SYNC_FLUSH_TIMEOUT_S) -> None:
    """Ask every syncer to flush what is complete and exit; a syncer that fails means checkpoints were not saved."""
    started = [node for node in nodes if node.name in syncers]
    for node in started:
        runners[node.name].write_text(node.path("ckpt", STOP_SYNC), "stop\n")
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


@task(name="train", **NO_RETRIES)
def run_training(job: JobSpec, cluster: Cluster, launch: TrainLaunch, attempt: int = 0) -> TrainOutcome:
    """Not retried as a task: a preemption is recovered by the flow, any other failure resumes on the next run."""
    logger = get_run_logger()
    progress = TrainingProgress(job.training.steps, cluster.run_id)
    provider = get_provider(cluster.provider)
    runners = {node.name: provider.runner(cluster, node) for node in cluster.nodes}
    watch = PreemptionWatch(provider, cluster, runners, progress, job.recovery.confirm_s, logger)
    checkpoint_events: list[dict[str, Any]] = []
    env = {"OMP_NUM_THREADS": str(job.training.threads_per_proc), "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    syncers: dict[str, Process] = {}
    trainers: dict[str, Process] = {}
    try:
        for node in cluster.nodes:
            syncers[node.name] = runners[node.name].start(
                syncer_argv(job, cluster, node, launch.checkpoint_url), env=env,
                on_line=node_line_sink(logger, f"{node.name} sync", checkpoint_events.append),
                log_path=node.path("logs", "sync.log"))
        for node in cluster.nodes:
            trainers[node.name] = runners[node.name].start(
                trainer_argv(job, cluster, node, launch), env=env,
                on_line=node_line_sink(logger, node.name, follow=progress.follow if node == cluster.head else None),
                log_path=node.path("logs", "train.log"))
        if job.chaos is not None:
            watch.arm([event for event in job.chaos.preempt if event.attempt == attempt], chaos_argv)
        _wait_all(trainers, started + job.training.timeout_s, watch)
    except BaseException:
        # SIGTERM first: each trainer finishes its save in flight (and a last one if the deadline allows) ...
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
    metrics_text = runners[cluster.head.name].read_text(cluster.head.path("logs", "metrics.jsonl")) or ""
    metrics = [json.loads(line) for line in metrics_text.splitlines() if line.strip()]
    return TrainOutcome(metrics=metrics, checkpoint_events=checkpoint_events, seconds=time.monotonic() - started)
