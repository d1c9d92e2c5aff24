"""Per-step timers of the training loop: where each step's wall time went, totalled as an
infra.analysis.breakdown.StepBreakdown.

What each figure means (seconds, summed over the steps this process ran; every interval lies inside one step):

    wall_s             start of the step (before the learning rate and the batch) until its metrics and checkpoint
                       handling are done.
    data_wait_s        reading this rank's batch (TokenWindows.train_batch) and copying it to the device.
    comm_total_s       the time at least one gradient bucket was in flight: the length of the union of the intervals
                       [DDP hands the bucket to the comm hook (its gradients are computed), the bucket's all-reduce
                       completed]. Overlapped with the rest of backward or not.
    comm_exposed_s     how long loss.backward() went on after the LAST bucket was handed to the hook. From that
                       moment every gradient is computed, so what backward still does is wait for the all-reduces
                       in flight to finish, then notice that they did and copy the averaged buckets back into
                       .grad: the communication that computation did not hide. It can exceed comm_total_s by that
                       tail (on a busy CPU, waking the training thread can take longer than a small all-reduce).
    sync_wait_s        the per-step all-reduce of loss and stop flag: 8 bytes, so network latency plus waiting for
                       the slowest rank to reach it.
    ckpt_block_s       training blocked on checkpoints: the save call (async: waiting for the previous save and
                       staging; sync/direct: the whole local write) and reporting it; with mode direct also
    ckpt_upload_wait_s the wait until the node's syncer has uploaded the step (a part of ckpt_block_s).
    allreduce_bytes    gradient bytes this rank handed to all-reduce (the buckets' sizes); the loss all-reduce's
                       8 bytes are not counted, they are latency, not bandwidth.
    comm_buckets       the shape of one step's gradient communication, for the what-if predictor: per bucket, in
                       launch order, [launch time after the first bucket's launch, service time, bytes], averaged
                       over the steps since DDP last changed its buckets. Service time is what the bucket's
                       all-reduce took once the one before it had finished (buckets share the link, one after
                       another), so replaying the buckets with scaled service times predicts the exposed part.

Everything else in the step (forward, backward's own computation, gradient clipping, the optimizer) is compute:
StepBreakdown.t_compute = wall − (comm_exposed + sync_wait) − (data_wait + ckpt_block).

Clocks: on CPU, time.perf_counter() is read when things happen (gloo completes a bucket's future on its own
thread, where the completion callback runs). On CUDA, kernels run behind the Python thread, so each timed phase
synchronizes the device at its edges, and the bucket times are CUDA events (launch: recorded on the stream that
computed the bucket; done: recorded in the future's callback, whose stream waits for the all-reduce), turned into
perf_counter seconds once backward has returned and the device is synchronized.
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations as objects, not strings.

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from infra.analysis.breakdown import StepBreakdown

Phase = Literal["data", "sync", "ckpt", "upload"]
_PHASE_FIELDS: dict[str, str] = {
    "data": "data_wait_s",
    "sync": "sync_wait_s",
    "ckpt": "ckpt_block_s",
    "upload": "ckpt_upload_wait_s",
}


@dataclass
class StepSplit:
    """The parts of one step's wall time, or their sums over several steps (seconds; bytes)."""

    steps: int = 0
    wall_s: float = 0.0
    comm_exposed_s: float = 0.0
    comm_total_s: float = 0.0
    sync_wait_s: float = 0.0
    data_wait_s: float = 0.0
    ckpt_block_s: float = 0.0
    ckpt_upload_wait_s: float = 0.0
    allreduce_bytes: int = 0

    def __add__(self, other: "StepSplit") -> "StepSplit":
        return StepSplit(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def compute_s(self) -> float:
        return max(self.wall_s - self.comm_exposed_s - self.sync_wait_s - self.data_wait_s - self.ckpt_block_s, 0.0)

    def per_step_ms(self) -> dict[str, float]:
        """Means per step in milliseconds, for the periodic metrics line."""
        scale = 1000.0 / max(self.steps, 1)
        parts = {
            "compute_ms": self.compute_s,
            "comm_exposed_ms": self.comm_exposed_s,
            "comm_total_ms": self.comm_total_s,
            "sync_ms": self.sync_wait_s,
            "data_ms": self.data_wait_s,
            "ckpt_ms": self.ckpt_block_s,
        }
        return {name: round(seconds * scale, 3) for name, seconds in parts.items()}


class _HostClock:
    """CPU: what Python sees is what happened."""

    def sync(self) -> None:
        pass

    def begin(self) -> None:
        pass

    def mark(self) -> Any:
        return time.perf_counter()

    def seconds(self, mark: Any) -> float:
        return float(mark)


class _CudaClock:
    """CUDA: marks are events on the device's timeline, placed on the host's after a synchronize."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._origin_s = 0.0
        self._origin: torch.cuda.Event | None = None

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def begin(self) -> None:
        # With the device idle, an event recorded now runs now: it ties the device's timeline to perf_counter.
        self.sync()
        self._origin_s = time.perf_counter()
        self._origin = self.mark()

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark: Any) -> float:
        if self._origin is None:
            raise RuntimeError("_CudaClock.seconds before begin(): time marks only inside StepTimer.backward()")
        return self._origin_s + self._origin.elapsed_time(mark) / 1000.0


@dataclass
class _Bucket:
    launched: Any
    bytes: int
    done: Any = None


class BucketProfile:
    """Running means of each bucket's [launch offset, service time, bytes] over the steps with the same buckets."""

    def __init__(self) -> None:
        self.steps = 0
        self._sums: list[list[float]] = []

    def add(self, intervals: list[tuple[float, float]], sizes: list[int]) -> None:
        """intervals: (launched, done) per bucket in launch order, on one clock."""
        if len(intervals) != len(self._sums):  # DDP rebuilds its buckets after the first step: start over
            self.steps, self._sums = 0, [[0.0, 0.0, 0.0] for _ in intervals]
        first, previous_done = intervals[0][0], float("-inf")
        for sums, (launched, done), size in zip(self._sums, intervals, sizes, strict=True):
            sums[0] += launched - first
            sums[1] += max(done - max(launched, previous_done), 0.0)
            sums[2] += size
            previous_done = max(previous_done, done)
        self.steps += 1

    def means(self) -> list[list[float]]:
        return [[round(total / self.steps, 7) for total in sums] for sums in self._sums] if self.steps else []


def covered_s(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: time during which at least one was open."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class StepTimer:
    """Times the phases of each training step; `totals` sums the steps this process ran."""

    def __init__(self, device: torch.device) -> None:
        self._clock = _CudaClock(device) if device.type == "cuda" else _HostClock()
        self._step = StepSplit()
        self._step_started = 0.0
        self._buckets: list[_Bucket] = []
        self.totals = StepSplit()
        self.profile = BucketProfile()

    def attach(self, ddp_model: DistributedDataParallel) -> None:
        """Registers the timing comm hook; DDP takes one hook, before its first forward."""
        ddp_model.register_comm_hook(None, self._comm_hook)

    def _comm_hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The default all-reduce (averaging over the world), with the bucket's launch and completion marked."""
        buffer = bucket.buffer()
        record = _Bucket(self._clock.mark(), buffer.numel() * buffer.element_size())
        self._buckets.append(record)

        def finished(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            record.done = self._clock.mark()
            return future.value()

        return allreduce_hook(state, bucket).then(finished)

    def start_step(self) -> None:
        self._step = StepSplit(steps=1)
        self._step_started = time.perf_counter()

    @contextmanager
    def phase(self, name: Phase) -> Iterator[None]:
        """Adds the time of the block to the phase's figure (phases may nest: upload lies within ckpt)."""
        self._clock.sync()
        started = time.perf_counter()
        yield
        self._clock.sync()
        field = _PHASE_FIELDS[name]
        setattr(self._step, field, getattr(self._step, field) + time.perf_counter() - started)

    @contextmanager
    def backward(self) -> Iterator[None]:
        """Wraps loss.backward(): the buckets all-reduced in it give comm_total_s, comm_exposed_s and the bytes."""
        self._buckets = []
        self._clock.begin()
        yield
        ended = self._clock.mark()
        self._clock.sync()
        # DDP's backward returns only once every bucket's future (and so its callback) has completed.
        seconds = self._clock.seconds
        intervals = sorted((seconds(b.launched), seconds(b.done), b.bytes) for b in self._buckets)
        if intervals:
            spans = [(launched, done) for launched, done, _ in intervals]
            self._step.comm_total_s += covered_s(spans)
            self._step.comm_exposed_s += max(0.0, seconds(ended) - spans[-1][0])
            self.profile.add(spans, [size for _, _, size in intervals])
        self._step.allreduce_bytes += sum(b.bytes for b in self._buckets)

    def end_step(self) -> StepSplit:
        """Closes the step: returns its split and adds it to the totals."""
        self._clock.sync()
        self._step.wall_s = time.perf_counter() - self._step_started
        self.totals += self._step
        return self._step

    def breakdown(
        self,
        *,
        read_bytes: int,
        read_requests: int,
        read_latency_s: float,
        data_source: str,
        ckpt_bytes: int,
        ckpt_saves: int,
        ckpt_mode: str,
        world_size: int,
        nodes: int,
    ) -> StepBreakdown:
        """The totals with what the timer cannot see itself (reads, saves, the cluster), as the done event has them."""
        totals = {f.name: getattr(self.totals, f.name) for f in fields(self.totals)}
        return StepBreakdown(
            **{name: round(value, 6) if isinstance(value, float) else value for name, value in totals.items()},
            read_bytes=read_bytes,
            read_requests=read_requests,
            read_latency_s=round(read_latency_s, 9),
            data_source=data_source,
            ckpt_bytes=ckpt_bytes,
            ckpt_saves=ckpt_saves,
            ckpt_mode=ckpt_mode,
            world_size=world_size,
            nodes=nodes,
            comm_buckets=tuple(tuple(bucket) for bucket in self.profile.means()),
        )
