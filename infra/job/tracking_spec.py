"""The job's `tracking` section: which MLflow server a run is recorded in, and the credentials to reach it.

Plain data and no MLflow import: a job without the section never loads the client (infra.tracking.mlflow_run is
imported only where a job has one). Credentials are secret references like training.secrets, never values.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from infra.job.secrets import SecretRef
from infra.strict_model import StrictModel

# The variables MLflow's own clients read their credentials from: the orchestrator's client and the script's
# (a Hugging Face Trainer's or Lightning's MLflow logger on the nodes) alike.
CREDENTIAL_NAMES = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
SECRETS_FIELD = "tracking.mlflow.secrets"


class MlflowSpec(StrictModel):
    uri: str = Field(pattern=r"^(https?|databricks)(://\S*)?$", description="The MLflow tracking server "
                     "(http(s)://host:port) or 'databricks'; its model registry is the same server's.")
    experiment: str | None = Field(None, min_length=1, description="The MLflow experiment each run is recorded "
                                   "in (created when missing). Default: the job's name.")
    secrets: dict[str, SecretRef] = Field(
        default_factory=dict, description="The server's credentials, each named like training.secrets "
        "({env: VARIABLE} or {prefect_secret: block-name}) under the variable MLflow reads: MLFLOW_TRACKING_TOKEN, "
        "or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD. Given to the orchestrator's client and to every "
        "node's training, never a parameter.")
    send_timeout_s: float = Field(10.0, gt=0, le=300, description="One request to the server: past it the request "
                                  "fails and its metrics wait in the buffer for the next try.")
    buffer: int = Field(100_000, ge=1000, description="Metric points held while the server does not answer; past "
                        "it the oldest are dropped and the summary counts them.")

    @field_validator("secrets")
    @classmethod
    def _credential_names(cls, value: dict[str, SecretRef]) -> dict[str, SecretRef]:
        for name in value:
            if name not in CREDENTIAL_NAMES:
                raise ValueError(f"secret {name}: MLflow reads its credentials from {', '.join(CREDENTIAL_NAMES)}: "
                                 "name one of those")
        if ("MLFLOW_TRACKING_USERNAME" in value) != ("MLFLOW_TRACKING_PASSWORD" in value):
            raise ValueError("MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD go together: name both")
        return value


class TrackingSpec(StrictModel):
    """Where each run and each promotion is recorded besides trainpipe's own summary and registry."""

    mlflow: MlflowSpec | None = Field(None, description="An MLflow server: one MLflow run per trainpipe run, "
                                      "and each promotion a model version with the alias on it.")


def experiment_name(tracking: MlflowSpec, job_name: str) -> str:
    return tracking.experiment or job_name


def node_environment(tracking: MlflowSpec, job_name: str, mlflow_run_id: str) -> dict[str, str]:
    """What every node's training gets so that the script's own MLflow logging (a Hugging Face Trainer with
    report_to=["mlflow"], Lightning's MLFlowLogger, mlflow.start_run()) joins the trainpipe run's MLflow run;
    the credentials travel apart, as secrets."""
    return {"MLFLOW_TRACKING_URI": tracking.uri, "MLFLOW_EXPERIMENT_NAME": experiment_name(tracking, job_name),
            "MLFLOW_RUN_ID": mlflow_run_id}
