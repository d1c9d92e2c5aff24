"""Score a checkpoint on held-out texts: python evaluate.py --checkpoint DIR --data_dir DIR [--eval_file FILE].

DIR is a model saved with `save_pretrained` (a Trainer `checkpoint-N/`, as trainpipe restores the committed one for
{checkpoint}, or the base model). Writes {"eval_loss": ...}, the mean next-byte loss over every window of the JSONL
texts under --data_dir, to --eval_file (default: TRAINPIPE_EVAL_FILE, where trainpipe's evaluate: reads it).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from train import ByteWindows
from transformers import GPT2LMHeadModel


def eval_loss(checkpoint: Path, data_dir: Path, batch_size: int = 64) -> float:
    model = GPT2LMHeadModel.from_pretrained(checkpoint, local_files_only=True)
    model.eval()
    windows = ByteWindows(data_dir)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            batch = torch.stack([windows[i]["input_ids"] for i in range(start, min(start + batch_size, len(windows)))])
            total += model(input_ids=batch, labels=batch).loss.item() * len(batch)
            count += len(batch)
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--data_dir", required=True, type=Path)
    parser.add_argument("--eval_file", default=os.environ.get("TRAINPIPE_EVAL_FILE"))
    args = parser.parse_args()
    if not args.eval_file:
        raise SystemExit("no --eval_file and no TRAINPIPE_EVAL_FILE: say where the metrics go")
    metrics = {"eval_loss": eval_loss(args.checkpoint, args.data_dir)}
    Path(args.eval_file).write_text(json.dumps(metrics))
    print(f"eval_loss {metrics['eval_loss']:.4f} of {args.checkpoint} on {args.data_dir}", flush=True)


if __name__ == "__main__":
    main()
