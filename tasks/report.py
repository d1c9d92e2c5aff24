"""Report: fold the nodes' results into the run summary, write summary.json and publish Prefect artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from infra.summary import PHASES, RunSummary
from tasks.policy import NO_RETRIES
from tasks.train import TrainOutcome


def record_training(summary: RunSummary, staged: list[dict[str, Any]], outcome: TrainOutcome,
                    verified: dict[str, Any], checkpoint_url: str) -> None:
    summary.stage = {
        "bytes": max(s["bytes"] for s in staged),
        "skipped_bytes": max(s["skipped_bytes"] for s in staged),
        "mb_per_s": min(s["mb_per_s"] for s in staged),
        "seconds": max(s["seconds"] for s in staged),
    }
    done = next((m for m in reversed(outcome.metrics) if m.get("event") == "done"), None)
    if done is None:
        raise RuntimeError("the trainer finished without its final metrics record: see the head node's train.log")
    summary.steps = done["steps"]
    summary.start_step = done["start_step"]
    summary.initial_loss = done["initial_loss"]
    summary.final_loss = done["final_loss"]
    summary.final_eval_loss = done.get("final_eval_loss")
    summary.checkpoints = [e for e in outcome.checkpoint_events if e["event"] in ("uploaded", "committed")]
    summary.checkpoint_step = verified["step"]
    summary.checkpoint = f"{checkpoint_url}/step-{verified['step']:08d}"


def _markdown(summary: RunSummary) -> str:
    rows = "\n".join(f"| {name} | {summary.phases[name]:.1f} |" for name in PHASES if name in summary.phases)
    loss = (f"{summary.initial_loss:.3f} → {summary.final_loss:.3f} (floor {summary.loss_floor:.3f})"
            if summary.final_loss is not None and summary.loss_floor is not None else "n/a")
    return (f"# Run `{summary.run_id}`: {summary.status}\n\n"
            f"{summary.error or ''}\n\n"
            f"* job **{summary.job}** on **{summary.provider}**, {summary.nodes} nodes\n"
            f"* loss {loss}, steps {summary.start_step}–{summary.steps}\n"
            f"* committed checkpoint: {summary.checkpoint or 'none'}\n"
            f"* nodes left running after teardown: {summary.nodes_left}\n\n"
            f"| phase | seconds |\n|---|---|\n{rows}\n")


@task(name="publish-summary", **NO_RETRIES)
def publish_summary(summary: RunSummary, directory: Path) -> Path:
    path = summary.write(directory)
    artifact_key = "retrain-" + "".join(c if c.isalnum() else "-" for c in summary.job.lower())
    create_markdown_artifact(_markdown(summary), key=artifact_key, description=f"run {summary.run_id}")
    create_table_artifact([{"phase": name, "seconds": summary.phases[name]} for name in PHASES
                           if name in summary.phases], key=f"{artifact_key}-phases")
    get_run_logger().info("summary written to %s\n%s", path, summary.render())
    return path
