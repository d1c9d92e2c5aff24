"""Plan: validate everything that can be checked before a node is launched, and freeze the run's dataset and input
snapshots and its parent (training.init_from as resolved at its first attempt)."""

from __future__ import annotations

from prefect import get_run_logger, task

from infra.job.handoff import take_handed
from infra.job.plan import Plan, check_secrets, keep_with_run, plan_job
from infra.job.spec import JobSpec
from infra.tracking.check import check_tracking
from tasks.policy import TRANSIENT_RETRIES
from tasks.secrets import read_secret_block


@task(name="plan", **TRANSIENT_RETRIES)
def plan_run(job: JobSpec, run_id: str) -> Plan:
    plan = take_handed(job, run_id)  # `trainpipe run` planned it already, in this process
    if plan is None:
        plan = plan_job(job, run_id, secret_blocks=read_secret_block, check_tracking=check_tracking)
    else:
        check_secrets(job, read_secret_block)  # the command planned before Prefect's blocks could be read
        if job.tracking is not None and job.tracking.mlflow is not None and any(
                ref.prefect_secret for ref in job.tracking.mlflow.secrets.values()):
            check_tracking(job, read_secret_block)
    keep_with_run(plan)
    get_run_logger().info("plan:\n%s", plan.render())
    return plan
