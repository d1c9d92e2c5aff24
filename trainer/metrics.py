"""Training metrics: JSON lines for machines (the metrics file) and one flushed line per log for humans (stdout)."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from infra.analysis.breakdown import StepBreakdown
from trainer.checkpoint import SaveRecord
from trainer.step_timing import StepSplit

# final_loss averages this many steps so one noisy batch does not decide the reported result.
FINAL_LOSS_WINDOW = 10


class TrainingMetrics:
    """Every rank records (losses are all-reduced, so identical); only the writer (global rank 0) emits."""

    def __init__(
        self,
        metrics_file: Path | None,
        log_every: int,
        first_step: int,
        last_step: int,
        recent_losses: Iterable[float] = (),
    ) -> None:
        if log_every < 1:
            raise ValueError(f"log_every={log_every}: log at least every step (--log-every >= 1)")
        self.metrics_file = metrics_file
        self.log_every = log_every
        self.first_step = first_step
        self.last_step = last_step
        self.initial_loss: float | None = None
        # Carried across a resume so final_loss covers the last steps even when this run is shorter.
        self._recent = deque(recent_losses, maxlen=FINAL_LOSS_WINDOW)
        self._loss_and_lr: tuple[float, float] | None = None  # the step's, until end_step logs it
        self._interval = StepSplit()
        self._interval_tokens = 0
        if metrics_file is not None:
            metrics_file.parent.mkdir(parents=True, exist_ok=True)

    @property
    def recent_losses(self) -> list[float]:
        return list(self._recent)

    def _should_log(self, step: int) -> bool:
        return step % self.log_every == 0 or step in (self.first_step, self.last_step)

    def record(self, step: int, loss: float, lr: float) -> None:
        """The step's loss, as soon as it is known: a checkpoint of this step saves recent_losses with it."""
        if self.initial_loss is None:
            self.initial_loss = loss
        self._recent.append(loss)
        self._loss_and_lr = (loss, lr)

    def end_step(self, step: int, split: StepSplit, tokens: int) -> None:
        """After the step's checkpoint handling, so its save shows in the interval of the step that paid for it."""
        if self._loss_and_lr is None:
            raise ValueError(f"step {step}: end_step before record: record the step's loss first")
        self._interval += split
        self._interval_tokens += tokens
        if not self._should_log(step):
            return
        (loss, lr), interval = self._loss_and_lr, self._interval
        step_s = interval.wall_s / max(interval.steps, 1)
        tokens_per_s = self._interval_tokens / interval.wall_s if interval.wall_s > 0 else 0.0
        self._interval, self._interval_tokens = StepSplit(), 0
        parts = interval.per_step_ms()
        self._emit(
            {"step": step, "loss": loss, "total_steps": self.last_step, "lr": lr, "step_s": step_s,
             "tokens_per_s": tokens_per_s, **parts, "time": time.time()},
            f"step {step}/{self.last_step} loss {loss:.4f} lr {lr:.2e} {step_s * 1000:.1f} ms/step "
            f"{tokens_per_s:,.0f} tok/s (compute {parts['compute_ms']:.1f}, comm {parts['comm_exposed_ms']:.1f} "
            f"exposed of {parts['comm_total_ms']:.1f}, sync {parts['sync_ms']:.1f}, data {parts['data_ms']:.1f}, "
            f"ckpt {parts['ckpt_ms']:.1f} ms)",
        )

    def checkpoint(self, record: SaveRecord) -> None:
        """A save that finished: the stall is what training paid, the write what the background did."""
        self._emit(
            {**record.to_event(), "time": time.time()},
            f"checkpoint step {record.step} ({record.mode}): training stalled {record.stall_s:.3f} s, "
            f"written in {record.write_s:.2f} s ({record.bytes / 1e6:.1f} MB on this node)",
        )

    def fact(self, **values: Any) -> None:
        """Something true of the whole run (not of one step), for the run's summary."""
        self._emit(dict(values), ", ".join(f"{key}: {value}" for key, value in values.items()))

    def done(self, eval_loss: float, breakdown: StepBreakdown | None = None) -> dict[str, Any]:
        if not self._recent:
            raise ValueError("no training step was recorded: cannot report a final loss")
        record: dict[str, Any] = {"eval_loss": eval_loss, "final_loss": sum(self._recent) / len(self._recent)}
        line = f"done: {self.last_step} steps, final loss {record['final_loss']:.4f}, eval loss {eval_loss:.4f}"
        if breakdown is not None:
            record["breakdown"] = breakdown.to_dict()
            line += f"; {breakdown.dominant()}"
        self._emit(record, line)
        return record

    def _emit(self, record: dict[str, Any], line: str) -> None:
        if self.metrics_file is None:
            return
        with open(self.metrics_file, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        print(line, flush=True)
