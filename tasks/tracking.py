"""The run's MLflow run as the orchestrator keeps it: opened after plan, fed while the run goes, closed with its status.

A job without tracking.mlflow imports nothing of MLflow here, and every hook is a no-op. The open runs are kept by
trainpipe run id in this process: the flow's tasks run in its threads, and the metrics poll, the node environment
and the close find the run's MLflow run there. The tracker never fails the run: a server that cannot be used is
logged once and said in the summary's tracking section.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.job.secrets import resolve_secrets
from infra.job.spec import JobSpec
from infra.job.summary import PHASES, RunSummary
from infra.job.tracking_spec import SECRETS_FIELD, MlflowSpec, experiment_name, node_environment
from infra.node.events import WorkloadEvent
from tasks.secrets import read_secret_block

if TYPE_CHECKING:
    from infra.tracking.mlflow_run import MlflowRun

log = logging.getLogger("trainpipe.tracking")
CLOSE_DEADLINE_S = 30.0  # what the end of a run waits for buffered metrics, however long the server was away
SECRET_REFS = ("training.secrets", "tracking.mlflow.secrets")  # references, not values: left out of the params
_OPEN: dict[str, MlflowRun] = {}
_LOCK = threading.Lock()


def mlflow_spec(job: JobSpec) -> MlflowSpec | None:
    return job.tracking.mlflow if job.tracking is not None else None


def tracking_credentials(spec: MlflowSpec) -> dict[str, str]:
    """The server's credentials resolved (SecretMissing names the one that is not set)."""
    return resolve_secrets(spec.secrets, read_secret_block, field=SECRETS_FIELD)


def tracking_secrets(job: JobSpec) -> dict[str, str]:
    """The server's credentials for a node's training (the script's own MLflow logging), resolved as the command
    starts, like training.secrets."""
    spec = mlflow_spec(job)
    return tracking_credentials(spec) if spec is not None else {}


def tracking_secret_names(job: JobSpec) -> tuple[str, ...]:
    spec = mlflow_spec(job)
    return tuple(spec.secrets) if spec is not None else ()


def open_run(job: JobSpec, run_id: str, summary: RunSummary) -> None:
    """The run id's MLflow run, created or (a recovery in this flow, a rerun of the id) continued."""
    spec = mlflow_spec(job)
    if spec is None:
        return
    from infra.tracking.mlflow_run import MlflowRun, TrackingError, flatten

    params = flatten(job.model_dump(mode="json"), drop=SECRET_REFS)
    tags = {"trainpipe.job": job.name, "trainpipe.provider": job.cluster.provider,
            "trainpipe.nodes": str(job.cluster.nodes), "trainpipe.procs_per_node": str(job.cluster.procs_per_node)}
    try:
        run = MlflowRun.open(spec, job.name, run_id, tracking_credentials(spec), params, tags, log)
    except TrackingError as exc:
        # Plan found the server; it went away since. The run goes on: trainpipe's own records are whole.
        log.warning("MLflow: %s: this run is not recorded there", exc)
        summary.tracking = {"uri": spec.uri, "experiment": experiment_name(spec, job.name), "mlflow_run_id": None,
                            "errors": [f"{exc}: nothing of this run recorded in MLflow"]}
        return
    with _LOCK:
        _OPEN[run_id] = run
    summary.tracking = run.outcome.to_dict()
    log.info("MLflow: run %s %s in experiment %s at %s", run.id, "continued" if run.outcome.continued else
             "created", run.outcome.experiment, spec.uri)


def active(run_id: str) -> MlflowRun | None:
    with _LOCK:
        return _OPEN.get(run_id)


def record_sink(run_id: str) -> Callable[[Mapping[str, Any]], None] | None:
    """What the metrics poll hands each record of the script's metrics file to; None when the run is untracked."""
    run = active(run_id)
    if run is None:
        return None

    def sink(record: Mapping[str, Any]) -> None:
        if record.get("event") == WorkloadEvent.CHECKPOINT:  # the script's save: its stall and write at its step
            run.log_record({f"checkpoint.{k}": v for k, v in record.items() if k not in ("event", "step", "time")}
                           | {"step": record.get("step"), "time": record.get("time")})
        else:
            run.log_record(record)
    return sink


def node_tracking_env(job: JobSpec, run_id: str) -> dict[str, str]:
    """MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, MLFLOW_RUN_ID for every node's training (the credentials go as
    secrets, with training.secrets); nothing when the run is untracked."""
    spec, run = mlflow_spec(job), active(run_id)
    if spec is None or run is None:
        return {}
    return node_environment(spec, job.name, run.id)


def tag_launch(run_id: str, lineage: Mapping[str, Any] | None, summary: RunSummary, attempt: int) -> None:
    """An attempt's facts as tags: the cluster, its price, the lineage its checkpoints record, the attempt count."""
    run = active(run_id)
    if run is None:
        return
    tags = {"trainpipe.attempts": str(attempt + 1), "trainpipe.cluster.instance_type": str(summary.instance_type),
            "trainpipe.cluster.market": str(summary.market),
            "trainpipe.cluster.price_per_hour": str(summary.price_per_hour)}
    if lineage is not None:
        cluster = lineage.get("cluster") or {}
        tags.update({"trainpipe.dataset.url": str(lineage["dataset"]["url"]),
                     "trainpipe.dataset.snapshot_digest": str(lineage["dataset"]["snapshot_digest"]),
                     "trainpipe.code_sha256": str(lineage.get("code_sha256")),
                     "trainpipe.config_hash": str(lineage.get("config_hash")),
                     "trainpipe.parent": str(lineage.get("parent")),
                     "trainpipe.cluster.nodes": str(cluster.get("nodes")),
                     "trainpipe.cluster.network_gbps": str(cluster.get("network_gbps"))})
        tags.update({f"trainpipe.input.{name}.snapshot_digest": str(i["snapshot_digest"])
                     for name, i in (lineage.get("inputs") or {}).items()})
    run.set_tags(tags)


def close_run(summary: RunSummary) -> None:
    """The end of the run: phases, cost, the step-time split, each commit and the evaluation as metrics, the outcome
    as tags, the buffer drained within CLOSE_DEADLINE_S and the status set. Called with the summary final but for
    its publication."""
    with _LOCK:
        run = _OPEN.pop(summary.run_id, None)
    if run is None:
        return
    from infra.tracking.mlflow_run import FINAL_STATUS, numeric_metrics

    last = max(summary.steps, 0)
    run.log_metrics({f"phase.{name}_s": summary.phases[name] for name in PHASES if name in summary.phases}
                    | {k: float(v) for k, v in (("cost_usd", summary.cost_usd), ("steps_s", summary.steps_s),
                                                ("overhead_s", summary.overhead_s)) if v is not None}, last)
    if summary.breakdown:
        run.log_metrics({f"step_time.{k}": v for k, v in numeric_metrics(summary.breakdown).items()}, last)
    for row in summary.checkpoints:
        run.log_metrics({f"commit.{k}": v for k, v in numeric_metrics(row).items()}, int(row["step"]))
    if summary.eval:
        run.log_metrics({f"eval.{k}": v for k, v in numeric_metrics(summary.eval.get("metrics", {})).items()},
                        int(summary.eval.get("step") or last))
    tags = {"trainpipe.status": summary.status, "trainpipe.attempts": str(1 + len(summary.recoveries)),
            "trainpipe.checkpoint": str(summary.checkpoint)}
    if summary.error:
        tags["trainpipe.error"] = summary.error
    if summary.promotion:
        tags.update({"trainpipe.promotion.promoted": str(summary.promotion["promoted"]).lower(),
                     "trainpipe.promotion.reason": summary.promotion["reason"],
                     "trainpipe.promotion.alias": f"{summary.promotion['model']}@{summary.promotion['alias']}"})
    run.set_tags(tags)
    outcome = run.close(FINAL_STATUS.get(summary.status, "FAILED"), CLOSE_DEADLINE_S)
    # Errors said before the close (the registry's mirror) stay beside the run's own.
    earlier = [e for e in summary.tracking.get("errors", []) if e not in outcome.errors]
    summary.tracking = {**summary.tracking, **outcome.to_dict(), "errors": earlier + outcome.errors}
    if outcome.errors:
        log.warning("MLflow: %s", "; ".join(outcome.errors))
    _closed[summary.run_id] = run


def mirror_promotion(job: JobSpec, run_id: str, promoted: bool, model: str, alias: str,
                     summary: RunSummary) -> None:
    """After the store's registry moved model@alias (the compare-and-swap decided): MLflow's version and alias
    follow. A mirror that fails is said in the summary; `trainpipe model sync --mlflow` repairs it."""
    spec = mlflow_spec(job)
    if spec is None or not promoted:
        return  # a gate that kept the champion moved nothing: the run's tags say why
    from infra.tracking.mlflow_registry import mirror_alias
    from infra.tracking.mlflow_run import client_for, describe_failure, use_credentials

    run = active(run_id)
    started = time.perf_counter()
    try:
        use_credentials(spec, tracking_credentials(spec))
        mirrored = mirror_alias(client_for(spec), job.checkpoints.url, model, alias,
                                {run_id: run.id} if run is not None else None)
    except Exception as exc:  # the store's move stands; the mirror is repaired later, and said now
        message = (f"{model}@{alias} not mirrored in MLflow ({describe_failure(spec, exc)}): `trainpipe model sync "
                   f"--mlflow {spec.uri} --root {job.checkpoints.url}` repairs it")
        log.warning("MLflow: %s", message)
        summary.tracking = {**summary.tracking, "registry": {"error": message},
                            "errors": [*summary.tracking.get("errors", []), message]}
        return
    summary.tracking = {**summary.tracking, "registry": {**mirrored.to_dict(),
                                                         "seconds": round(time.perf_counter() - started, 3)}}
    if run is not None:
        run.set_tags({"trainpipe.mlflow_model_version": f"{model}/{mirrored.version}"})


# Closed runs whose artifacts are still to come (the summary is written after the status is set).
_closed: dict[str, MlflowRun] = {}


def record_artifacts(summary: RunSummary, directory: Path) -> None:
    """summary.json and the run's report files as artifacts of its MLflow run (a failure is added to the summary,
    which is then written again)."""
    run = _closed.pop(summary.run_id, None)
    if run is None:
        return
    before = len(run.outcome.errors)
    for name in ("summary.json", "loss.csv", "report.md"):
        if (directory / name).is_file():
            run.log_artifact(str(directory / name))
    if len(run.outcome.errors) > before:
        summary.tracking = {**summary.tracking, "errors": list(run.outcome.errors)}
        summary.write(directory)
