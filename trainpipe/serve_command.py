"""`trainpipe serve` and `trainpipe submit`: Prefect as users run it. Prefect is imported inside the commands, so
the rest of the CLI works without it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

RETRAIN = "retrain/retrain"
# Heartbeats are how the server learns that a run's process is gone; 30 s is Prefect's shortest.
HEARTBEAT_S = 30


def serve(
    max_nodes: Annotated[int | None, typer.Option(
        "--max-nodes", min=1, help="nodes all runs together may hold at once (a Prefect global concurrency limit)")
    ] = None,
    silence_s: Annotated[int, typer.Option(
        "--silence-s", min=HEARTBEAT_S + 15,
        help="a retrain run without a heartbeat this long is marked Crashed and its cluster swept")] = 90,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="flow runs this process executes at once")
                     ] = None,
) -> None:
    """Serve every deployment of prefect.yaml from this process, with the teardown automations. Runs until stopped."""
    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(HEARTBEAT_S))  # inherited by every run's process
    from prefect import get_client
    from prefect import serve as prefect_serve

    from flows.automations import install, teardown_automations
    from flows.deployments import served_deployments
    from tasks.capacity import NODE_LIMIT

    deployments = served_deployments()
    ids = {deployment.name: deployment.apply() for deployment in deployments}
    if max_nodes is not None:
        with get_client(sync_client=True) as client:
            client.upsert_global_concurrency_limit_by_name(NODE_LIMIT, max_nodes)
        typer.echo(f"at most {max_nodes} nodes at once (global concurrency limit '{NODE_LIMIT}')")
    install(teardown_automations(ids["sweep-orphans"], silence_s))
    typer.echo(f"teardown automations installed: a retrain silent for {silence_s}s is marked Crashed; "
               "a Crashed or Cancelled retrain runs sweep-orphans")
    prefect_serve(*deployments, limit=limit)


def submit(
    config: Annotated[Path, typer.Argument(help="job config YAML (see examples/local.yaml)")],
    wait: Annotated[bool, typer.Option("--wait", help="wait for the run to end; print its state and summary")] = False,
    run_id: Annotated[str | None, typer.Option("--run-id", help="reuse a run id to resume its checkpoints")] = None,
    deployment: Annotated[str, typer.Option(help="FLOW/DEPLOYMENT to run")] = RETRAIN,
) -> None:
    """Start a run of the retrain deployment with this config (served by `trainpipe serve` or a worker)."""
    from infra.job.spec import load_job  # pydantic: only for the command that reads a config

    job = load_job(config)  # relative paths resolve here, against the submitter's directory
    from prefect.deployments import run_deployment

    from flows.retrain import default_run_id

    flow_run = run_deployment(deployment, parameters={"job": job.model_dump(mode="json"), "run_id": run_id},
                              timeout=None if wait else 0)
    typer.echo(f"flow run {flow_run.id} (run id {run_id or default_run_id(job.name, str(flow_run.id))})")
    if not wait:
        return
    state = flow_run.state
    typer.echo(f"state: {state.name if state else 'unknown'}" + (f": {state.message}" if state and state.message
                                                                   else ""))
    for text in run_markdown(flow_run.id):
        typer.echo(text)
    if state is None or not state.is_completed():
        raise typer.Exit(1)


def run_markdown(flow_run_id: Any) -> list[str]:
    """The run's markdown artifacts, without embedded images (a terminal cannot show them)."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), type=ArtifactFilterType(any_=["markdown"])))
    return ["\n".join(line for line in str(a.data).splitlines() if not line.startswith("![")) for a in artifacts]
