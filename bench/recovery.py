"""The recovery benchmark: one node of a netns cluster preempted mid-training, recovered by each path side by side.

The same training job runs once per recovery path through the retrain flow, on a netns cluster (4 nodes by
default) whose store sits behind a link slower than the nodes' (NetnsStore, as `bench staging`): the job's
`chaos:` section preempts one node (not the head) at a step past a commit, and the job's `recovery.replace` picks
the path:

    cluster  the whole relaunch: every node torn down, the cluster launched again on new machines (the netns
             cluster's `relaunch: new-machines`: every node empty, as a cloud's new instances are), every node
             verified, staged and restored
    nodes    replace-one: only the lost node is replaced and filled from its peers, survivors keep their data

Per path, from the run's recovery record (infra.lifecycle.recovery.RecoveryRecord):

- detection → resumed: `notice_to_resume_s` (from the detection to torchrun started again on every node), and to
  the first step trained after it (`time_to_first_step_s`), which also counts torchrun's start-up;
- store bytes: what the store sent during the recovery, counted at the store (its namespace's interface tx
  counter, sampled in the background with timestamps), between `detected_at` and the first step trained after it
  (the later of the two ends: the restore and anything else the recovery read is inside it);
- which path the recovery took (`path` in the record, where this trainpipe records it).

The figures are set against the issue's targets: replace-one's store bytes ≤ 5% of dataset + checkpoint, and its
detection → resumed ≤ 0.5× the whole relaunch's in the same run. Needs root (namespaces, tc).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest.mock import patch

from bench.staging import report_json, store_tx_bytes
from bench.trainer_flags import VOCAB_SIZE, ModelShape
from infra.analysis.predict import Hardware, Recovery, recovery
from infra.checkpoints.store import CheckpointStore
from infra.compute.providers.netns import emulation as netns
from infra.dataset.synth import TOKEN_BYTES, synthesize
from infra.job.recovery_spec import RecoverySpec
from infra.job.spec import JobSpec
from infra.storage import open_store

PATHS = ("cluster", "nodes")
# What each path is called in a recovery record (RecoveryRecord.path), where this trainpipe records it.
RECORDED = {"cluster": "relaunched-cluster", "nodes": "replaced-nodes"}
STORE_BYTES_TARGET = 0.05  # replace-one's store bytes, at most this share of dataset + checkpoint
TIME_TARGET = 0.5  # replace-one's detection → resumed, at most this share of the whole relaunch's
SAMPLE_S = 0.2
DATA_BUCKET, CKPT_BUCKET = "data", "checkpoints"
# A checkpoint of tens of MB (weights and Adam's two moments): ~3.2 M parameters.
MODEL = ModelShape(d_model=256, n_layers=4, n_heads=4)


class RecoveryBenchError(RuntimeError):
    """The bench could not run, or a run did not recover the way the bench measures."""


@dataclass(frozen=True)
class RecoveryBenchConfig:
    nodes: int = 4
    preempt_node: int = 2  # not the head: the head's loss is a case of its own (the coordinator moves)
    paths: tuple[str, ...] = PATHS
    dataset_mb: int = 512  # a night's data is not tiny: fixed costs (process starts) would set the ratio
    model: ModelShape = MODEL
    steps: int = 40
    ckpt_every: int = 10
    preempt_at_step: int = 25
    notice_s: float = 2.0  # a spot-style notice: the trainer saves first
    store_mbit: float = 400.0
    node_mbit: float = 2000.0
    fanout: str = "on"  # the job's dataset.fanout, the same on every path
    workdir: Path | None = None

    def problem(self) -> str | None:
        """What is wrong with the config, before anything is started (None: nothing)."""
        if self.nodes < 2:
            return f"recovery nodes {self.nodes}: a replacement needs peers, give 2 or more"
        if not 0 < self.preempt_node < self.nodes:
            return f"preempt node {self.preempt_node}: give a node other than the head, 1-{self.nodes - 1}"
        if not self.paths or set(self.paths) - set(PATHS):
            return f"recovery paths {list(self.paths)}: give some of {', '.join(PATHS)}"
        if not self.ckpt_every < self.preempt_at_step < self.steps:
            return (f"preempt at step {self.preempt_at_step}: give a step after the first commit ({self.ckpt_every})"
                    f" and before the last ({self.steps})")
        if self.dataset_mb < 1:
            return f"dataset_mb {self.dataset_mb}: give at least 1 MB"
        return netns.problem()


def replace_supported() -> bool:
    """Whether this trainpipe's jobs say which recovery path to take (`recovery.replace`)."""
    return "replace" in RecoverySpec.model_fields


# -- the store's counter over time ------------------------------------------------------------------------------


def bytes_between(samples: Sequence[tuple[float, int]], start: float, end: float) -> int:
    """What a monotonic counter sampled as (unix time, value) pairs grew by from start to end: the value at each end
    interpolated linearly between the samples around it (held at the first or last sample outside them)."""
    if not samples:
        raise ValueError("no samples of the store's counter")
    return max(0, round(_value_at(samples, end) - _value_at(samples, start)))


def _value_at(samples: Sequence[tuple[float, int]], at: float) -> float:
    times = [t for t, _ in samples]
    index = bisect_left(times, at)
    if index == 0:
        return samples[0][1]
    if index == len(samples):
        return samples[-1][1]
    (t0, v0), (t1, v1) = samples[index - 1], samples[index]
    return v0 + (v1 - v0) * (at - t0) / (t1 - t0) if t1 > t0 else v1


class StoreMeter:
    """Samples the store's tx counter every `every` seconds in a thread of its own, stamped with unix time (the
    clock of the recovery records)."""

    def __init__(self, read: Callable[[], int], every: float = SAMPLE_S) -> None:
        self._read, self._every = read, every
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-meter", daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> StoreMeter:
        self.samples.append((time.time(), self._read()))
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * self._every + 10)
        self.samples.append((time.time(), self._read()))

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self.samples.append((time.time(), self._read()))
            except Exception as exc:  # read again at exit; the gap only widens the interpolation
                self.error = exc
                return

    def between(self, start: float, end: float) -> int:
        if self.error is not None:
            raise RecoveryBenchError(f"sampling the store's counter failed: {self.error}")
        return bytes_between(self.samples, start, end)


# -- the report -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryRun:
    path: str  # the job's recovery.replace
    run_id: str
    took: str | None  # the path the record says it took (None: this trainpipe does not record it)
    detect_to_resume_s: float  # the record's notice_to_resume_s
    detect_to_first_step_s: float | None  # the record's time_to_first_step_s
    store_bytes: int  # what the store's interface sent from the detection to the first step after it
    store_bytes_to_resume: int  # ... from the detection to resumed
    checkpoint_bytes: int  # the committed checkpoint the run resumed from
    resumed_from_step: int | None
    steps_lost: int | None
    reused_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)  # the record's per-phase split
    fallback: str | None = None  # why the lost node could not be replaced alone (the record's, where it says)

    @property
    def unsplit_s(self) -> float:
        """Detection → resumed outside the record's phases: stopping the other nodes and their syncers' last
        uploads, before the teardown."""
        return self.detect_to_resume_s - sum(self.seconds.values())


@dataclass
class RecoveryBenchReport:
    config: RecoveryBenchConfig
    dataset_bytes: int = 0
    runs: list[RecoveryRun] = field(default_factory=list)
    not_measured: dict[str, str] = field(default_factory=dict)  # path -> why

    def run(self, path: str) -> RecoveryRun | None:
        return next((r for r in self.runs if r.path == path), None)

    def share(self, run: RecoveryRun) -> float:
        """The run's store bytes over what a recovery could need from the store: dataset + checkpoint."""
        return run.store_bytes / (self.dataset_bytes + run.checkpoint_bytes)

    def model(self, run: RecoveryRun) -> Recovery:
        """What `trainpipe predict` gives for this recovery on these links: the data moved and the store's bytes.
        Its whole relaunch stages the dataset again, as new machines do."""
        c = self.config
        hardware = Hardware(network_gbps=c.node_mbit / 1000, store_gbps=c.node_mbit / 1000,
                            store_egress_gbps=c.store_mbit / 1000)
        return recovery(self.dataset_bytes, run.checkpoint_bytes // c.nodes, c.nodes, hardware, c.fanout != "off",
                        replace_nodes=run.path == "nodes")

    def ratios(self) -> dict[str, float] | None:
        """Replace-one against the whole relaunch, and whether it meets the targets; None until both ran."""
        nodes, cluster = self.run("nodes"), self.run("cluster")
        if nodes is None or cluster is None:
            return None
        ratios = {"resume_nodes_cluster": nodes.detect_to_resume_s / cluster.detect_to_resume_s,
                  "store_share_nodes": self.share(nodes), "store_share_cluster": self.share(cluster)}
        if nodes.detect_to_first_step_s and cluster.detect_to_first_step_s:
            ratios["first_step_nodes_cluster"] = nodes.detect_to_first_step_s / cluster.detect_to_first_step_s
        return ratios

    def meets_targets(self) -> bool | None:
        """Replace-one within both of the issue's targets; None until both paths ran."""
        if (ratios := self.ratios()) is None:
            return None
        return ratios["resume_nodes_cluster"] <= TIME_TARGET and ratios["store_share_nodes"] <= STORE_BYTES_TARGET

    def table(self) -> str:
        c = self.config
        lines = [f"recovery of node {c.preempt_node} of {c.nodes} preempted at step {c.preempt_at_step} (notice "
                 f"{c.notice_s:g} s); dataset {self.dataset_bytes / 1e6:,.1f} MB replicated, fan-out {c.fanout}; "
                 f"store link {c.store_mbit:g} Mbit/s, node links {c.node_mbit:g} Mbit/s; store bytes counted at the "
                 "store's interface from the detection to the first step after it",
                 f"{'path':<8} {'took':<19} {'detect→resumed s':>16} {'→1st step s':>11} {'store MB':>9} "
                 f"{'% data+ckpt':>11} {'ckpt MB':>8} {'reused MB':>9} {'× cluster':>9} {'model s':>7} "
                 f"{'model MB':>8}"]
        cluster = self.run("cluster")
        for run in sorted(self.runs, key=lambda r: PATHS.index(r.path)):
            ratio = f"{run.detect_to_resume_s / cluster.detect_to_resume_s:.2f}×" if cluster else ""
            first = "" if run.detect_to_first_step_s is None else f"{run.detect_to_first_step_s:.1f}"
            lines.append(f"{run.path:<8} {run.took or '(not recorded)':<19} {run.detect_to_resume_s:>16.1f} "
                         f"{first:>11} {run.store_bytes / 1e6:>9,.1f} {self.share(run):>10.1%} "
                         f"{run.checkpoint_bytes / 1e6:>8,.1f} {run.reused_bytes / 1e6:>9,.1f} {ratio:>9} "
                         f"{self.model(run).seconds:>7.1f} {self.model(run).store_bytes / 1e6:>8,.1f}")
            lines.append(f"{'':<8} phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in run.seconds.items())
                         + f"; before them (stopping the rest, last uploads) {run.unsplit_s:.1f} s")
            if run.fallback:
                lines.append(f"{'':<8} relaunched the whole cluster because: {run.fallback}")
        lines += [f"{path:<8} not measured: {why}" for path, why in self.not_measured.items()]
        lines.append("model s, model MB: trainpipe predict's recovery (the data moved, without provisioning and "
                     "start-up; its whole relaunch re-stages the dataset as a cloud's new machines must)")
        if (ratios := self.ratios()) is not None:
            lines.append(f"replace-one: detection→resumed {ratios['resume_nodes_cluster']:.2f}× the whole relaunch "
                         f"(target ≤ {TIME_TARGET:g}×), store bytes {ratios['store_share_nodes']:.1%} of dataset + "
                         f"checkpoint (target ≤ {STORE_BYTES_TARGET:.0%}): "
                         f"{'meets' if self.meets_targets() else 'DOES NOT meet'} the targets")
        return "\n".join(lines)

    def to_json(self) -> str:
        return report_json(self.config, self.dataset_bytes,
                           [{**asdict(run), "store_share": self.share(run), "unsplit_s": run.unsplit_s,
                             "model": asdict(self.model(run))} for run in self.runs],
                           not_measured=self.not_measured, ratios=self.ratios(), meets_targets=self.meets_targets())


# -- the runs ---------------------------------------------------------------------------------------------------


def job_for(config: RecoveryBenchConfig, path: str) -> JobSpec:
    recovery: dict[str, Any] = {"max_recoveries": 1, "confirm_s": 2}
    if replace_supported():
        recovery["replace"] = path
    return JobSpec.model_validate({
        "name": f"bench-recovery-{path}",
        "cluster": {"provider": "netns", "nodes": config.nodes,
                    "netns": {"link_mbit": config.node_mbit, "relaunch": "new-machines"},
                    "verify": {"bench": "off"}},
        "dataset": {"url": f"s3://{DATA_BUCKET}/markov", "validation": "sample", "fanout": config.fanout},
        # keep: every commit, so the checkpoint a run resumed from can be measured after it.
        "checkpoints": {"url": f"s3://{CKPT_BUCKET}/{path}", "keep": config.steps // config.ckpt_every + 1},
        "training": {"command": [
            "-m", "trainer.train", "--steps", str(config.steps), "--ckpt-every", str(config.ckpt_every),
            "--batch-size", "8", "--warmup-steps", "5", "--lr", "3e-3", *config.model.flags()]},
        "recovery": recovery,
        "chaos": {"preempt": [{"node": config.preempt_node, "attempt": 0, "at_step": config.preempt_at_step,
                               "notice_s": config.notice_s}]},
    })


def committed_bytes(summary: dict[str, Any], step: int) -> int:
    """The bytes of the run's committed checkpoint of `step`, beside its final one in the store."""
    final = summary.get("checkpoint")
    if not final:
        raise RecoveryBenchError(f"run {summary.get('run_id')}: no committed checkpoint in its summary")
    return CheckpointStore(open_store(final.rsplit("/", 1)[0])).manifest(step).total_bytes


def measured_run(path: str, run_id: str, summary: dict[str, Any], meter: StoreMeter,
                 checkpoint_bytes: Callable[[dict[str, Any], int], int] = committed_bytes) -> RecoveryRun:
    """The run's one recovery, its store bytes from the meter; RecoveryBenchError where it did not recover."""
    records = summary.get("recoveries") or []
    if summary.get("status") != "completed" or len(records) != 1:
        raise RecoveryBenchError(f"path {path}: run {run_id} {summary.get('status')} with {len(records)} "
                                 f"recoveries: {summary.get('error') or 'expected one'}: see its summary.json")
    record = records[0]
    if record.get("notice_to_resume_s") is None:
        raise RecoveryBenchError(f"path {path}: run {run_id}: its recovery never resumed training")
    detected, resumed, first = (record["detected_at"], record["notice_to_resume_s"],
                                record.get("time_to_first_step_s"))
    step = record.get("resumed_from_step")
    return RecoveryRun(path=path, run_id=run_id, took=record.get("path"), detect_to_resume_s=resumed,
                       detect_to_first_step_s=first,
                       store_bytes=meter.between(detected, detected + max(resumed, first or 0.0)),
                       store_bytes_to_resume=meter.between(detected, detected + resumed),
                       checkpoint_bytes=checkpoint_bytes(summary, step) if step is not None else 0,
                       resumed_from_step=step, steps_lost=record.get("steps_lost"),
                       reused_bytes=record.get("reused_bytes", 0), seconds=record.get("seconds") or {},
                       fallback=record.get("fallback"))


def run_recovery_benchmark(config: RecoveryBenchConfig, run_job: Callable[[JobSpec, str], dict[str, Any]],
                           echo: Callable[[str], None] = print) -> RecoveryBenchReport:
    """Each path's run, one after another on one store; run_job runs the retrain flow and returns its summary."""
    from infra.compute.providers.netns.store import NetnsStore

    if (why := config.problem()) is not None:
        raise RecoveryBenchError(f"bench staging (recovery): {why}")
    report = RecoveryBenchReport(config)
    paths = list(config.paths)
    if not replace_supported() and "nodes" in paths:
        paths.remove("nodes")
        report.not_measured["nodes"] = ("this trainpipe has no recovery.replace: every recovery relaunches the "
                                        "whole cluster")
    with tempfile.TemporaryDirectory(prefix="trainpipe-bench-recovery-", dir=config.workdir) as temp:
        root = Path(temp) / "store"
        (root / CKPT_BUCKET).mkdir(parents=True)
        tokens = config.dataset_mb * 1_000_000 // TOKEN_BYTES
        manifest = synthesize(open_store(str(root / DATA_BUCKET / "markov")), tokens, vocab_size=VOCAB_SIZE,
                              shard_tokens=max(1, tokens // 8))
        report.dataset_bytes = sum(shard.bytes for shard in manifest.shards)
        with (NetnsStore(root, link_mbit=config.store_mbit, etag_hash="") as store, patch.dict(os.environ, store.env()),
              StoreMeter(lambda: store_tx_bytes(store)) as meter):
            for path in paths:
                run_id = f"bench-recovery-{path}-{time.strftime('%Y%m%d%H%M%S')}"
                echo(f"recovery path {path}: {config.nodes} nodes, node {config.preempt_node} preempted at step "
                     f"{config.preempt_at_step}, run {run_id}")
                summary = run_job(job_for(config, path), run_id)
                run = measured_run(path, run_id, summary, meter)
                if path == "nodes" and run.took is None:  # the flow took no path of its own: the whole relaunch
                    report.not_measured[path] = (f"run {run_id}: its recovery record names no path: this trainpipe's "
                                                 "flow relaunches the whole cluster whatever recovery.replace says")
                    continue
                report.runs.append(run)
                echo(f"recovery path {path} (took {run.took or 'not recorded'}): detection → resumed "
                     f"{run.detect_to_resume_s:.1f} s, store sent {run.store_bytes / 1e6:,.1f} MB "
                     f"({report.share(run):.1%} of dataset + checkpoint)")
    return report
