"""How far a training script got and how its loss went, read from what it writes anyway.

Two sources, one shape (Point):
- the metrics file (TRAINPIPE_METRICS_FILE): JSON lines. A line with an integer "step" is a point ("loss" and any
  other numbers ride along: "total_steps" or "max_steps" give the progress bar its end). A line without a step is
  a fact about the whole run, kept as is: the report shows "eval_loss", "loss_floor" (the loss a perfect model
  reaches, drawn on the loss curve) and "breakdown" (trainer.step_timing's split of the step time); an "event":
  "checkpoint" line (trainer.checkpoint's saves) goes into the checkpoints table.
- the log lines of frameworks that print their progress: Hugging Face Trainer (its tqdm bar `12/100 [` and the
  dicts it logs, `{'loss': '2.31', ...}`) and Lightning (its tqdm bar `Epoch 1: 45%|...| 45/100 [..., train_loss=2.31]`,
  or the rich one, drawn once an epoch off a terminal: `Epoch 1/... ━━━ 100/100 ... train_loss: 2.31`), so an
  unchanged script still shows progress. The metrics file wins where both speak.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

_TRAINING_BAR = re.compile(r"^\s*\d+%\|[^|]*\|\s*(\d+)/(\d+) \[")  # HF's bar has no label
_HF_LOG = re.compile(r"^\s*(\{'.*\})\s*$")
_LIGHTNING_BAR = re.compile(r"^Epoch (\d+):\s+\d+%\|[^|]*\|\s*(\d+)/(\d+) \[([^\]]*)\]")
# Lightning's RichProgressBar (the default where `rich` is installed) draws once per epoch off a terminal.
_LIGHTNING_RICH = re.compile(r"^Epoch (\d+)/\S+ \S* ?(\d+)/(\d+) (.*)$")
_ANY_BAR = re.compile(r"^[^|]{0,80}\d+%\|")
_LIGHTNING_LOSS = re.compile(r"(?:^|[ ,])(?:train_)?loss(?:_step)?(?:=|: )([0-9.eE+-]+|nan)")
TOTAL_KEYS = ("total_steps", "max_steps")


def is_progress_bar(line: str) -> bool:
    """A redraw of a progress bar: worth a log line only now and then."""
    return bool(_ANY_BAR.match(line))


@dataclass(frozen=True)
class Point:
    step: int
    loss: float | None = None
    total_steps: int | None = None
    values: dict[str, Any] = field(default_factory=dict)
    at: float | None = None  # when the step ended (the record's own "time" where it has one), unix seconds


@dataclass
class StepClock:
    """When training's steps ran, from the points as they come: the time to the first step and the steps' own time.

    A point's time is the record's own `time` where the script writes one, else when it was read (the metrics file
    is read every second, a framework's log line at once)."""

    first: tuple[int, float] | None = None  # (step, time) of the first point
    last: tuple[int, float] | None = None

    def add(self, point: Point, arrived_at: float) -> None:
        at = point.at if point.at is not None else arrived_at
        if self.first is None:
            self.first = (point.step, at)
        self.last = (point.step, at)

    @property
    def first_step_at(self) -> float | None:
        return self.first[1] if self.first is not None else None

    def steps_s(self) -> float:
        """From the first logged step's end to the last one's, plus one step's worth for the first step itself."""
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return 0.0
        span = self.last[1] - self.first[1]
        return span * (self.last[0] - self.first[0] + 1) / (self.last[0] - self.first[0])


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def point_from_record(record: dict[str, Any]) -> Point | None:
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    total = next((int(record[k]) for k in TOTAL_KEYS if isinstance(record.get(k), int)), None)
    return Point(step, _number(record.get("loss")), total, record, _number(record.get("time")))


class MetricsFile:
    """Incremental reader of a metrics file: bytes in as they grow, whole JSON records out."""

    def __init__(self) -> None:
        self.offset = 0
        self._partial = b""

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self.offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # not ours to police: a script may print anything into its own file
            if isinstance(record, dict):
                records.append(record)
        return records


class LogRecognizer:
    """Turns a framework's own progress lines into points."""

    def __init__(self) -> None:
        self._step: int | None = None
        self._total: int | None = None

    def feed(self, line: str) -> Point | None:
        bar = _TRAINING_BAR.match(line)
        if bar:
            self._step, self._total = int(bar.group(1)), int(bar.group(2))
            return None
        logged = _HF_LOG.match(line)
        if logged:
            return self._hf_log(logged.group(1))
        epoch = _LIGHTNING_BAR.match(line) or _LIGHTNING_RICH.match(line)
        if epoch:
            return self._lightning(epoch)
        return None

    def _hf_log(self, text: str) -> Point | None:
        try:
            logs = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return None
        if not isinstance(logs, dict) or self._step is None or "loss" not in logs:
            return None
        values = {key: (_number(value) if _number(value) is not None else value) for key, value in logs.items()}
        return Point(self._step, _number(logs["loss"]), self._total, values)

    def _lightning(self, match: re.Match[str]) -> Point | None:
        epoch, batch, batches = int(match.group(1)), int(match.group(2)), int(match.group(3))
        loss = _LIGHTNING_LOSS.search(match.group(4))
        if loss is None:
            return None
        return Point(epoch * batches + batch, _number(loss.group(1)), None, {"epoch": epoch})
