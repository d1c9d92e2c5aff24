"""Node output into the Prefect run log, labelled with the node, and node events picked out of it.

Progress lines (transfer `progress` events, a framework's progress bar) arrive several times a second; they are
logged at most once per PROGRESS_LOG_INTERVAL_S per node so the run log stays readable. Every other line, errors
above all, is logged as it comes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from infra.compute.access.remote import Runner
from infra.node.events import Event, NodeEvent, Throttle, WorkloadEvent, parse
from infra.workload.progress import LogRecognizer, MetricsFile, Point, StepClock, is_progress_bar, point_from_record
from infra.workspace import run_dir

PROGRESS_LOG_INTERVAL_S = 5.0
PROGRESS_ARTIFACT_INTERVAL_S = 2.0
LOSS_CURVE = "loss.csv"


def _is_progress(line: str, event: Event | None) -> bool:
    return (event is not None and event.kind is NodeEvent.PROGRESS) or is_progress_bar(line)


def node_line_sink(logger: logging.Logger | logging.LoggerAdapter[Any], node: str,
                   on_event: Callable[[Event], None] | None = None,
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
    """Follows the script's progress on the head node (global rank 0): its metrics file, else its framework's own
    log lines; moves a Prefect progress artifact and records the run's loss curve.

    The curve goes to `<run dir>/loss.csv` beside summary.json (every attempt of the flow run adds to it), where the
    report draws it from. Facts (metrics records without a step) and checkpoint events are kept for the summary.
    """

    def __init__(self, run_id: str) -> None:
        self.curve_path = run_dir(run_id) / LOSS_CURVE
        if not self.curve_path.is_file():
            start_loss_curve(run_id)
        self._throttle = Throttle(PROGRESS_ARTIFACT_INTERVAL_S)
        # Created here, on the task's thread, so the artifact belongs to the run; lines arrive on other threads.
        self.artifact_id = create_progress_artifact(0.0, description="training: starting")
        self._lock = threading.Lock()
        self._metrics = MetricsFile()
        self._log = LogRecognizer()
        self._from_metrics = False  # once the script's metrics file speaks, framework log lines are ignored
        self.points: list[Point] = []
        self.facts: dict[str, Any] = {}
        self.checkpoint_events: list[dict[str, Any]] = []
        self.total_steps: int | None = None
        self.last_step = 0  # the newest step rank 0 reported: how far training got when a node was lost
        self.clock = StepClock()
        # Each record of the metrics file as read, for the run's experiment tracker (tasks.tracking.record_sink)
        self.on_record: Callable[[dict[str, Any]], None] | None = None

    def follow(self, line: str) -> None:
        """A line the head node's script printed."""
        point = self._log.feed(line)
        if point is not None and not self._from_metrics:
            self._add(point)

    def poll_metrics(self, runner: Runner, path: str) -> None:
        """Read what the script appended to its metrics file since the last poll."""
        data = runner.read_from(path, self._metrics.offset)
        if not data:
            return
        for record in self._metrics.feed(data):
            if self.on_record is not None:
                self.on_record(record)
            point = point_from_record(record)
            if record.get("event") == WorkloadEvent.CHECKPOINT:
                self.checkpoint_events.append(record)
            elif point is not None:
                self._from_metrics = True
                self._add(point)
            else:
                self.facts.update(record)

    def _add(self, point: Point) -> None:
        with self._lock:
            self.points.append(point)
            self.clock.add(point, time.time())
            self.last_step = max(self.last_step, point.step)
            self.total_steps = point.total_steps or self.total_steps
            if point.loss is not None:
                with self.curve_path.open("a") as curve:
                    curve.write(f"{point.step},{point.loss}\n")
            if not self._throttle.ready() and point.step != self.total_steps:
                return
        loss = f", loss {point.loss:.4f}" if point.loss is not None else ""
        if self.total_steps:
            update_progress_artifact(self.artifact_id, min(100.0, 100.0 * point.step / self.total_steps),
                                     description=f"training: {point.step}/{self.total_steps} steps{loss}")
        else:
            update_progress_artifact(self.artifact_id, 0.0, description=f"training: step {point.step}{loss}")


def start_loss_curve(run_id: str) -> None:
    """A new flow run of this run id starts its curve afresh (its recoveries add to it)."""
    path = run_dir(run_id) / LOSS_CURVE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("step,loss\n")


def read_loss_curve(directory: Path) -> list[tuple[int, float]]:
    path = directory / LOSS_CURVE
    if not path.is_file():
        return []
    rows = [line.split(",") for line in path.read_text().splitlines()[1:] if line.strip()]
    return [(int(step), float(loss)) for step, loss in rows]


def last_event(output: str, kind: NodeEvent) -> Event:
    """The last event of that name a command printed; its absence means the command broke its contract."""
    for line in reversed(output.splitlines()):
        event = parse(line)
        if event is not None and event.kind is kind:
            return event
    raise RuntimeError(f"no '{kind}' event in the command's output: {output.strip().splitlines()[-1:]}")
