"""`trainpipe bench repro`: the study's table (network first, storage second), reproduced on an emulated cluster.

The study (SkyPilot on Nebius, DESIGN.md) moved one fine-tuning job from 10 Gbit Ethernet to InfiniBand and from a
mounted object store to local NVMe. Scaled down to one Linux machine: a 2-node `netns` cluster whose links are
shaped with tc tbf, and an `rclone serve s3` store in its own namespace behind a link shaped the same way. The same
training job runs three times through the retrain flow:

    (a) slow links  + dataset read from the store per batch, checkpoints written to the store (blocking)
    (b) fast links  + the same remote data and checkpoints
    (c) fast links  + dataset staged to each node's disk, async checkpoints uploaded in the background

Each run reports its step-time breakdown (trainer.step_timing). The predictor (infra.analysis.predict) estimates
(b) and (c) from (a)'s breakdown and the link rates alone; the table sets its estimates against the measurements.

What is compared is the job time that the configurations change: staging plus the training steps. The fixed cost
of every run (provisioning namespaces, starting torchrun and its interpreters, the final evaluation) is reported
beside it, not folded in: it is the same in all three and would only dilute the ratios.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.trainer_flags import ModelShape
from infra.analysis.breakdown import StepBreakdown
from infra.dataset.synth import synthesize
from infra.job.spec import JobSpec
from infra.storage import open_store

STUDY_SHAPE = "network first, storage second: speedup(b vs a) > speedup(c vs b) > 1"
PREDICTION_TOLERANCE = 0.20
DATA_BUCKET = "data"
CKPT_BUCKET = "checkpoints"
MODEL = ModelShape(d_model=256, n_layers=2, n_heads=4)


class ReproError(RuntimeError):
    """The benchmark could not run; the message names what is missing and the fix."""


@dataclass(frozen=True)
class ReproConfig:
    slow_mbit: float = 100.0
    fast_mbit: float = 1000.0
    steps: int = 60
    ckpt_every: int = 20
    model: ModelShape = MODEL
    batch_size: int = 8
    dataset_tokens: int = 2_000_000
    nodes: int = 2
    workdir: Path | None = None


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    fast_links: bool
    access: str  # DatasetSpec.access
    ckpt_mode: str  # the bundled trainer's --ckpt-mode


SCENARIOS = (
    Scenario("a", "slow links + remote store", fast_links=False, access="remote", ckpt_mode="direct"),
    Scenario("b", "fast links + remote store", fast_links=True, access="remote", ckpt_mode="direct"),
    Scenario("c", "fast links + staged to local disk + async checkpoints", fast_links=True, access="staged",
             ckpt_mode="async"),
)


@dataclass
class ScenarioResult:
    key: str
    title: str
    link_mbit: float
    status: str
    run_id: str
    stage_s: float
    loop_s: float
    fixed_s: float  # everything else the run took: provisioning, torchrun start-up, verify, sync, teardown
    terms_s: dict[str, float]
    breakdown: dict[str, Any]
    final_loss: float | None
    speedup: float | None = None
    predicted_job_s: float | None = None
    predicted_speedup: float | None = None

    @property
    def job_s(self) -> float:
        return self.stage_s + self.loop_s

    def prediction_error(self) -> float | None:
        if self.predicted_speedup is None or not self.speedup:
            return None
        return self.predicted_speedup / self.speedup - 1.0


@dataclass
class ReproReport:
    config: dict[str, Any]
    results: list[ScenarioResult]
    prediction_notes: list[str] = field(default_factory=list)

    def shape_matches(self) -> bool:
        a, b, c = (r.job_s for r in self.results)
        return a / b > b / c > 1.0

    def predictor_within_tolerance(self) -> bool:
        errors = [r.prediction_error() for r in self.results[1:]]
        return all(e is not None and abs(e) <= PREDICTION_TOLERANCE for e in errors)

    def table(self) -> str:
        head = (f"{'config':<58} {'job s':>7} {'T_compute':>9} {'T_network':>9} {'T_io':>7} {'speedup':>8} "
                f"{'predicted':>9} {'error':>7} {'fixed s':>8}")
        lines = [head, "-" * len(head)]
        for r in self.results:
            error = r.prediction_error()
            lines.append(
                f"({r.key}) {r.title + f' @ {r.link_mbit:g} Mbit':<54} {r.job_s:>7.1f} "
                f"{r.terms_s['T_compute']:>9.1f} {r.terms_s['T_network']:>9.1f} {r.terms_s['T_io']:>7.1f} "
                f"{_times(r.speedup):>8} {_times(r.predicted_speedup):>9} "
                f"{'' if error is None else f'{error:+.0%}':>7} {r.fixed_s:>8.1f}")
        a, b, c = self.results
        lines += [
            "",
            "job s = staging + training steps; T_* = the trainer's step-time breakdown (seconds, all steps); "
            "fixed s = the rest of the run (same work in every configuration)",
            f"speedups: network (b vs a) {a.job_s / b.job_s:.2f}×, storage (c vs b) {b.job_s / c.job_s:.2f}×, "
            f"both (c vs a) {a.job_s / c.job_s:.2f}×",
            f"study's shape ({STUDY_SHAPE}): {'matches' if self.shape_matches() else 'DOES NOT match'}",
            f"predictor (from (a) alone) within {PREDICTION_TOLERANCE:.0%} of the measured speedups: "
            f"{'yes' if self.predictor_within_tolerance() else 'NO'}",
            *self.prediction_notes,
        ]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"config": self.config, "study_shape": STUDY_SHAPE, "shape_matches": self.shape_matches(),
                           "predictor_within_tolerance": self.predictor_within_tolerance(),
                           "results": [{**asdict(r), "job_s": r.job_s, "prediction_error": r.prediction_error()}
                                       for r in self.results]}, indent=2)


def _times(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}×"


def job_for(scenario: Scenario, config: ReproConfig, link_mbit: float) -> JobSpec:
    return JobSpec.model_validate({
        "name": f"repro-{scenario.key}",
        "cluster": {"provider": "netns", "nodes": config.nodes, "netns": {"link_mbit": link_mbit},
                    # Only (a)'s disk figure is used (the predictor's local-disk term); the rest is reported.
                    "verify": {"bench": "warn", "tcp_seconds": 1, "allreduce_sizes_mb": [4], "disk_bytes_mb": 64}},
        "dataset": {"url": f"s3://{DATA_BUCKET}/markov", "validation": "sample", "access": scenario.access},
        # direct waits for each upload, so the syncer looks often; the others keep the default.
        "checkpoints": {"url": f"s3://{CKPT_BUCKET}/repro", "keep": 2, "format": "marker",
                        "sync_poll_s": 0.05 if scenario.ckpt_mode == "direct" else 0.5},
        "training": {"command": [
            "-m", "trainer.train", "--steps", str(config.steps), "--ckpt-every", str(config.ckpt_every),
            "--ckpt-mode", scenario.ckpt_mode, "--batch-size", str(config.batch_size), "--warmup-steps", "5",
            "--lr", "3e-3", *config.model.flags(),
            # remote access reads every batch from the store; staged reads TRAINPIPE_DATA_DIR by default.
            *(("--data-url", "{data_url}") if scenario.access == "remote" else ())]},
    })


def _result(scenario: Scenario, link_mbit: float, run_id: str, summary: dict[str, Any]) -> ScenarioResult:
    if summary.get("status") != "completed" or not summary.get("breakdown"):
        raise ReproError(f"configuration ({scenario.key}) {scenario.title}: run {run_id} {summary.get('status')}: "
                         f"{summary.get('error') or 'no step breakdown in its summary'}: see its summary.json")
    breakdown = StepBreakdown.from_dict(summary["breakdown"])
    # The stage agent's own transfer time: its interpreter start-up is fixed cost, like torchrun's.
    stage_s = (summary.get("stage") or {}).get("seconds", 0.0)
    total_s = sum(summary["phases"].values())
    return ScenarioResult(
        key=scenario.key, title=scenario.title, link_mbit=link_mbit, status=summary["status"], run_id=run_id,
        stage_s=stage_s, loop_s=breakdown.wall_s, fixed_s=total_s - stage_s - breakdown.wall_s,
        terms_s=breakdown.terms(), breakdown=summary["breakdown"], final_loss=summary.get("final_loss"))


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """The store's endpoint and keys for this process and, through it, every node the flow starts."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_repro(config: ReproConfig, run_job: Callable[[JobSpec, str], dict[str, Any]],
              echo: Callable[[str], None] = print) -> ReproReport:
    """Run the three configurations one after another on one store; run_job runs the retrain flow."""
    from infra.compute.providers.netns.store import NetnsStore

    with tempfile.TemporaryDirectory(prefix="trainpipe-repro-", dir=config.workdir) as tmp:
        root = Path(tmp) / "store"
        (root / CKPT_BUCKET).mkdir(parents=True)
        echo(f"writing a {config.dataset_tokens:,}-token dataset into the store's bucket '{DATA_BUCKET}'")
        manifest = synthesize(open_store(str(root / DATA_BUCKET / "markov")), config.dataset_tokens,
                              shard_tokens=500_000)
        with NetnsStore(root, link_mbit=config.slow_mbit) as store, _environment(store.env()):
            results, first_summary = [], None
            for scenario in SCENARIOS:
                link_mbit = config.fast_mbit if scenario.fast_links else config.slow_mbit
                store.set_link_mbit(link_mbit)
                run_id = f"repro-{scenario.key}-{time.strftime('%Y%m%d%H%M%S')}"
                echo(f"({scenario.key}) {scenario.title}: links {link_mbit:g} Mbit/s, run {run_id}")
                summary = run_job(job_for(scenario, config, link_mbit), run_id)
                result = _result(scenario, link_mbit, run_id, summary)
                first_summary = first_summary or summary
                echo(f"({scenario.key}) done: job {result.job_s:.1f} s "
                     f"({StepBreakdown.from_dict(result.breakdown).dominant()})")
                results.append(result)
    for result in results:
        result.speedup = results[0].job_s / result.job_s
    dataset_bytes = sum(shard.bytes for shard in manifest.shards)
    notes = predict_from_first(results, first_summary, config, dataset_bytes)
    return ReproReport(config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
                       results=results, prediction_notes=notes)


def predict_from_first(results: list[ScenarioResult], first_summary: dict[str, Any], config: ReproConfig,
                       dataset_bytes: int) -> list[str]:
    """The predictor's job time for (b) and (c) from (a)'s breakdown alone, set on the results; returns notes.

    The link rates are the configured ones on both sides (the ratio is what matters, and the shaping sets it);
    (a)'s own cluster bench supplies the local disk figures that the staged configuration reads at."""
    from infra.analysis.predict import Job, Target, predict
    from infra.analysis.predict_report import facts_from_summary

    first = results[0]
    measured_disk = facts_from_summary(first_summary, first.run_id).measured
    measured = replace(measured_disk, network_gbps=config.slow_mbit / 1000, store_gbps=config.slow_mbit / 1000)
    breakdown = StepBreakdown.from_dict(first.breakdown)
    job = Job(steps=breakdown.steps, dataset_bytes=dataset_bytes)
    notes = [f"predictor inputs: (a)'s breakdown; links {config.slow_mbit:g} → {config.fast_mbit:g} Mbit/s; local "
             f"disk {measured.local_disk_read_mb_s:.0f} MB/s read (a's cluster bench); the final checkpoint flush "
             "is left out on both sides"]
    for result, scenario in zip(results, SCENARIOS, strict=True):
        rate = (config.fast_mbit if scenario.fast_links else config.slow_mbit) / 1000
        target = replace(measured, network_gbps=rate, store_gbps=rate, label=f"({scenario.key})")
        prediction = predict(breakdown, measured, Target(target, None, "scenario", staged=scenario.access == "staged"),
                             job)
        result.predicted_job_s = prediction.job_s - prediction.flush_s
        result.predicted_speedup = first.job_s / result.predicted_job_s
    return notes
