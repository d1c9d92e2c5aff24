"""Report: fold the nodes' results into the run summary, write summary.json and publish Prefect artifacts."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.logging import get_logger

from infra.analysis.breakdown import StepBreakdown
from infra.analysis.charts import markdown_image, run_chart_png
from infra.analysis.predict import what_if
from infra.analysis.predict_report import facts_from_summary
from infra.checkpoints.steps import step_name
from infra.checkpoints.store import CheckpointStore
from infra.compute.failover import attempts_of
from infra.compute.providers import Cluster
from infra.dataset.gate import DatasetValidation
from infra.dataset.reporting import dataset_fact, expectation_rows
from infra.job.plan import Plan
from infra.job.summary import BILLED_PHASES, PHASES, RESTORE_SOURCES, RunSummary
from infra.lifecycle.recovery import RECOVERY_PHASES
from infra.node.events import Event
from infra.storage import open_store
from infra.workspace import run_dir
from tasks.node_output import read_loss_curve
from tasks.policy import NO_RETRIES
from tasks.results import (
    CheckpointSave,
    Committed,
    Restored,
    Staged,
    StagedNode,
    Uploaded,
    Verified,
    checkpoint_saves,
    sync_results,
)
from tasks.train import TrainOutcome
from tasks.workload import NodeReady

log = get_logger("trainpipe.report")

FINAL_LOSS_WINDOW = 10  # the final loss averages this many logged points: one noisy batch does not decide it


def record_training(summary: RunSummary, staged: list[Staged], outcome: TrainOutcome,
                    verified: Verified, checkpoint_url: str) -> None:
    """What the script reported (points, facts, saves), what the syncers did, and the committed checkpoint."""
    if staged:  # nothing is staged when the trainer reads the dataset from the store (dataset.access remote)
        summary.stage = {
            "bytes": max(s.bytes for s in staged),
            "skipped_bytes": max(s.skipped_bytes for s in staged),
            "mb_per_s": min(s.mb_per_s for s in staged),
            "seconds": max(s.seconds for s in staged),
            # Per node, by rank: with fan-out the store serves each byte about once to the whole cluster.
            "store_bytes": [s.store_bytes for s in staged],
            "peer_bytes": [s.peer_bytes for s in staged],
            "fallback_files": sum(s.fallback_files for s in staged),
        }
    curve = read_loss_curve(run_dir(summary.run_id))  # every attempt's points, in the order they came
    losses = [point.loss for point in outcome.points if point.loss is not None]
    if curve:
        summary.start_step, summary.initial_loss = curve[0]
    # A last attempt that resumed at the final step trains none: the committed step is how far the run got.
    summary.steps = max([point.step for point in outcome.points] + [verified.step])
    if losses:
        summary.final_loss = sum(losses[-FINAL_LOSS_WINDOW:]) / len(losses[-FINAL_LOSS_WINDOW:])
    facts = outcome.facts
    summary.metrics = {key: value for key, value in facts.items() if key != "breakdown"}
    summary.final_eval_loss = _number(facts.get("eval_loss"))
    summary.loss_floor = _number(facts.get("loss_floor"))
    if isinstance(facts.get("breakdown"), dict):
        summary.breakdown = StepBreakdown.from_dict(facts["breakdown"]).summary()
    summary.checkpoints = checkpoint_metrics(outcome.checkpoint_events, outcome.sync_events)
    summary.warnings.extend(outcome.warnings)
    summary.checkpoint_step = verified.step
    summary.checkpoint = f"{checkpoint_url}/{step_name(verified.step)}"


def record_inputs(summary: RunSummary, plan: Plan, staged: Sequence[StagedNode]) -> None:
    """Each input's plan and how its staging went. The figures are the first staging's (what fetching it cost); a
    recovery stages again, mostly from the cache, and is listed under `restaged` instead of hiding them."""
    for name, input_plan in plan.inputs.items():
        each = [node.inputs[name] for node in staged if name in node.inputs]
        figures = (dict(fetched_bytes=max(s.bytes for s in each), reused_bytes=max(s.skipped_bytes for s in each),
                        seconds=max(s.seconds for s in each), mb_per_s=min(s.mb_per_s for s in each))
                   if each else {})
        earlier = summary.inputs.get(name)
        if earlier is not None and "fetched_bytes" in earlier:
            earlier.setdefault("restaged", []).append(figures)
            continue
        summary.inputs[name] = {**input_plan.summary(), **figures}


def _input_rows(summary: RunSummary) -> list[dict[str, Any]]:
    return [{"input": name, "url": record["url"], "files": record["files"], "MB": round(record["bytes"] / 1e6, 3),
             "fetched MB": round(record.get("fetched_bytes", 0) / 1e6, 3),
             "reused MB": round(record.get("reused_bytes", 0) / 1e6, 3), "seconds": record.get("seconds"),
             "MB/s": record.get("mb_per_s"), "snapshot": record["snapshot"]}
            for name, record in summary.inputs.items()]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def record_workload(summary: RunSummary, plan: Plan, ready: list[NodeReady], code_sha256: str | None) -> None:
    """Which code ran (its content hash), with which command, and what the setup cost (the slowest node)."""
    summary.workload = {
        "code": plan.workload.code,
        "code_sha256": code_sha256 or plan.workload.code_sha256,
        "command": list(plan.workload.command),
        "config_hash": plan.workload.config_hash,
        "setup_s": max((r.setup_s for r in ready), default=0.0),
    }


def record_launch(summary: RunSummary, cluster: Cluster) -> None:
    summary.record_launch(cluster.instance_type, cluster.market, cluster.price_per_hour, list(cluster.attempts))
    # What bootstrap found on each node (providers that bootstrap over SSH put it on the cluster record).
    summary.node_reports = dict(cluster.bootstrap)


def record_failure(summary: RunSummary, exc: BaseException, checkpoint_url: str | None = None,
                   cancelled: str | None = None) -> None:
    """Marks the run failed, or cancelled (why, when it was); a launch that never succeeded still reports every
    attempt it made; the latest committed checkpoint (what a rerun with the same run id resumes from) is named."""
    if cancelled is not None:
        summary.status, summary.error = "cancelled", cancelled
    else:
        summary.status, summary.error = "failed", f"{type(exc).__name__}: {exc or 'no message'}"
    if not summary.attempts:
        summary.attempts = attempts_of(exc)
    record_dataset_failure(summary, exc)
    if checkpoint_url is not None and summary.checkpoint is None:
        record_latest_commit(summary, checkpoint_url)


def record_latest_commit(summary: RunSummary, checkpoint_url: str) -> None:
    """The newest committed checkpoint, asked of the store (it outlives the nodes); a store that cannot say is
    logged, and the run's own failure stays the one it reports."""
    try:
        latest = CheckpointStore(open_store(checkpoint_url)).latest()
    except Exception as exc:  # the failure in flight is the one to report; this one is logged beside it
        log.warning("could not ask %s for its latest committed checkpoint: %s: %s", checkpoint_url,
                    type(exc).__name__, exc)
        return
    if latest is not None:
        summary.checkpoint_step = latest.step
        summary.checkpoint = f"{checkpoint_url}/{step_name(latest.step)}"


# -- the dataset section (issue 13) ---------------------------------------------------------------------------


def record_dataset_failure(summary: RunSummary, exc: BaseException) -> None:
    """A plan stopped by the dataset's expectations still reports every expectation's result."""
    validation = getattr(exc, "validation", None)
    if isinstance(validation, DatasetValidation) and not summary.dataset:
        summary.dataset = {"validation": validation.to_dict()}


# -------------------------------------------------------------------------------------------------------------


def record_resume(summary: RunSummary, restored: Sequence[Restored | Event],
                  logger: logging.Logger | logging.LoggerAdapter[Any] | None = None, initial: bool = True) -> None:
    """Which committed step every node restored, and why newer ones were skipped (a damaged checkpoint).

    initial: the run's own start (its resumed_from_step); a recovery's restore only adds its warnings."""
    logger = logger or get_run_logger()
    # The flow passes the restore tasks' results; a `restored` event read straight off a node's output (as the
    # checkpoint tests do) is parsed here, once, the same way the task does.
    restores = [r if isinstance(r, Restored) else Restored.from_event(r) for r in restored]
    steps = {r.step for r in restores}
    if len(steps) != 1:
        raise RuntimeError(f"nodes restored different checkpoint steps {sorted(steps)}: rerun to restore again")
    step = steps.pop()
    if initial:
        summary.resumed_from_step = step
        summary.resume_bytes = restore_sources(restores)
    for warning in sorted({w for r in restores for w in r.warnings}):
        logger.warning("resume fell back to step %d: %s", step, warning)
        summary.warnings.append(f"resumed from step {step}: {warning}")


def restore_sources(restores: Iterable[Restored]) -> dict[str, int]:
    """The bytes every node's restore took, summed by where they came from (store, peer, local, replica)."""
    totals: dict[str, int] = {}
    for restore in restores:
        for source, count in restore.sources.items():
            totals[source] = totals.get(source, 0) + count
    return totals


def checkpoint_metrics(trainer_events: Iterable[CheckpointSave | Mapping[str, Any]],
                       sync_events: Iterable[Uploaded | Committed | Event]) -> list[dict[str, Any]]:
    """One row per checkpoint step: the trainer's stall and local write (head node), the slowest node's upload,
    and the commit time (from the step being complete locally to its manifest in the store).

    Takes the train task's typed results; raw events (as read off a node's output) are parsed the same way."""
    rows: dict[int, dict[str, Any]] = {}
    for save in checkpoint_saves(trainer_events):
        rows.setdefault(save.step, {"step": save.step}).update(
            mode=save.mode, stall_s=save.stall_s, write_s=save.write_s, local_bytes=save.bytes)
    for event in sync_results(sync_events):
        row = rows.setdefault(event.step, {"step": event.step})
        if isinstance(event, Uploaded):
            row["upload_s"] = max(row.get("upload_s", 0.0), event.seconds)
            rates = [r for r in (row.get("upload_mb_per_s"), event.mb_per_s) if r is not None]
            row["upload_mb_per_s"] = min(rates) if rates else None
        else:
            row.update(commit_s=event.commit_s, committed_bytes=event.bytes)
    return [rows[step] for step in sorted(rows)]


def _phase_rows(summary: RunSummary) -> list[dict[str, Any]]:
    total = sum(summary.phases.values()) or 1.0
    return [{"phase": name, "seconds": summary.phases[name], "share %": round(100 * summary.phases[name] / total, 1)}
            for name in PHASES if name in summary.phases]


ATTEMPT_COLUMNS = ("instance_type", "region", "zone", "market", "outcome", "seconds", "error")
CHECKPOINT_COLUMNS = ("step", "mode", "stall_s", "write_s", "upload_s", "upload_mb_per_s", "commit_s")


def _attempt_rows(summary: RunSummary) -> list[dict[str, Any]]:
    return [{column: attempt.get(column) for column in ATTEMPT_COLUMNS} for attempt in summary.attempts]


def _checkpoint_rows(summary: RunSummary) -> list[dict[str, Any]]:
    return [{column: row.get(column) for column in CHECKPOINT_COLUMNS} for row in summary.checkpoints]


def _recovery_rows(summary: RunSummary) -> list[dict[str, Any]]:
    """One row per recovery: why, how far training had got, where it resumed, and where the time went."""
    rows = []
    for r in summary.recoveries:
        row = {key: r.get(key) for key in ("number", "node", "path", "reason", "step_reached", "resumed_from_step",
                                           "steps_lost", "notice_to_resume_s", "extra_cost_usd", "reused_bytes")}
        restored = r.get("restore_bytes", {})
        restore = {f"restore {source} MB": round(restored[source] / 1e6, 3) if source in restored else None
                   for source in RESTORE_SOURCES}
        rows.append({**row, **{f"{phase}_s": r["seconds"].get(phase) for phase in RECOVERY_PHASES}, **restore})
    return rows


def _breakdown_rows(summary: RunSummary) -> list[dict[str, Any]]:
    """T_compute, T_network and T_io of the training steps: seconds, per step, share of step time."""
    if not summary.breakdown:
        return []
    b = summary.breakdown
    return [{"term": name, "seconds": round(seconds, 3), "ms per step": round(1000 * b["per_step_s"][name], 2),
             "share %": round(100 * b["shares"][name], 1)} for name, seconds in b["terms_s"].items()]


def _what_if_rows(summary: RunSummary) -> list[dict[str, Any]]:
    """The predictor on this run's own breakdown: as measured, 2× network, local NVMe (catalog candidates and a
    deadline are `trainpipe predict`'s)."""
    if not summary.breakdown or summary.breakdown["wall_s"] <= 0:  # a resumed run with no step left to train
        return []
    facts = facts_from_summary(summary.to_dict(), summary.run_id)
    return [{"scenario": p.label, "step s": round(p.step_s, 4), "job s": round(p.job_s, 1),
             "speedup": round(p.speedup, 2), "bound": p.bound()}
            for p in what_if(facts.breakdown, facts.measured, facts.job, facts.price_per_hour)]


def _breakdown_fact(summary: RunSummary) -> str | None:
    if not summary.breakdown:
        return None
    b = summary.breakdown
    return (f"step time: **{b['dominant']}**; {b['allreduce_bytes_per_step'] / 1e6:,.2f} MB all-reduced and "
            f"{b['read_bytes_per_step'] / 1e3:,.1f} kB read per step ({b['data_source']} data, {b['ckpt_mode']} "
            f"checkpoints); gradient all-reduce {b['comm_total_s']:.2f} s in flight, "
            f"{b['comm_exposed_s']:.2f} s exposed")


def _checkpoint_fact(summary: RunSummary) -> str | None:
    stalls = [c["stall_s"] for c in summary.checkpoints if c.get("stall_s") is not None]
    uploads = [c["upload_mb_per_s"] for c in summary.checkpoints if c.get("upload_mb_per_s")]
    if not stalls:
        return None
    upload = f", uploaded at {min(uploads):,.0f}–{max(uploads):,.0f} MB/s" if uploads else ""
    return (f"{len(summary.checkpoints)} checkpoints ({summary.checkpoints[-1].get('mode')}): training stalled "
            f"{sum(stalls) / len(stalls):.3f} s per checkpoint{upload}")


def _cost_fact(summary: RunSummary) -> str | None:
    if summary.cost_usd is None or summary.price_per_hour is None:
        return None
    return (f"{summary.nodes}× {summary.instance_type} ({summary.market}) at ${summary.price_per_hour:,.2f}/h: "
            f"cost **${summary.cost_usd:,.4f}** for {sum(summary.phases.get(p, 0.0) for p in BILLED_PHASES):,.0f} s "
            f"provisioned, after {len(summary.attempts)} launch attempt(s)")


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if row[c] is None else str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _eval_rows(summary: RunSummary) -> list[dict[str, Any]]:
    """The evaluation's metrics, beside the champion's value of the promoted metric when a gate compared them."""
    gate = summary.promotion
    return [{"metric": key, "value": value,
             "champion": gate.get("champion_value") if gate.get("metric") == key else None,
             "decision": ("promoted" if gate["promoted"] else "kept the champion") if gate.get("metric") == key
             else ""} for key, value in summary.eval.get("metrics", {}).items()]


def _markdown(summary: RunSummary, curve: list[tuple[int, float]]) -> str:
    """What ran where, how long each phase took, how fast data moved, how far the loss fell, what was committed."""
    facts = [f"job **{summary.job}** on **{summary.provider}**, {summary.nodes} nodes"]
    dataset = dataset_fact(summary.dataset)
    if dataset:
        facts.append(dataset)
    if summary.workload:
        code = summary.workload.get("code_sha256")
        facts.append(f"command `{' '.join(summary.workload['command'])}`; code "
                     + (f"sha256 `{code}`" if code else "from the nodes' environment")
                     + f"; setup {summary.workload['setup_s']:.1f} s")
    cost = _cost_fact(summary)
    if cost:
        facts.append(cost)
    if summary.stage:
        facts.append(f"staged {summary.stage['bytes'] / 1e6:,.1f} MB per node at {summary.stage['mb_per_s']} MB/s "
                     f"(slowest node), {summary.stage['skipped_bytes'] / 1e6:,.1f} MB already there")
    if summary.fanout is not None:
        facts.append(f"fanout: {summary.fanout}")
    if summary.final_loss is not None and summary.initial_loss is not None:
        floor = f" (floor {summary.loss_floor:.3f})" if summary.loss_floor is not None else ""
        facts.append(f"loss {summary.initial_loss:.3f} → **{summary.final_loss:.3f}**{floor}, "
                     f"steps {summary.start_step}–{summary.steps}")
    facts += [fact for fact in (_breakdown_fact(summary), _checkpoint_fact(summary)) if fact]
    reported = {k: v for k, v in summary.metrics.items() if isinstance(v, int | float | str) and k != "event"}
    if reported:
        facts.append("the script reported " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                        for k, v in sorted(reported.items())))
    checkpoint = f"[{summary.checkpoint}]({summary.checkpoint})" if summary.checkpoint else "none"
    facts += [f"committed checkpoint: {checkpoint}", f"nodes left running after teardown: {summary.nodes_left}"]
    chart = markdown_image(run_chart_png(curve, summary.phases, summary.loss_floor), "loss curve and time per phase")
    if summary.promotion:
        facts.append(f"{summary.promotion['model']}@{summary.promotion['alias']}: {summary.promotion['reason']}")
    sections = {"Phases": _phase_rows(summary), "Evaluation": _eval_rows(summary),
                "Inputs": _input_rows(summary),
                "Dataset expectations": expectation_rows(summary.dataset),
                "Step time": _breakdown_rows(summary),
                "What if (predicted from this run; `trainpipe predict` adds the catalog)": _what_if_rows(summary),
                "Checkpoints": _checkpoint_rows(summary),
                "Launch attempts": _attempt_rows(summary), "Recoveries from preemption": _recovery_rows(summary)}
    return (f"# Run `{summary.run_id}`: {summary.status}\n\n"
            + (f"**{summary.error}**\n\n" if summary.error else "")
            + "".join(f"* {fact}\n" for fact in facts)
            + "".join(f"\n## {title}\n\n{_markdown_table(rows)}" for title, rows in sections.items() if rows)
            + f"\n{chart}\n")


@task(name="publish-summary", **NO_RETRIES)
def publish_summary(summary: RunSummary, directory: Path) -> Path:
    summary.finish()
    path = summary.write(directory)
    artifact_key = "retrain-" + "".join(c if c.isalnum() else "-" for c in summary.job.lower())
    create_markdown_artifact(_markdown(summary, read_loss_curve(directory)), key=artifact_key,
                             description=f"run {summary.run_id}")
    create_table_artifact(_phase_rows(summary), key=f"{artifact_key}-phases",
                          description=f"run {summary.run_id}: seconds per phase")
    tables = {"inputs": (_input_rows(summary), "per input: size, bytes fetched and reused from the nodes' cache, "
                         "seconds and MB/s of its staging"),
              "dataset-expectations": (expectation_rows(summary.dataset), "per expectation of dataset.expectations: "
                                       "success, rows, unexpected count and values, failed files"),
              "evaluation": (_eval_rows(summary), "the evaluation's metrics and the promotion gate's decision"),
              "step-time": (_breakdown_rows(summary), "T_compute, T_network, T_io of the training steps"),
              "launch-attempts": (_attempt_rows(summary), "every launch attempt, in order"),
              "checkpoints": (_checkpoint_rows(summary), "per checkpoint: training stall, write, upload, commit"),
              "recoveries": (_recovery_rows(summary), "per preemption: steps redone, time to resume and its split")}
    for suffix, (rows, what) in tables.items():
        if rows:
            create_table_artifact(rows, key=f"{artifact_key}-{suffix}", description=f"run {summary.run_id}: {what}")
    get_run_logger().info("summary written to %s\n%s", path, summary.render())
    return path
