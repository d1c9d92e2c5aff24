"""Plan's check of the job's experiment tracker: the server answers and the experiment can be written, before
anything is launched. Handed to infra.job.plan.plan_job by its callers; the client loads only for a tracked job."""

from __future__ import annotations

from infra.job.plan import PlanError
from infra.job.secrets import BlockReader, SecretMissing, resolve_secrets
from infra.job.spec import JobSpec
from infra.job.tracking_spec import SECRETS_FIELD


def check_tracking(job: JobSpec, secret_blocks: BlockReader | None) -> None:
    """Raises PlanError, one line naming the field. Without secret_blocks, credentials kept in Prefect blocks leave
    the check to the flow's plan."""
    spec = job.tracking.mlflow if job.tracking is not None else None
    if spec is None or (secret_blocks is None and any(ref.prefect_secret for ref in spec.secrets.values())):
        return
    from infra.tracking.mlflow_run import TrackingError, check_server

    try:
        check_server(spec, job.name, resolve_secrets(spec.secrets, secret_blocks, field=SECRETS_FIELD))
    except (SecretMissing, TrackingError) as exc:
        raise PlanError(str(exc)) from None
