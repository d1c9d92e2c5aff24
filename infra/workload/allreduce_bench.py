"""`allreduce-bench`: all-reduce bandwidth over the training backend, as nccl-tests' all_reduce_perf reports it.

Run in every rank of a torchrun on every node (a TorchrunRequest whose worker is its AllreduceBenchRequest). Per
message size, rank 0 prints an `allreduce` event with

    algbw = bytes / time                      (what one all-reduce of that size achieves)
    busbw = algbw × 2(n−1)/n                  (nccl-tests' bus bandwidth: comparable to the link's speed whatever n)

where time is the slowest rank's mean over the timed iterations. The backend is the one training uses: nccl when
CUDA is available, else gloo.

A script, not a node command: it runs in the training environment (the agent writes it beside the launcher, see
infra/node/torchrun.py), where only torch and the standard library can be imported. Its parameters are an
AllreduceBenchRequest as plain JSON in TRAINPIPE_ALLREDUCE_BENCH, with the name of the event it reports.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

MB = 1024 * 1024
MIN_ITERS = 3


def bus_factor(world_size: int) -> float:
    """How many times each byte crosses a rank's link in a ring all-reduce, per byte reduced."""
    return 2 * (world_size - 1) / world_size


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest value over all ranks: every rank then takes the same decisions from it."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _timed(tensor: torch.Tensor, iters: int, device: torch.device) -> float:
    dist.barrier()
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    _synchronize(device)
    return _slowest((time.perf_counter() - started) / iters, device)


def check_sum(tensor: torch.Tensor, rank: int, world_size: int) -> None:
    """One all-reduce with a known answer first: a fabric that corrupts data must not pass as a fast one."""
    tensor.fill_(float(rank + 1))
    dist.all_reduce(tensor)
    expected = world_size * (world_size + 1) / 2
    ends = (float(tensor[0].item()), float(tensor[-1].item()))
    if ends != (expected, expected):
        raise RuntimeError(f"all-reduce returned {ends}, expected {expected} everywhere: the collective is broken")


def measure(size_bytes: int, warmup: int, max_iters: int, budget_s: float, device: torch.device, rank: int,
            world_size: int) -> dict[str, float | int]:
    tensor = torch.empty(size_bytes // 4, dtype=torch.float32, device=device)
    check_sum(tensor, rank, world_size)
    tensor.zero_()  # zeros stay zeros however often they are summed: no overflow to inf whatever the iterations
    warm_s = _timed(tensor, warmup, device)
    # From the slowest rank's warm-up time, so every rank runs the same number of iterations.
    iters = max(MIN_ITERS, min(max_iters, int(budget_s / max(warm_s, 1e-9))))
    seconds = _timed(tensor, iters, device)
    algbw = tensor.numel() * 4 / seconds / 1e9
    busbw = algbw * bus_factor(world_size)
    return {"size_bytes": tensor.numel() * 4, "iters": iters, "time_ms": round(seconds * 1e3, 3),
            "algbw_gb_per_s": round(algbw, 4), "busbw_gb_per_s": round(busbw, 4),
            "busbw_gbit_per_s": round(busbw * 8, 3)}


PARAMETERS_ENV = "TRAINPIPE_ALLREDUCE_BENCH"


def fail(message: str) -> int:
    print(message, file=sys.stderr, flush=True)
    return 1


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def main() -> int:
    if "RANK" not in os.environ or PARAMETERS_ENV not in os.environ:
        return fail(f"allreduce-bench: no RANK or {PARAMETERS_ENV} in the environment: the node agent's torchrun "
                    "starts it")
    bench = json.loads(os.environ[PARAMETERS_ENV])

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    try:
        # device_id binds nccl's communicator to this rank's GPU up front, so barriers never guess the device.
        dist.init_process_group(backend, timeout=timedelta(seconds=bench["timeout_s"]),
                                device_id=device if use_cuda else None)
        try:
            world_size = dist.get_world_size()
            for size_mb in bench["sizes_mb"]:
                figures = measure(size_mb * MB, bench["warmup"], bench["iters"], bench["seconds_per_size"], device,
                                  rank, world_size)
                if rank == 0:
                    emit(bench["event"], backend=backend, world_size=world_size, **figures)
        finally:
            dist.destroy_process_group()
    except RuntimeError as exc:  # torch.distributed's errors are RuntimeErrors; one line beats a traceback per rank
        return fail(f"allreduce-bench: rank {rank} ({backend}): {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
