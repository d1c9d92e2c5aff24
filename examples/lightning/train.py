"""A Lightning module trained with Lightning's own Trainer and ModelCheckpoint, run by trainpipe under torchrun.

It regresses y on the feature columns of the Parquet files in its data dir. Lightning writes its checkpoints
(`epoch=E-step=S.ckpt`) into --ckpt-dir; trainpipe commits each one as Lightning closes it and hands the newest
back through --ckpt-path ({resume_from}) after a preemption. Lightning reads torchrun's environment itself.
Its progress bar draws off a terminal only when training ends (rich), so a small callback logs each step's loss
to TRAINPIPE_METRICS_FILE through trainpipe_sdk: the progress, loss curve and `at_step` chaos follow it live.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import lightning as L
import pandas as pd
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from trainpipe_sdk import log_metrics


class LogToTrainpipe(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: dict, batch: object,
                           index: int) -> None:
        log_metrics(trainer.global_step, float(outputs["loss"]), total_steps=trainer.max_steps)


class StepDelay(L.Callback):
    """A sleep per step that stands in for real work (this model's steps take milliseconds)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: object) -> None:
        time.sleep(self.seconds)


class Regressor(L.LightningModule):
    def __init__(self, features: int, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(features, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def load(data_dir: Path) -> torch.utils.data.TensorDataset:
    frame = pd.concat([pd.read_parquet(path) for path in sorted(data_dir.rglob("*.parquet"))])
    y = torch.tensor(frame.pop("y").to_numpy(), dtype=torch.float32).unsqueeze(1)
    return torch.utils.data.TensorDataset(torch.tensor(frame.to_numpy(), dtype=torch.float32), y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--ckpt-path", default=None, help="a checkpoint to resume from")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--step-delay-s", type=float, default=0.0, help="sleep per step (stands in for real work)")
    args = parser.parse_args()

    L.seed_everything(0)
    dataset = load(Path(args.data_dir))
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True)
    checkpoints = ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.save_every, save_top_k=2,
                                  monitor="step", mode="max", filename="{epoch}-{step}")
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("TRAINPIPE_NUM_NODES", "1")),
        strategy=DDPStrategy(process_group_backend="gloo"), max_steps=args.max_steps,
        callbacks=[checkpoints, LogToTrainpipe(), *([StepDelay(args.step_delay_s)] if args.step_delay_s else [])],
        logger=False, log_every_n_steps=5, enable_model_summary=False,
    )
    if args.ckpt_path and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        step = torch.load(args.ckpt_path, map_location="cpu", weights_only=False)["global_step"]
        print(f"node {os.environ.get('GROUP_RANK', '0')}: resuming from {args.ckpt_path} at step {step}", flush=True)
    trainer.fit(Regressor(dataset.tensors[0].shape[1], lr=1e-2), loader, ckpt_path=args.ckpt_path)
    # Leave the process group before the interpreter exits: left to exit, gloo's threads may be torn down after the
    # other node has gone and the process aborts ("terminate called without an active exception", exit 1) though
    # training ended, as a resume from the final step does when its peer finds nothing to do and leaves first.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
