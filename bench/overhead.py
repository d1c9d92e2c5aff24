"""`trainpipe bench overhead CONFIG`: where a run's time goes outside its training steps.

Runs `trainpipe run CONFIG` as a user does (its own process, a temporary Prefect server), then splits the wall time
from the run's summary: the command's start and the server before the flow, each phase, inside training the start-up
before the first step and what follows the last one, and the report and exit after the flow. Overhead is the wall
time minus the training steps' own time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from infra.job.spec import load_job
from infra.job.summary import PHASES
from infra.workspace import runs_dir

PHASES_BEFORE_TRAINING = ("plan", "provision", "verify", "stage")


class OverheadBenchError(RuntimeError):
    """The run the bench measures did not complete: the message says why and where its summary is."""


@dataclass(frozen=True)
class OverheadReport:
    run_id: str
    wall_s: float
    steps_s: float
    overhead_s: float
    time_to_first_step_s: float
    rows: list[tuple[str, float]]  # (what, seconds), in the order they happen
    target_s: float | None

    def table(self) -> str:
        lines = [f"run {self.run_id}: {self.wall_s:.1f}s wall, {self.steps_s:.1f}s of training steps"]
        lines += [f"  {what:<46} {seconds:7.1f}s" for what, seconds in self.rows]
        share = self.overhead_s / self.wall_s if self.wall_s else 0.0
        lines.append(f"overhead {self.overhead_s:.1f}s ({share:.0%} of the wall), first step after "
                     f"{self.time_to_first_step_s:.1f}s")
        if self.target_s is not None:
            verdict = "met" if self.overhead_s <= self.target_s else "MISSED"
            lines.append(f"target: overhead <= {self.target_s:g}s: {verdict}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def split(summary: dict[str, Any], wall_s: float) -> list[tuple[str, float]]:
    """The run's wall time, piece by piece (recoveries add their phases into the same names)."""
    phases = summary["phases"]
    before_flow = summary["flow_started_s"]
    reached_training = before_flow + sum(phases.get(name, 0.0) for name in PHASES_BEFORE_TRAINING)
    first_step_ends = summary["time_to_first_step_s"]
    steps = summary["steps_s"]
    # The first step's own duration is in the steps' time; the rest up to its end is start-up.
    one_step = steps / max(summary["steps"] - summary["start_step"] + 1, 1)
    startup = max(0.0, first_step_ends - one_step - reached_training)
    after_last_step = max(0.0, phases.get("train", 0.0) - startup - steps)
    rows = [("command start, Prefect server, plan check", before_flow)]
    rows += [(f"phase {name}", phases[name]) for name in PHASES_BEFORE_TRAINING if name in phases]
    rows += [("train: start-up before the first step", startup), ("train: the steps themselves", steps),
             ("train: after the last step (last save, flush)", after_last_step)]
    rows += [(f"phase {name}", phases[name]) for name in PHASES if name in phases and name not in
             (*PHASES_BEFORE_TRAINING, "train")]
    rows.append(("report, server stop, exit", max(0.0, wall_s - before_flow - sum(phases.values()))))
    return [(what, round(seconds, 2)) for what, seconds in rows]


def run_overhead_bench(config: Path, target_s: float | None = None, echo: Any = print) -> OverheadReport:
    job = load_job(config)  # a bad config is the user's error, before anything runs
    run_id = f"overhead-{job.name}-{uuid.uuid4().hex[:6]}"
    echo(f"running {config} as run {run_id} ...")
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("TRAINPIPE_LAUNCHED_AT", None)  # the run's own command starts the clock
    trainpipe = Path(sys.executable).with_name("trainpipe")
    started = time.time()
    result = subprocess.run([str(trainpipe), "run", str(config), "--run-id", run_id], env=env, capture_output=True,
                            text=True)
    wall_s = time.time() - started
    summary_path = runs_dir() / run_id / "summary.json"
    if result.returncode != 0 or not summary_path.is_file():
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise OverheadBenchError(f"run {run_id} exited {result.returncode}: {' | '.join(tail)}")
    summary = json.loads(summary_path.read_text())
    # The summary's clock starts with the run's own process: the bench's wall includes only what it can see too.
    wall_s = summary["finished_at"] - summary["started_at"]
    return OverheadReport(run_id=run_id, wall_s=round(wall_s, 2), steps_s=summary["steps_s"],
                          overhead_s=summary["overhead_s"], time_to_first_step_s=summary["time_to_first_step_s"],
                          rows=split(summary, wall_s), target_s=target_s)
