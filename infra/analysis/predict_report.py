"""The what-if report of one run: its summary.json read into the predictor's inputs, and the table a person reads.

Where the measured hardware's figures come from, first that exists (each is named in the report):

    network     the slowest TCP link of the verify stage's cluster bench; else DEFAULT_NETWORK_GBPS
    store       remote reads: the breakdown's read bytes over the bandwidth part of its data wait (every rank of a
                node reading at once); else the staging throughput (slowest node); else the slowest checkpoint
                upload; else DEFAULT_STORE_GBPS
    local disk  the slowest node's read and write in the cluster bench; else one NVMe drive (the catalog estimate)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from infra.analysis.breakdown import StepBreakdown
from infra.analysis.predict import (
    GBIT,
    MB,
    NVME_READ_MB_S_PER_DRIVE,
    NVME_WRITE_MB_S_PER_DRIVE,
    Choice,
    Hardware,
    Job,
    Prediction,
    ranks_per_node,
    request_latency_part,
)

# Defaults when the run measured nothing better: a common cloud Ethernet link, and what one such link gives an
# object store.
DEFAULT_NETWORK_GBPS = 10.0
DEFAULT_STORE_GBPS = 10.0


class NoBreakdownError(ValueError):
    """The summary has no step breakdown to predict from; one line naming the file and the fix."""


@dataclass(frozen=True)
class RunFacts:
    """What the predictor needs from one run, and where each measured figure came from."""

    breakdown: StepBreakdown
    measured: Hardware
    job: Job
    price_per_hour: float | None
    provider: str
    nodes: int
    sources: tuple[str, ...]  # one line per measured figure: its value and its origin


def _first(*options: tuple[float | None, str]) -> tuple[float, str]:
    """The first option with a positive value: (value, where it came from)."""
    value, source = next(((v, s) for v, s in options if v is not None and v > 0), options[-1])
    assert value is not None  # the last option is always a default
    return value, source


def _remote_read_gbps(b: StepBreakdown) -> float | None:
    """Per-node store throughput the remote reads got: bytes over the part of the wait that was not latency."""
    if b.data_source != "remote":
        return None
    transfer_s = b.data_wait_s - request_latency_part(b)
    return b.read_bytes * ranks_per_node(b) / transfer_s / GBIT if transfer_s > 0 and b.read_bytes > 0 else None


def facts_from_summary(summary: dict[str, Any], source: str, steps: int | None = None) -> RunFacts:
    """Reads a run summary (summary.json); steps: the job's total steps (default: the run's)."""
    if not summary.get("breakdown"):
        raise NoBreakdownError(f"{source}: no step breakdown: the run did not finish training with a trainer that "
                               "reports one; rerun it")
    try:
        b = StepBreakdown.from_dict(summary["breakdown"])
    except TypeError as exc:  # a field missing: written by another version of the trainer
        raise NoBreakdownError(f"{source}: its step breakdown cannot be read ({exc}): rerun it with this version"
                               ) from None
    bench = summary.get("cluster_bench") or {}
    bench = bench.get("measurement", bench)  # the verify stage nests it; `bench cluster --json` too
    links = [link["gbps"] for link in bench.get("links") or []]
    disks = bench.get("disks") or []
    stage = summary.get("stage") or {}
    uploads = [c["upload_mb_per_s"] for c in summary.get("checkpoints") or [] if c.get("upload_mb_per_s")]

    network, network_from = _first((min(links, default=None), "slowest TCP link of the cluster bench"),
                                   (DEFAULT_NETWORK_GBPS, "default: the cluster bench measured no link"))
    store, store_from = _first(
        (_remote_read_gbps(b), "the run's remote reads"),
        (stage.get("mb_per_s", 0) * MB / GBIT, "staging throughput, slowest node"),
        (min(uploads, default=0) * MB / GBIT, "slowest checkpoint upload"),
        (DEFAULT_STORE_GBPS, "default: the run measured no store throughput"))
    if disks:
        read, write = min(d["read_mb_per_s"] for d in disks), min(d["write_mb_per_s"] for d in disks)
        disk_from = "slowest node of the cluster bench"
    else:
        read, write = NVME_READ_MB_S_PER_DRIVE, NVME_WRITE_MB_S_PER_DRIVE
        disk_from = "estimate: one NVMe drive, the cluster bench measured no disk"
    measured = Hardware(network_gbps=network, store_gbps=store, local_disk_read_mb_s=read,
                        local_disk_write_mb_s=write, instance_type=summary.get("instance_type"), label="as measured")

    staged = stage.get("bytes", 0) + stage.get("skipped_bytes", 0)
    dataset, dataset_from = (staged, "staged per node") if staged else (
        b.read_bytes * ranks_per_node(b), "estimate: what the node's ranks read (nothing was staged)")
    sources = (f"network {network:.3g} Gbit/s ({network_from})", f"store {store:.3g} Gbit/s ({store_from})",
               f"local disk {read:.0f} MB/s read, {write:.0f} MB/s write ({disk_from})",
               f"dataset {dataset / 1e9:.3g} GB per node ({dataset_from})")
    price = summary.get("price_per_hour")
    return RunFacts(breakdown=b, measured=measured, job=Job(steps or summary.get("steps") or b.steps, int(dataset)),
                    price_per_hour=price, provider=summary.get("provider", ""),
                    nodes=summary.get("nodes") or b.nodes, sources=sources)


def _notes_index(predictions: Sequence[Prediction]) -> dict[str, int]:
    """Each distinct note once, numbered in order of appearance: rows cite the numbers."""
    index: dict[str, int] = {}
    for note in (n for p in predictions for n in p.notes):
        index.setdefault(note, len(index) + 1)
    return index


def render(facts: RunFacts, predictions: Sequence[Prediction], choice: Choice, notes: Sequence[str] = ()) -> str:
    b = facts.breakdown
    per_step, shares = b.per_step(), b.shares()
    lines = [f"measured: {b.steps} steps, {b.wall_s / b.steps:.4f} s/step on {b.nodes} node(s), "
             f"{b.world_size} rank(s), data {b.data_source}, checkpoints {b.ckpt_mode}",
             "  " + "   ".join(f"{name} {per_step[name]:.4f} s ({shares[name]:.0%})" for name in per_step),
             f"  {b.dominant()}",
             *(f"  {line}" for line in facts.sources),
             f"  job: {facts.job.steps:,} steps, "
             + (f"${facts.price_per_hour:,.2f}/h" if facts.price_per_hour is not None else "price unknown"),
             ""]
    index = _notes_index(predictions)
    width = max([len("scenario / candidate"), *(len(p.label) for p in predictions)])
    lines.append(f"{'scenario / candidate':<{width}}  {'net Gb/s':>8} {'store Gb/s':>10} {'step s':>9} {'job h':>8} "
                 f"{'cost $':>10} {'step ×':>7} {'recov s':>8} {'recov GB':>8}  {'bound':<12} notes")
    for p in predictions:
        cost = f"{p.cost_usd:,.2f}" if p.cost_usd is not None else "-"
        cited = ",".join(str(index[n]) for n in p.notes)
        lines.append(f"{p.label:<{width}}  {p.hardware.network_gbps:>8.4g} {p.hardware.store_gbps:>10.4g} "
                     f"{p.step_s:>9.4f} {p.job_s / 3600:>8.3f} {cost:>10} {p.speedup:>7.2f} {p.recovery_s:>8.1f} "
                     f"{p.recovery_store_bytes / 1e9:>8.3g}  {p.bound():<12} "
                     f"{cited}".rstrip())
    lines.append("  recov s, recov GB: one node lost, the data moved until training resumes and what the store "
                 "serves for it (whole relaunch, or replace-one)")
    lines += [f"  [{number}] {note}" for note, number in index.items()]
    lines += [f"  note: {note}" for note in notes]
    lines.append(f"cheapest meeting the deadline: {choice.reason}")
    return "\n".join(lines)


def to_json(facts: RunFacts, predictions: Sequence[Prediction], choice: Choice, deadline_s: float,
            notes: Sequence[str] = ()) -> dict[str, Any]:
    return {"measured": {"breakdown": facts.breakdown.summary(), "hardware": asdict(facts.measured),
                         "sources": list(facts.sources)},
            "job": asdict(facts.job), "price_per_hour": facts.price_per_hour,
            "predictions": [p.to_dict() for p in predictions],
            "cheapest": {"deadline_s": None if math.isinf(deadline_s) else deadline_s,
                         "label": choice.prediction.label if choice.prediction else None, "reason": choice.reason},
            "notes": list(notes)}
