"""A plain PyTorch DDP training script, run by trainpipe as it would run anywhere under torchrun.

It regresses y on the feature columns of the CSV files in its data dir with a small MLP, saves a
torch.distributed.checkpoint (DCP) folder every --save-every steps, and resumes from one when given. Everything it
needs from trainpipe comes from the environment: TRAINPIPE_DATA_DIR, TRAINPIPE_CHECKPOINT_DIR,
TRAINPIPE_RESUME_FROM and TRAINPIPE_METRICS_FILE (all optional flags default to them), so the same script runs
outside trainpipe with the flags given.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default=env("TRAINPIPE_DATA_DIR"), help="dir of CSV files (feature columns, y)")
    parser.add_argument("--ckpt-dir", default=env("TRAINPIPE_CHECKPOINT_DIR"), help="where checkpoints are written")
    parser.add_argument("--resume-from", default=env("TRAINPIPE_RESUME_FROM") or None, help="a checkpoint folder")
    parser.add_argument("--metrics-file", default=env("TRAINPIPE_METRICS_FILE"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--step-delay-s", type=float, default=0.0, help="sleep per step (stands in for real work)")
    return parser.parse_args()


def load_rows(data_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    features, targets = [], []
    for path in sorted(data_dir.rglob("*.csv")):
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                targets.append(float(row.pop("y")))
                features.append([float(value) for value in row.values()])
    if not features:
        raise SystemExit(f"no CSV rows under {data_dir}")
    return torch.tensor(features), torch.tensor(targets).unsqueeze(1)


def save(ddp: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, folder: Path) -> None:
    """Collective: every rank writes its shard into one DCP folder; the coordinator writes .metadata last."""
    model_state, optim_state = get_state_dict(ddp, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "step": torch.tensor(step)}, checkpoint_id=folder)


def main() -> None:
    args = parse_args()
    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))  # a spot notice: save and leave
    # One GPU per rank where there are GPUs (NCCL), else the CPU (gloo): the same script on a laptop and a GPU node.
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("GROUP_RANK", "0")
    torch.manual_seed(0)
    x, y = (t.to(device) for t in load_rows(Path(args.data_dir)))
    model = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr)

    step = 0
    if args.resume_from:
        model_state, optim_state = get_state_dict(ddp, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=args.resume_from)
        set_state_dict(ddp, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(state["step"])
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"node {node}: resumed from {args.resume_from} at step {step}", flush=True)

    generator = torch.Generator().manual_seed(rank)
    while step < args.steps:
        step += 1
        batch = torch.randint(0, len(x), (args.batch_size,), generator=generator)
        loss = torch.nn.functional.mse_loss(ddp(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.step_delay_s)
        flags = torch.tensor([loss.item(), float(stop["requested"])], device=device)
        dist.all_reduce(flags)  # every rank stops after the same step
        if rank == 0 and args.metrics_file and (step % 10 == 0 or step == 1):
            with open(args.metrics_file, "a") as metrics:
                metrics.write(json.dumps({"step": step, "loss": flags[0].item() / world, "total_steps": args.steps})
                              + "\n")
        if step % args.save_every == 0 or step == args.steps or flags[1] > 0:
            save(ddp, optimizer, step, Path(args.ckpt_dir) / f"step-{step}")
        if flags[1] > 0:
            print(f"node {node}: stopped by SIGTERM after step {step}, saved", flush=True)
            break
    # DDP's reducer holds the process group: free it first, or its teardown waits on a gloo thread forever.
    del ddp, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
