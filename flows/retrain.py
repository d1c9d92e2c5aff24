"""retrain: plan → provision → verify → stage → train → sync → teardown (always) → report."""

from __future__ import annotations

from typing import Any

from prefect import flow, unmapped
from prefect.logging.loggers import flow_run_logger
from prefect.runtime import flow_run as current_flow_run
from prefect.states import State

from infra.plan import Plan, cluster_name_for
from infra.spec import JobSpec
from infra.summary import RunSummary
from infra.workspace import run_dir
from tasks.capacity import nodes_held
from tasks.checkpoint import verify_committed_checkpoint
from tasks.cluster import provision_cluster, teardown_cluster
from tasks.plan import plan_run
from tasks.report import publish_summary, record_failure, record_launch, record_resume, record_training
from tasks.stage import restore_checkpoint, stage_dataset
from tasks.train import TrainLaunch, run_training
from tasks.verify import verify_node


def default_run_id(job_name: str, flow_run_id: str) -> str:
    return f"{job_name}-{flow_run_id.replace('-', '')[:10]}"


def teardown_on_crash(flow: Any, flow_run: Any, state: State[Any]) -> None:
    """Cancellation and crash skip the flow's finally; this hook tears the cluster down from the parameters alone."""
    job = JobSpec.model_validate(flow_run.parameters["job"])
    run_id = flow_run.parameters.get("run_id") or default_run_id(job.name, str(flow_run.id))
    flow_run_logger(flow_run, flow).warning("run %s ended %s: tearing down its cluster", run_id, state.type.value)
    teardown_cluster.fn(job.cluster.provider, cluster_name_for(run_id))


@flow(name="retrain", on_cancellation=[teardown_on_crash], on_crashed=[teardown_on_crash], log_prints=True)
def retrain(job: JobSpec, run_id: str | None = None) -> dict[str, Any]:
    """Run one retraining job from nothing to a committed checkpoint, and leave nothing running."""
    # Its nodes count against the global node limit for the whole run, so runs together never exceed it.
    with nodes_held(job.cluster.nodes):
        return run_job(job, run_id or default_run_id(job.name, str(current_flow_run.id)))


def run_job(job: JobSpec, run_id: str) -> dict[str, Any]:
    cluster_name = cluster_name_for(run_id)
    summary = RunSummary(run_id=run_id, job=job.name, provider=job.cluster.provider, nodes=job.cluster.nodes)
    try:
        with summary.phase("plan"):
            plan: Plan = plan_run(job, run_id)
        summary.loss_floor = plan.loss_floor
        with summary.phase("provision"):
            cluster = provision_cluster(job, cluster_name, run_id)
        record_launch(summary, cluster)
        with summary.phase("verify"):
            probes = verify_node.map(unmapped(cluster), cluster.nodes, unmapped(plan.dataset_bytes)).result()
        with summary.phase("stage"):
            staged = stage_dataset.map(unmapped(cluster), cluster.nodes, unmapped(plan.dataset_url)).result()
            restored = (restore_checkpoint.map(unmapped(cluster), cluster.nodes, unmapped(plan.checkpoint_url)).result()
                        if plan.resume_step is not None else [])
            if restored:
                record_resume(summary, restored)
        with summary.phase("train"):
            resume_dirs = {node.name: r["path"] for node, r in zip(cluster.nodes, restored, strict=False)}
            launch = TrainLaunch(plan.checkpoint_url, probes[0]["free_port"], resume_dirs)
            outcome = run_training(job, cluster, launch)
        with summary.phase("sync"):
            verified = verify_committed_checkpoint(cluster, plan.checkpoint_url)
        record_training(summary, staged, outcome, verified, plan.checkpoint_url)
        summary.status = "completed"
    except BaseException as exc:
        record_failure(summary, exc)
        raise
    finally:
        with summary.phase("teardown"):
            summary.nodes_left = teardown_cluster(job.cluster.provider, cluster_name)
        publish_summary(summary, run_dir(run_id))
    return summary.to_dict()
