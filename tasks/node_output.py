"""Node output into the Prefect run log, labelled with the node, and node events picked out of it.

Progress lines (transfer `progress` events, the trainer's per-step lines) arrive several times a second; they are
logged at most once per PROGRESS_LOG_INTERVAL_S per node so the run log stays readable. Every other line, errors
above all, is logged as it comes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from infra.node.events import Throttle, parse
from infra.workspace import run_dir

PROGRESS_LOG_INTERVAL_S = 5.0
PROGRESS_ARTIFACT_INTERVAL_S = 2.0
# The human line trainer.metrics prints on rank 0 for every logged step.
STEP_LINE = re.compile(r"^step (\d+)/(\d+) loss ([0-9.]+)")
LOSS_CURVE = "loss.csv"


def _is_progress(line: str, event: dict[str, Any] | None) -> bool:
    return (event is not None and event.get("event") == "progress") or STEP_LINE.match(line) is not None


def node_line_sink(logger: logging.Logger | logging.LoggerAdapter[Any], node: str,
                   on_event: Callable[[dict[str, Any]], None] | None = None,
                   follow: Callable[[str], None] | None = None) -> Callable[[str], None]:
    """follow hears every line (before rate limiting); on_event every event line."""
    throttle = Throttle(PROGRESS_LOG_INTERVAL_S)

    def sink(line: str) -> None:
        event = parse(line)
        if event is not None and on_event is not None:
            on_event(event)
        if follow is not None:
            follow(line)
        if not _is_progress(line, event) or throttle.ready():
            logger.info("[%s] %s", node, line)

    return sink


class TrainingProgress:
    """Follows rank 0's step lines: moves a Prefect progress artifact and records the loss curve of the run.

    The curve goes to `<run dir>/loss.csv` beside summary.json, where the report draws it from.
    """

    def __init__(self, total_steps: int, run_id: str) -> None:
        self.total_steps = total_steps
        self.curve_path = run_dir(run_id) / LOSS_CURVE
        self.curve_path.parent.mkdir(parents=True, exist_ok=True)
        self.curve_path.write_text("step,loss\n")
        self._throttle = Throttle(PROGRESS_ARTIFACT_INTERVAL_S)
        # Created here, on the task's thread, so the artifact belongs to the run; lines arrive on other threads.
        self.artifact_id = create_progress_artifact(0.0, description=f"training: 0/{total_steps} steps")
        self.last_step = 0  # the newest step rank 0 reported: how far training got when a node was lost

    def follow(self, line: str) -> None:
        match = STEP_LINE.match(line)
        if match is None:
            return
        step, loss = int(match.group(1)), float(match.group(3))
        self.last_step = max(self.last_step, step)
        with self.curve_path.open("a") as curve:
            curve.write(f"{step},{loss}\n")
        if self._throttle.ready() or step >= self.total_steps:
            update_progress_artifact(self.artifact_id, min(100.0, 100.0 * step / self.total_steps),
                                     description=f"training: {step}/{self.total_steps} steps, loss {loss:.4f}")


def read_loss_curve(directory: Path) -> list[tuple[int, float]]:
    path = directory / LOSS_CURVE
    if not path.is_file():
        return []
    rows = [line.split(",") for line in path.read_text().splitlines()[1:] if line.strip()]
    return [(int(step), float(loss)) for step, loss in rows]


def last_event(output: str, name: str) -> dict[str, Any]:
    """The last event of that name a command printed; its absence means the command broke its contract."""
    for line in reversed(output.splitlines()):
        event = parse(line)
        if event is not None and event["event"] == name:
            return event
    raise RuntimeError(f"no '{name}' event in the command's output: {output.strip().splitlines()[-1:]}")
