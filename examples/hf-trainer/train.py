"""A Hugging Face `Trainer` fine-tune, run by trainpipe as it would run anywhere under torchrun.

A small GPT-2 learns the bytes of the JSONL texts in its data dir: fine-tuned from `--model_name_or_path` (a model
saved with `save_pretrained`: the job stages make_data.py's base model to every node as an input, {input_base}), or
built from a config without it (no hub access either way). The Trainer's own checkpoints (`checkpoint-N/` in
--output_dir) are what trainpipe commits; `--resume_from_checkpoint` is the Trainer's own resume and wins over the
base model, whose weights it replaces. Nothing here knows trainpipe: the job passes the dirs as ordinary arguments
({data_dir}, {checkpoint_dir}, {resume_from}, {input_base}) and trainpipe follows the Trainer's own log lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

WINDOW = 64


class ByteWindows(torch.utils.data.Dataset):
    """Every text's UTF-8 bytes, cut into fixed windows: a tokenizer-free language-modelling dataset."""

    def __init__(self, data_dir: Path) -> None:
        data = bytearray()
        for path in sorted(data_dir.rglob("*.jsonl")):
            for line in path.read_text().splitlines():
                if line.strip():
                    data += json.loads(line)["text"].encode() + b"\n"
        if len(data) < WINDOW:
            raise SystemExit(f"no JSONL text under {data_dir}")
        self.tokens = torch.tensor(list(data), dtype=torch.long)

    def __len__(self) -> int:
        return len(self.tokens) // WINDOW

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.tokens[index * WINDOW:(index + 1) * WINDOW]
        return {"input_ids": window, "labels": window}


def new_model() -> GPT2LMHeadModel:
    """The example's GPT-2, built from a config: what make_data.py saves as the base model."""
    config = GPT2Config(vocab_size=256, n_positions=WINDOW, n_embd=64, n_layer=2, n_head=2, bos_token_id=10,
                        eos_token_id=10)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def node_says(message: str) -> None:
    """One line per node (its local rank 0), prefixed the way the tests and the logs find it."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"node {os.environ.get('GROUP_RANK', '0')}: {message}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--model_name_or_path", default=None, help="a dir saved with save_pretrained (no hub)")
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--save_steps", type=int, default=20)
    parser.add_argument("--logging_steps", type=int, default=5)
    args = parser.parse_args()

    if args.model_name_or_path:
        model = GPT2LMHeadModel.from_pretrained(args.model_name_or_path, local_files_only=True)
        node_says(f"fine-tuning the base model from {args.model_name_or_path}")
    else:
        model = new_model()
    # With the job's tracking section trainpipe gives every rank MLFLOW_RUN_ID: the Trainer's MLflow callback (rank 0
    # only) then logs into the trainpipe run's MLflow run. Its params are left to trainpipe (the job, flattened): MLflow
    # refuses a param whose value changes, and a resumed attempt's arguments may differ from the first's.
    tracked = bool(os.environ.get("MLFLOW_RUN_ID"))
    if tracked:
        os.environ.setdefault("MLFLOW_MAX_LOG_PARAMS", "0")
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, save_steps=args.save_steps, save_total_limit=2,
        logging_steps=args.logging_steps, per_device_train_batch_size=16, learning_rate=3e-3, warmup_steps=5,
        use_cpu=True, ddp_backend="gloo", report_to=["mlflow"] if tracked else [], dataloader_num_workers=0, seed=0,
    )
    if args.resume_from_checkpoint:
        state = json.loads((Path(args.resume_from_checkpoint) / "trainer_state.json").read_text())
        node_says(f"resuming from {args.resume_from_checkpoint} at step {state['global_step']}")
    trainer = Trainer(model=model, args=training, train_dataset=ByteWindows(Path(args.data_dir)))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    # The Trainer leaves its process group open. At exit the DDP reducer's gloo group is then destroyed with the GIL
    # held while a gloo worker finishing a collective needs it: the rank hangs (or dies in std::terminate) after a
    # run that succeeded (seen with torch 2.13 under load). So: wait for every collective (the barrier releases the
    # GIL), close the group, and leave without running the destructors; the checkpoints are closed files by now.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
