"""Where a run's step time went: T_compute, T_network and T_io, as the trainer measured them.

The trainer (trainer.step_timing) accumulates per-step timers and writes their totals into its `done` metrics event
under "breakdown", with the keys of StepBreakdown. This module is the one reading of those keys: the run summary,
the artifacts, the what-if predictor and `trainpipe bench repro` all go through it.

    T_network = comm_exposed_s + sync_wait_s     (gradient all-reduce not hidden behind backward + the per-step
                                                   loss all-reduce, which also absorbs waiting for a slower rank)
    T_io      = data_wait_s + ckpt_block_s        (reading the batch + training blocked on checkpoints)
    T_compute = wall_s − T_network − T_io         (forward, backward, optimizer, everything else in the step)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class StepBreakdown:
    """Totals over the steps one run trained, as seen by global rank 0 (seconds and bytes)."""

    steps: int
    wall_s: float  # sum of step wall times (first step's start to last step's end, minus nothing)
    comm_exposed_s: float  # backward blocked on gradient all-reduce after the last bucket was ready
    comm_total_s: float  # time at least one gradient bucket was in flight (overlapped with backward or not)
    sync_wait_s: float  # the per-step loss/stop all-reduce: tiny bytes, so latency and waiting for peers
    data_wait_s: float  # reading and preparing the batch
    ckpt_block_s: float  # training blocked on checkpoint saves (stall; with mode direct, also the upload)
    allreduce_bytes: int  # gradient bytes this rank all-reduced (bucket sizes), over all steps
    read_bytes: int  # dataset bytes this rank read, over all steps
    read_requests: int  # reads issued for them (remote GETs, or local window reads)
    ckpt_bytes: int  # bytes this node's checkpoints wrote, over all saves
    ckpt_saves: int
    ckpt_upload_wait_s: float = 0.0  # the part of ckpt_block_s spent waiting for the store (mode direct)
    data_source: str = "local"  # local: the node's staged copy; remote: ranged GETs against the store
    ckpt_mode: str = "async"
    read_latency_s: float = 0.0  # median time of a 1-byte read from the data source, probed at start
    world_size: int = 1
    nodes: int = 1
    # One step's gradient buckets in launch order: (launch s after the first launch, service s, bytes), means over
    # the steps; the predictor replays them at other bandwidths (trainer.step_timing says how they are measured).
    comm_buckets: tuple[tuple[float, float, float], ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepBreakdown:
        known = {name for name in cls.__dataclass_fields__}
        return cls(**{key: value for key, value in data.items() if key in known})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def t_network(self) -> float:
        return self.comm_exposed_s + self.sync_wait_s

    @property
    def t_io(self) -> float:
        return self.data_wait_s + self.ckpt_block_s

    @property
    def t_compute(self) -> float:
        return max(self.wall_s - self.t_network - self.t_io, 0.0)

    def terms(self) -> dict[str, float]:
        return {"T_compute": self.t_compute, "T_network": self.t_network, "T_io": self.t_io}

    def shares(self) -> dict[str, float]:
        total = self.wall_s or 1.0
        return {name: value / total for name, value in self.terms().items()}

    def per_step(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        return {name: value / steps for name, value in self.terms().items()}

    def dominant(self) -> str:
        """One line naming what bounds the step, e.g. 'network-bound: 62% of step time in exposed all-reduce'."""
        shares = self.shares()
        name = max(shares, key=lambda key: shares[key])
        what = {
            "T_compute": "compute-bound: {share:.0%} of step time computing",
            "T_network": "network-bound: {share:.0%} of step time in exposed all-reduce and sync",
            "T_io": "I/O-bound: {share:.0%} of step time waiting for data and checkpoints",
        }[name]
        return what.format(share=shares[name])

    def summary(self) -> dict[str, Any]:
        """What the run summary keeps: the raw totals, the three terms, their shares, per-step figures."""
        return {
            **self.to_dict(),
            "terms_s": {name: round(value, 4) for name, value in self.terms().items()},
            "shares": {name: round(value, 4) for name, value in self.shares().items()},
            "per_step_s": {name: round(value, 5) for name, value in self.per_step().items()},
            "allreduce_bytes_per_step": self.allreduce_bytes // max(self.steps, 1),
            "read_bytes_per_step": self.read_bytes // max(self.steps, 1),
            "dominant": self.dominant(),
        }
