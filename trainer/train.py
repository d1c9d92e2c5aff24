"""The training workload torchrun starts on every node: `python -m trainer.train --data-dir ... --ckpt-dir ...`.

Read top to bottom: set up the process group, data and model; optionally resume; train with AdamW under a
warm-up + cosine schedule, checkpointing to node-local disk; evaluate on a fixed held-out set; report, with where
the step time went (trainer.step_timing: compute, gradient communication, data, checkpoints).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer.checkpoint import (
    SAVE_MODES,
    Checkpointer,
    CheckpointError,
    SaveRecord,
    load_checkpoint,
    load_model_weights,
    wait_for_upload,
)
from trainer.data import DataError, TokenWindows
from trainer.metrics import TrainingMetrics
from trainer.model import GPT, add_model_options, model_config, next_token_loss
from trainer.step_timing import StepTimer

# The cosine decays to this fraction of the peak rather than to zero, so the last steps still learn.
MIN_LR_FRACTION = 0.1
GRAD_CLIP_NORM = 1.0
# A last save on SIGTERM is started only when the time left exceeds the slowest save so far by this factor.
LAST_SAVE_MARGIN = 1.5
EXIT_STOPPED = 128 + signal.SIGTERM
# Mode direct: the wait for an upload gives up before --collective-timeout-s, so the collective that tells every rank
# about it does not time out first on the ranks already waiting in it.
UPLOAD_WAIT_SHARE = 0.8


class TrainError(RuntimeError):
    """A failure the trainer explains in one line (environment, resume mismatch, divergence) naming the fix."""


class TrainStopped(Exception):
    """SIGTERM ended training early; the message says which step was saved last."""


class StopSignal:
    """Remembers when SIGTERM arrived, so the loop can stop at a step boundary and budget a last save."""

    def __init__(self) -> None:
        self.received_at: float | None = None
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()

    def time_left(self, deadline_s: float) -> float:
        return deadline_s - (time.monotonic() - self.received_at) if self.received_at is not None else deadline_s


def _env_path(name: str) -> Path | None:
    # trainpipe runs this script like any other: its inputs come from the TRAINPIPE_* environment by default.
    value = os.environ.get(name)
    return Path(value) if value else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__)
    parser.add_argument("--data-dir", type=Path,
                        help="node-local dataset dir (manifest.json): the staged copy (default: $TRAINPIPE_DATA_DIR)")
    parser.add_argument("--data-url", help="dataset root in an object store (file://, s3://, gs://), read in place "
                        "with one ranged GET per sequence instead of a staged copy (dataset.access remote)")
    parser.add_argument("--ckpt-dir", type=Path, default=_env_path("TRAINPIPE_CHECKPOINT_DIR"),
                        help="node-local checkpoint root (default: $TRAINPIPE_CHECKPOINT_DIR)")
    parser.add_argument("--metrics-file", type=Path, default=_env_path("TRAINPIPE_METRICS_FILE"),
                        help="JSON-lines metrics, written by global rank 0 (default: $TRAINPIPE_METRICS_FILE)")
    parser.add_argument("--steps", type=int, default=300, help="total optimizer steps (a resumed run counts from 0)")
    parser.add_argument("--ckpt-every", type=int, default=50, help="save every this many steps and at the end")
    parser.add_argument("--ckpt-mode", choices=SAVE_MODES, default="async",
                        help="async: stage to CPU memory and write in the background; sync: block until written; "
                        "direct: as sync, then also wait until the node's syncer has uploaded the step")
    parser.add_argument("--flush-deadline-s", type=float, default=20.0,
                        help="on SIGTERM, finish (or start) a last save only if it fits in this many seconds")
    parser.add_argument("--keep-local", type=int, default=2, help="complete checkpoints kept on local disk")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per process per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up steps")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model init and the data order")
    add_model_options(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    parser.add_argument("--log-every", type=int, default=10, help="metrics every this many steps")
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches for the final eval loss")
    parser.add_argument("--step-delay-s", type=float, default=0.0,
                        help="sleep this long in each step, standing in for a bigger model's compute (demos, tests)")
    parser.add_argument("--resume-from", type=Path, default=_env_path("TRAINPIPE_RESUME_FROM"),
                        help="step dir holding every node's files (default: $TRAINPIPE_RESUME_FROM)")
    parser.add_argument("--init-from", type=Path, default=_env_path("TRAINPIPE_INIT_FROM"),
                        help="warm start: load only the model weights of this checkpoint dir and train a new schedule "
                        "(fresh optimizer, step 1); ignored when resuming (default: $TRAINPIPE_INIT_FROM)")
    parser.add_argument(
        "--collective-timeout-s", type=float, default=600.0, help="fail when a peer stops answering this long"
    )
    args = parser.parse_args(argv)
    for flag in ("steps", "ckpt_every", "keep_local", "batch_size", "threads", "log_every", "eval_batches"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1 (got {getattr(args, flag)})")
    if args.step_delay_s < 0:
        parser.error(f"--step-delay-s must be >= 0 (got {args.step_delay_s})")
    if args.d_model % args.n_heads:
        parser.error(f"--n-heads {args.n_heads} must divide --d-model {args.d_model}")
    if args.data_dir is not None and args.data_url is not None:
        parser.error("give one of --data-dir (a staged copy) and --data-url (read in place), not both")
    if args.data_url is None and args.data_dir is None:
        args.data_dir = _env_path("TRAINPIPE_DATA_DIR")
    for flag, value in (("--data-dir or --data-url", args.data_dir or args.data_url), ("--ckpt-dir", args.ckpt_dir),
                        ("--metrics-file", args.metrics_file)):
        if not value:
            parser.error(f"{flag} is required (trainpipe sets it through TRAINPIPE_* variables)")
    return args


def lr_at(step: int, peak: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate of 1-based `step`: linear warm-up to `peak`, then cosine decay to MIN_LR_FRACTION * peak."""
    if step <= warmup_steps:
        return peak * step / warmup_steps
    progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
    floor = MIN_LR_FRACTION * peak
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def _env_rank(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise TrainError(f"environment variable {name} is not set: start the trainer with torchrun")
    return int(value)


def _mean_loss_and_stop(loss: torch.Tensor, stop: bool) -> tuple[float, bool]:
    """One all-reduce carries the loss and the stop flag, so every rank stops after the same step."""
    # Gloo has no ReduceOp.AVG, so sum and divide.
    total = torch.stack([loss.detach().float(), torch.tensor(float(stop), device=loss.device)])
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total[0].item() / dist.get_world_size(), total[1].item() > 0


def _all_ranks_agree(flag: bool, device: torch.device) -> bool:
    value = torch.tensor([0.0 if flag else 1.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value.item() == 0


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], rank: int, world_size: int) -> float:
    """Mean loss over the held-out batches, split across ranks (the bare module: no DDP collectives)."""
    model.eval()
    device = next(model.parameters()).device
    # On the device, because NCCL reduces only GPU tensors.
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in batches[rank::world_size]:
        sums[0] += next_token_loss(model, batch.to(device)).item()
        sums[1] += 1
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    model.train()
    return (sums[0] / sums[1]).item()


class SaveLog:
    """Reports finished saves to the metrics and remembers what a last save on SIGTERM needs to decide."""

    def __init__(self, metrics: TrainingMetrics, saved_step: int | None) -> None:
        self.metrics = metrics
        self.saved_step = saved_step  # the newest step saved completely (or resumed from)
        self.slowest_s = 0.0
        self.count = 0
        self.bytes = 0  # this node's files, summed over the saves reported
        # A background save that failed on this rank before any SIGTERM here: a peer's SIGTERM ends its writer
        # process, which fails this rank's save too, so the next stop agreement decides whether it is an error.
        self.failed: CheckpointError | None = None

    def report(self, records: list[SaveRecord]) -> None:
        for record in records:
            self.count += 1
            self.bytes += record.bytes
            self.slowest_s = max(self.slowest_s, record.write_s)
            self.saved_step = max(self.saved_step or 0, record.step)
            self.metrics.checkpoint(record)


def _extra(step: int, args: argparse.Namespace, metrics: TrainingMetrics) -> dict[str, Any]:
    # The data position is the step, so continuing at step + 1 replays nothing.
    return {"step": step, "data_position": step + 1, "seed": args.seed, "recent_losses": metrics.recent_losses}


def _report_finished_saves(checkpointer: Checkpointer, saves: SaveLog, stop: StopSignal) -> None:
    """Reports finished saves; a failure is left to the next step boundary instead of ending this rank.

    torchrun signals the worker's whole process group, so the SIGTERM that stops training also ends the writer
    process mid-save, and with it the save on every other rank (their writers share a collective). Raising here
    would make this rank exit while its peers wait in the collective that agrees on stopping; the stop path
    (next step boundary) reports the lost save and decides on a last one. Without any stop, the failure is raised
    there.
    """
    try:
        saves.report(checkpointer.finished())
    except CheckpointError as exc:
        if stop.received_at is None:
            # Raised at the next step boundary unless the ranks then agree to stop (a peer was signalled).
            saves.failed = exc
        when = "after SIGTERM" if stop.received_at is not None else "a peer may be stopping"
        print(f"trainer (rank {os.environ.get('RANK', '?')}): {when}: {exc}", file=sys.stderr, flush=True)


def _wait_for_upload(step: int, args: argparse.Namespace, node_rank: int, is_node_leader: bool,
                     device: torch.device) -> None:
    """Mode direct: every rank blocks until every node's syncer has uploaded the node's part of `step`.

    The node's local rank 0 watches its syncer; the collective after that holds every rank for as long as the
    slowest node, and tells every rank about a failure, so none is left waiting for a peer that gave up.
    """
    error: CheckpointError | None = None
    if is_node_leader:
        try:
            wait_for_upload(step, node_rank, UPLOAD_WAIT_SHARE * args.collective_timeout_s)
        except CheckpointError as exc:
            error = exc
    if not _all_ranks_agree(error is None, device):
        if error is not None:
            raise TrainError(str(error)) from error
        raise TrainError(
            f"step {step}: another node's checkpoint syncer did not upload it in time (--ckpt-mode direct): "
            "see that node's trainer error"
        )


def _node_count(world_size: int) -> int:
    # torchrun sets GROUP_WORLD_SIZE (its agents, one per node); elsewhere assume nodes of LOCAL_WORLD_SIZE each.
    if "GROUP_WORLD_SIZE" in os.environ:
        return _env_rank("GROUP_WORLD_SIZE")
    return world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def _save_on_stop(
    step: int,
    args: argparse.Namespace,
    checkpointer: Checkpointer,
    saves: SaveLog,
    stop: StopSignal,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> str:
    """SIGTERM: finish the save in flight, then save this step too if the deadline leaves time for it."""
    device = next(model.parameters()).device
    try:
        saves.report(checkpointer.wait())
    except CheckpointError as exc:
        # The same SIGTERM may have ended the writer process mid-save: that step stays unmarked, never shipped.
        print(f"trainer (rank {os.environ.get('RANK', '?')}): {exc}", file=sys.stderr, flush=True)
    # Every rank must take the same branches: a save is collective.
    if _all_ranks_agree(saves.saved_step == step, device):
        return f"stopped by SIGTERM after step {step}: step {step} is saved"
    left = stop.time_left(args.flush_deadline_s)
    if not _all_ranks_agree(left > LAST_SAVE_MARGIN * saves.slowest_s, device):
        return (f"stopped by SIGTERM after step {step}: no time for a last save ({left:.1f}s of "
                f"--flush-deadline-s left, a save takes {saves.slowest_s:.1f}s); last saved step {saves.saved_step}")
    checkpointer.save(step, model, optimizer, _extra(step, args, saves.metrics), blocking=True)
    saves.report(checkpointer.wait())
    return f"stopped by SIGTERM after step {step}: saved step {step}"


def train(args: argparse.Namespace) -> None:
    rank, local_rank = _env_rank("RANK"), _env_rank("LOCAL_RANK")
    world_size, node_rank = _env_rank("WORLD_SIZE"), _env_rank("GROUP_RANK")
    torch.set_num_threads(args.threads)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=args.collective_timeout_s))
    stop = StopSignal()
    # Built before data and model: its writer process takes seconds to start (a fresh interpreter imports torch),
    # and starting it now keeps the first checkpoint from waiting for it.
    checkpointer = Checkpointer(
        args.ckpt_dir, args.ckpt_mode, keep_local=args.keep_local, timeout_s=args.collective_timeout_s
    )
    try:
        # --- data and model -------------------------------------------------------------------------------
        data = TokenWindows(
            args.data_url if args.data_url is not None else args.data_dir,
            seq_len=args.seq_len,
            vocab_size=args.vocab_size,
        )
        read_latency_s = data.reader.read_latency_s()
        config = model_config(args)
        torch.manual_seed(args.seed)
        model = GPT(config).to(device)
        ddp_model = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
        timer = StepTimer(device)
        timer.attach(ddp_model)
        optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)

        # --- resume: the data position is the step, so continuing at step + 1 replays nothing ---------------
        start_step, recent_losses = 1, []
        if args.resume_from is not None:
            extra = load_checkpoint(args.resume_from, ddp_model, optimizer)
            missing = [key for key in ("seed", "data_position", "recent_losses") if key not in extra]
            if missing:
                raise CheckpointError(
                    f"{args.resume_from}: extra lacks {', '.join(missing)}: resume only from trainer.train checkpoints"
                )
            if extra["seed"] != args.seed:
                raise TrainError(
                    f"{args.resume_from}: saved with --seed {extra['seed']}, not {args.seed}: "
                    f"pass --seed {extra['seed']} to continue the same data order"
                )
            start_step, recent_losses = extra["data_position"], extra["recent_losses"]
            if rank == 0:
                print(f"resumed from {args.resume_from} at step {start_step}", flush=True)
        elif args.init_from is not None:
            # A new schedule from those weights: the optimizer's moments and the step count start afresh.
            load_model_weights(args.init_from, model)
            if rank == 0:
                print(f"warm start from {args.init_from}", flush=True)

        metrics = TrainingMetrics(
            args.metrics_file if rank == 0 else None,
            log_every=args.log_every,
            first_step=start_step,
            last_step=args.steps,
            recent_losses=recent_losses,
        )
        # The source's entropy rate: the loss a perfect model reaches on this data, drawn beside the loss curve.
        metrics.fact(loss_floor=data.loss_floor)
        tokens_per_step = args.batch_size * args.seq_len * world_size
        saves = SaveLog(metrics, saved_step=start_step - 1 if args.resume_from is not None else None)

        # The writer process starting is a one-time cost: waiting here keeps it out of the first save's stall
        # and so out of the step times the breakdown reports (by now it has usually started anyway).
        checkpointer.ready()

        # --- the loop ------------------------------------------------------------------------------------
        for step in range(start_step, args.steps + 1):
            timer.start_step()
            lr = lr_at(step, args.lr, args.warmup_steps, args.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with timer.phase("data"):
                batch = data.train_batch(args.seed, step, rank, world_size, args.batch_size).to(device)
            loss = next_token_loss(ddp_model, batch)
            optimizer.zero_grad(set_to_none=True)
            with timer.backward():
                loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), GRAD_CLIP_NORM)
            optimizer.step()
            if args.step_delay_s:  # not even a zero sleep's yield in the benchmark's own steps
                time.sleep(args.step_delay_s)
            if step == start_step:
                checkpointer.prepare(ddp_model, optimizer)
            with timer.phase("sync"):
                mean_loss, stopping = _mean_loss_and_stop(loss, stop.received_at is not None)
            if saves.failed is not None and not stopping:
                raise saves.failed
            if not math.isfinite(mean_loss):
                raise TrainError(f"loss became {mean_loss} at step {step}: lower --lr or raise --warmup-steps")
            metrics.record(step, mean_loss, lr)
            _report_finished_saves(checkpointer, saves, stop)
            if stopping:
                raise TrainStopped(_save_on_stop(step, args, checkpointer, saves, stop, ddp_model, optimizer))
            if step % args.ckpt_every == 0 or step == args.steps:
                with timer.phase("ckpt"):
                    checkpointer.save(step, ddp_model, optimizer, _extra(step, args, metrics))
                    _report_finished_saves(checkpointer, saves, stop)
                    if args.ckpt_mode == "direct":
                        with timer.phase("upload"):
                            _wait_for_upload(step, args, node_rank, local_rank == 0, device)
            metrics.end_step(step, timer.end_step(), tokens_per_step)
        if saves.failed is not None:
            raise saves.failed
        try:
            saves.report(checkpointer.wait())
        except CheckpointError as exc:
            if stop.received_at is None:
                raise
            raise TrainStopped(
                f"stopped by SIGTERM after step {args.steps}: its save was cut short ({exc}); "
                f"last saved step {saves.saved_step}"
            ) from exc

        # --- final eval and report -----------------------------------------------------------------------
        eval_loss = evaluate(model, data.eval_batches(args.seed, args.eval_batches, args.batch_size), rank, world_size)
        breakdown = timer.breakdown(
            read_bytes=data.train_read_bytes,
            read_requests=data.train_reads,
            read_latency_s=read_latency_s,
            data_source=data.source,
            ckpt_bytes=saves.bytes,
            ckpt_saves=saves.count,
            ckpt_mode=args.ckpt_mode,
            world_size=world_size,
            nodes=_node_count(world_size),
        )
        metrics.done(eval_loss, breakdown)
        dist.barrier()
    finally:
        try:
            checkpointer.close()
        finally:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        train(args)
    except TrainStopped as stopped:
        print(f"trainer (rank {os.environ.get('RANK', '?')}): {stopped}", file=sys.stderr, flush=True)
        return EXIT_STOPPED
    except (TrainError, DataError, CheckpointError) as exc:
        # Expected failures get one readable line; anything else keeps its traceback.
        print(f"trainer error (rank {os.environ.get('RANK', '?')}): {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
