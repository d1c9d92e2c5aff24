"""The record of one run: what ran, how long each phase took, what it produced. Written as summary.json."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

LAUNCHED_AT_VAR = "TRAINPIPE_LAUNCHED_AT"  # set by `trainpipe run`: when the command started, unix seconds
PHASES = ("plan", "provision", "verify", "stage", "train", "sync", "evaluate", "promote", "teardown")
# The cluster is paid for from the start of provisioning to the end of teardown: every phase but plan.
BILLED_PHASES = PHASES[1:]


@contextmanager
def timed_into(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Adds the block's seconds to seconds[name] (phases run more than once add up), also when it fails."""
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[name] = round(seconds.get(name, 0.0) + time.perf_counter() - started, 3)


class ClusterBenchRecord(Protocol):
    """What the summary needs of the verify stage's bench (infra.analysis.clusterbench.VerifyBench, a room beside
    this one): the flow reads it as a record while the run goes on; summary.json holds its to_dict()."""

    @property
    def slowest_link_gbps(self) -> float | None: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class WrittenClusterBench:
    """A cluster_bench section read back from summary.json: the JSON the bench's record wrote, unchanged."""

    section: dict[str, Any]

    @property
    def slowest_link_gbps(self) -> float | None:
        links = self.section.get("measurement", {}).get("links", [])
        return min((link["gbps"] for link in links), default=None)

    def to_dict(self) -> dict[str, Any]:
        return self.section


@dataclass
class RunSummary:
    run_id: str
    job: str
    provider: str
    nodes: int
    status: str = "running"
    error: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    start_step: int = 0  # the first step this run executed (1 unless it resumed)
    initial_loss: float | None = None
    final_loss: float | None = None
    final_eval_loss: float | None = None
    loss_floor: float | None = None
    checkpoint: str | None = None
    checkpoint_step: int | None = None
    nodes_left: int | None = None
    teardown_error: str | None = None  # the run's own teardown failed: what it left needs `trainpipe down`
    stage: dict[str, Any] = field(default_factory=dict)
    # Whether the nodes filled each other at staging: `ran`, or `off: <why>` (tasks.fanout.outcome, from the nodes'
    # events); None: the run did not reach staging.
    fanout: str | None = None
    dataset: dict[str, Any] = field(default_factory=dict)  # infra.dataset.planning.DatasetPlan.summary()
    # per input: its DatasetPlan.summary() and its staging: fetched_bytes, reused_bytes (from the node's cache),
    # seconds (the most on any node) and mb_per_s (the slowest node's)
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # per step: stall, write, upload, commit
    resumed_from_step: int | None = None  # the committed step this run restored (None: started fresh)
    resume_bytes: dict[str, int] = field(default_factory=dict)  # its bytes, every node's, by source (store, peer, …)
    warnings: list[str] = field(default_factory=list)  # e.g. a damaged checkpoint skipped on resume
    instance_type: str | None = None
    market: str | None = None
    price_per_hour: float | None = None  # the whole cluster, USD
    cost_usd: float | None = None  # price_per_hour × the billed phases' seconds
    attempts: list[dict[str, Any]] = field(default_factory=list)  # every launch attempt, in order
    node_reports: dict[str, dict[str, Any]] = field(default_factory=dict)  # per node: mount, GPUs, interfaces
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # lifecycle.recovery.RecoveryRecord per preemption
    cluster_bench: ClusterBenchRecord | None = None  # the verify stage's figures and verdict (None: not benched)
    breakdown: dict[str, Any] = field(default_factory=dict)  # analysis.breakdown.StepBreakdown.summary(): where step
    # time went (T_compute / T_network / T_io)
    workload: dict[str, Any] = field(default_factory=dict)  # code, its sha256, command, config hash, setup_s
    # Where the training ran: kind, image and the digest every node pulled (pull_s: the slowest node's), python, and
    # per node what verify found in it (nodes: name -> {python, torch})
    training_env: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)  # what the script reported about the whole run
    init_from: str | None = None  # training.init_from's step URL when the run warm-started from it
    eval: dict[str, Any] = field(default_factory=dict)  # tasks.evaluate.Evaluation: checkpoint, step, metrics, seconds
    promotion: dict[str, Any] = field(default_factory=dict)  # tasks.promote.Decision, and decided_after_training_s
    # The run's MLflow run (infra.tracking.mlflow_run.TrackingOutcome) and the registry's mirror of its promotion;
    # what was not recorded there is said here. Empty: the job has no tracking section.
    tracking: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)  # the command's start where a command launched the run
    finished_at: float | None = None
    flow_started_s: float | None = None  # from started_at to the flow's own start (command, Prefect server, plan)
    time_to_first_step_s: float | None = None  # from started_at to the end of the first training step
    steps_s: float = 0.0  # the training steps' own time, every attempt's
    overhead_s: float | None = None  # the run's wall time minus the steps' own time: what orchestration cost

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Times a phase; the time is recorded even when the phase fails."""
        return timed_into(self.phases, name)

    def record_launch(self, instance_type: str | None, market: str, price_per_hour: float,
                      attempts: list[dict[str, Any]]) -> None:
        self.instance_type, self.market, self.price_per_hour = instance_type, market, price_per_hour
        self.attempts.extend(attempts)  # a recovery launches again: its attempts follow the first launch's

    def __post_init__(self) -> None:
        if self.flow_started_s is None:
            self.flow_started_s = round(time.time() - self.started_at, 3)

    def trained(self, first_step_at: float | None, steps_s: float) -> None:
        """An attempt's training steps: when its first ended, and how long they took."""
        if first_step_at is not None and self.time_to_first_step_s is None:
            self.time_to_first_step_s = round(first_step_at - self.started_at, 3)
        self.steps_s = round(self.steps_s + steps_s, 3)

    def finish(self) -> None:
        """Stamps the end, the overhead and prices the run (the price is known only once a launch succeeded)."""
        self.finished_at = time.time()
        self.overhead_s = round(self.finished_at - self.started_at - self.steps_s, 3)
        if self.price_per_hour is not None:
            billed_s = sum(self.phases.get(name, 0.0) for name in BILLED_PHASES)
            self.cost_usd = round(self.price_per_hour * billed_s / 3600, 4)

    def resume_hint(self, config: str = "CONFIG") -> str:
        """What continues a failed or cancelled run: the same run id resumes from its latest commit."""
        start = f"from step {self.checkpoint_step}" if self.checkpoint_step is not None else "from the start"
        return f"trainpipe run {config} --run-id {self.run_id} (resumes {start})"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSummary:
        """A summary as summary.json holds it (to_dict's output), read back."""
        bench = data.get("cluster_bench")
        return cls(**{**data, "cluster_bench": WrittenClusterBench(bench) if bench else None})

    def to_dict(self) -> dict[str, Any]:
        bench = self.cluster_bench.to_dict() if self.cluster_bench is not None else {}
        return {**asdict(replace(self, cluster_bench=None)), "cluster_bench": bench}

    def write(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / "summary.json"
        tmp = directory / ".summary.json.tmp"
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        os.replace(tmp, target)
        return target

    def render(self) -> str:
        """The few lines a person reads at the end of `make run`."""
        lines = [f"run {self.run_id}: {self.status}" + (f" — {self.error}" if self.error else "")]
        lines.append("  phases: " + ", ".join(f"{name} {self.phases[name]:.1f}s" for name in PHASES
                                              if name in self.phases))
        if self.stage:
            lines.append(f"  staged: {self.stage.get('bytes', 0) / 1e6:.1f} MB per node at "
                         f"{self.stage.get('mb_per_s', 0):.0f} MB/s (slowest node), "
                         f"{self.stage.get('skipped_bytes', 0) / 1e6:.1f} MB already there")
        if self.fanout is not None:
            lines.append(f"  fanout: {self.fanout}")
        lines.extend(f"  input {name}: {fact}" for name, fact in input_facts(self.inputs).items())
        if self.workload:
            code = self.workload.get("code_sha256")
            lines.append(f"  workload: {' '.join(self.workload['command'])}"
                         + (f" (code sha256 {code[:12]}…" if code else " (no code shipped")
                         + f", setup {self.workload['setup_s']:.1f}s)")
        if self.training_env:
            env = self.training_env
            torches = sorted({n["torch"] for n in env.get("nodes", {}).values()})
            where = (f"image {env['image']}" + (f" ({env['digest']})" if env.get("digest") else "")
                     if env.get("image") else f"python {env.get('python')}")
            lines.append(f"  training environment: {env.get('kind')}, {where}"
                         + (f", torch {', '.join(torches)}" if torches else ""))
        if self.initial_loss is not None and self.final_loss is not None:
            floor = f" (floor {self.loss_floor:.3f})" if self.loss_floor is not None else ""
            lines.append(f"  loss: {self.initial_loss:.3f} at step {self.start_step} → {self.final_loss:.3f} "
                         f"at step {self.steps}{floor}")
        if self.overhead_s is not None and self.finished_at is not None:
            wall = self.finished_at - self.started_at
            first = (f", first step after {self.time_to_first_step_s:.1f}s" if self.time_to_first_step_s is not None
                     else "")
            lines.append(f"  overhead: {self.overhead_s:.1f}s of {wall:.1f}s ({self.overhead_s / wall:.0%}) outside "
                         f"the training steps' {self.steps_s:.1f}s{first}")
        if self.breakdown:
            shares = self.breakdown["shares"]
            lines.append(f"  step time: compute {shares['T_compute']:.0%}, network {shares['T_network']:.0%}, "
                         f"I/O {shares['T_io']:.0%} ({self.breakdown['dominant']})")
        if self.attempts:
            launched = [a for a in self.attempts if a["outcome"] == "launched"]
            place = (launched[0]["zone"] or launched[0]["region"]) if launched else None
            where = f"{self.nodes}× {self.instance_type} ({self.market}) in {place}" if place else "nothing launched"
            lines.append(f"  cluster: {where} after {len(self.attempts)} launch attempt(s)"
                         + (f", ${self.price_per_hour:.2f}/h, cost ${self.cost_usd:.4f}"
                            if self.cost_usd is not None and self.price_per_hour is not None else ""))
        if self.init_from:
            lines.append(f"  warm start: {self.init_from}")
        if self.eval:
            lines.append("  eval: " + ", ".join(f"{k} {v:.4f}" for k, v in self.eval["metrics"].items())
                         + f" ({self.eval['seconds']:.1f}s)")
        if self.promotion:
            lines.append(f"  {'promoted' if self.promotion['promoted'] else 'not promoted'}: "
                         f"{self.promotion['model']}@{self.promotion['alias']}: {self.promotion['reason']}")
        resumed = "" if self.resumed_from_step is None else f" (resumed from step {self.resumed_from_step}" + (
            f"; {restored_from(self.resume_bytes)})" if self.resume_bytes else ")")
        lines.append(f"  checkpoint: {self.checkpoint or 'none committed'}{resumed}")
        if self.status in ("failed", "cancelled"):
            lines.append(f"  resume: {self.resume_hint()}")
        stalls = [c["stall_s"] for c in self.checkpoints if c.get("stall_s") is not None]
        if stalls:
            lines.append(f"  checkpoints: {len(stalls)} saved, training stalled {sum(stalls) / len(stalls):.3f}s "
                         f"per checkpoint ({self.checkpoints[-1].get('mode')})")
        for r in self.recoveries:
            fallback = f" ({r['fallback']})" if r.get("fallback") else ""
            # A recovery that failed before training restarted has no resume to report.
            outcome = (f"resumed from step {r['resumed_from_step']} after {r['notice_to_resume_s']:.1f}s, "
                       f"{r['steps_lost']} steps redone" if r.get("notice_to_resume_s") is not None else
                       "did not resume")
            lines.append(f"  recovery {r['number']}: {', '.join(r.get('nodes') or [r['node']])} preempted "
                         f"({r['reason']}) at step {r['step_reached']}, {r.get('path', 'relaunched-cluster')}"
                         f"{fallback}, {outcome}"
                         + (f"; restore {restored_from(r['restore_bytes'])}" if r.get("restore_bytes") else ""))
        if self.tracking:
            lines.append(f"  mlflow: run {self.tracking.get('mlflow_run_id')} in {self.tracking['experiment']} at "
                         f"{self.tracking['uri']}" + (" (continued)" if self.tracking.get("continued") else ""))
            lines.extend(f"  mlflow: {error}" for error in self.tracking.get("errors", []))
        lines.extend(f"  warning: {warning}" for warning in self.warnings)
        if self.nodes_left is not None:
            lines.append(f"  {self.nodes_left} nodes left running")
        if self.teardown_error is not None:
            lines.append(f"  teardown failed: {self.teardown_error}: `trainpipe status` shows what is left, "
                         "`trainpipe down` ends it")
        return "\n".join(lines)


# Where a restore's bytes came from (each node's `restored` event: infra/node/restore.py), as the summary says it.
RESTORE_SOURCES = {"store": "from the store", "peer": "from peers", "local": "already on the nodes",
                   "replica": "from peer replicas"}


def restored_from(sources: dict[str, int]) -> str:
    """A restore's bytes by source, as the summary says them: "40.0 MB from the store, 80.0 MB from peers"."""
    return ", ".join(f"{count / 1e6:,.1f} MB {RESTORE_SOURCES.get(source, source)}"
                     for source, count in sources.items() if count) or "nothing to fetch"


def input_facts(inputs: dict[str, dict[str, Any]]) -> dict[str, str]:
    """One line per input: how much every node holds and how its staging went (the summary's and the report's)."""
    facts = {}
    for name, record in inputs.items():
        line = f"{record['bytes'] / 1e6:,.1f} MB ({record['files']:,} files) from {record['url']}"
        if "seconds" in record:
            line += (f"; staged in {record['seconds']:.1f}s, {record['fetched_bytes'] / 1e6:,.1f} MB fetched at "
                     f"{record['mb_per_s']} MB/s (slowest node), {record['reused_bytes'] / 1e6:,.1f} MB reused from "
                     "the cache")
        facts[name] = line
    return facts


def load_summary(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
