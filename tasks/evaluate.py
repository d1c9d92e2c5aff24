"""Evaluate: the job's `evaluate:` command on node 0, on the committed checkpoint restored there, before teardown.

Its metrics (a JSON object of numbers the command writes to TRAINPIPE_EVAL_FILE) become the step's eval record in
the store (step-N/eval.json beside the immutable manifest), a Prefect table artifact and the summary's `eval`. A
command that fails, overruns or writes no usable file fails the gate with its own last lines; the checkpoint stays
committed either way.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import asdict, dataclass
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from infra.checkpoints.store import CheckpointStore
from infra.compute.access.agent import NodeAgent
from infra.compute.providers import Cluster, runner_for
from infra.job.environment import training_environment
from infra.job.spec import JobSpec
from infra.node.protocol import ExecRequest
from infra.registry.refs import step_url
from infra.storage import open_store
from infra.workload.contract import render_command
from tasks.policy import NO_RETRIES
from tasks.stage import restore_checkpoint
from tasks.train import TrainLaunch, failure_tail, node_context, workload_env, workload_env_names

EVAL_FILE_VAR = "TRAINPIPE_EVAL_FILE"


class EvaluationFailed(RuntimeError):
    """The evaluate command failed or wrote no usable metrics; the message ends with its own last lines."""


@dataclass(frozen=True)
class Evaluation:
    checkpoint: str  # the step URL evaluated
    step: int
    metrics: dict[str, float]
    command: list[str]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_metrics(text: str | None, where: str) -> dict[str, float]:
    """The eval file's metrics: a JSON object of finite numbers; EvaluationFailed naming what is wrong."""
    if text is None:
        raise EvaluationFailed(f"evaluate wrote no {where} ({EVAL_FILE_VAR}): write a JSON object of metrics there, "
                               'e.g. {"eval_loss": 1.23}')
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EvaluationFailed(f"{where}: not JSON ({exc.msg} at line {exc.lineno}): write a JSON object of "
                               "metrics") from None
    if not isinstance(data, dict) or not data:
        raise EvaluationFailed(f"{where}: holds {type(data).__name__} {str(data)[:80]}, not a JSON object of metrics")
    bad = [key for key, value in data.items()
           if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)]
    if bad:
        raise EvaluationFailed(f"{where}: metric {bad[0]!r} is {data[bad[0]]!r}, not a finite number: write numbers "
                               "only")
    return {key: float(value) for key, value in data.items()}


@task(name="evaluate", **NO_RETRIES)
def evaluate_checkpoint(job: JobSpec, cluster: Cluster, launch: TrainLaunch, step: int) -> Evaluation:
    """Not retried: a failing evaluation is the job's own verdict, and running it twice would not change it."""
    assert job.evaluate is not None
    logger = get_run_logger()
    started = time.monotonic()
    head = cluster.head
    restored = restore_checkpoint.fn(cluster, head, launch.checkpoint_url, job.checkpoints.format, step=step,
                                     dest=head.path("eval", "checkpoint"), secrets=job.training.secrets,
                                     storage=job.storage)
    eval_file = head.path("eval", f"metrics-{launch.attempt_id}.json")
    context = node_context(job, cluster, head, launch)
    command = render_command(job.evaluate.command, context, extra={"checkpoint": restored.path,
                                                                    "eval_file": eval_file})
    runner = runner_for(cluster, head)
    # In the training environment, with its interpreter (the image's, training.python, the node's own).
    environment = training_environment(job, cluster, head)
    request = ExecRequest(argv=(environment.python, *command), training_env=environment,
                          cwd=head.code_dir if job.training.code is not None else head.workdir,
                          env_names=workload_env_names(job, context, EVAL_FILE_VAR))
    process = NodeAgent(runner, head.python, {**workload_env(job, context), EVAL_FILE_VAR: eval_file}).start(
        request, on_line=lambda line: logger.info("%s evaluate: %s", head.name, line.rstrip()),
        log_path=head.path("logs", "evaluate.log"))
    try:
        code = process.wait(job.evaluate.timeout_s)
    except TimeoutError:
        process.terminate()
        raise EvaluationFailed(f"evaluate still running after evaluate.timeout_s ({job.evaluate.timeout_s:.0f}s): "
                               f"raise it or check the command; its last output:\n{failure_tail(process)}") from None
    if code != 0:
        raise EvaluationFailed(f"evaluate exited {code}; its last output:\n{failure_tail(process)}")
    try:
        metrics = parse_metrics(runner.read_text(eval_file), eval_file)
    except EvaluationFailed as exc:
        raise EvaluationFailed(f"{exc}; its last output:\n{failure_tail(process)}") from None
    store = CheckpointStore(open_store(launch.checkpoint_url))
    store.record_eval(step, metrics, command=shlex.join(job.evaluate.command))
    evaluation = Evaluation(checkpoint=step_url(launch.checkpoint_url, step), step=step, metrics=metrics,
                            command=command, seconds=round(time.monotonic() - started, 3))
    create_table_artifact([{"metric": key, "value": value} for key, value in metrics.items()],
                          key=f"eval-{cluster.run_id}".lower().replace("_", "-").replace(".", "-"),
                          description=f"run {cluster.run_id}: evaluation of {evaluation.checkpoint}")
    logger.info("evaluate: %s: %s", evaluation.checkpoint, ", ".join(f"{k} {v:.6g}" for k, v in metrics.items()))
    return evaluation
