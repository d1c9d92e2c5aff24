"""The bundled trainer's evaluation: `python -m trainer.evaluate --checkpoint DIR` writes {"eval_loss": x, ...} to
TRAINPIPE_EVAL_FILE, the metrics a job's `evaluate:` gate and `promote:` compare.

One process, no torchrun: the model's weights are loaded from the committed checkpoint (restored on this node as
{checkpoint}) and scored on the held-out batches of the data dir, the same fixed set the trainer's own final eval
uses (its seed picks them), so two checkpoints of the same model shape are scored on the same tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from pathlib import Path

import torch

from trainer.checkpoint import CheckpointError, load_model_weights
from trainer.data import DataError, TokenWindows
from trainer.model import GPT, add_model_options, model_config, next_token_loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="a committed checkpoint's step dir")
    parser.add_argument("--data-dir", type=Path, default=os.environ.get("TRAINPIPE_DATA_DIR") or None,
                        help="the token dataset (default: $TRAINPIPE_DATA_DIR)")
    parser.add_argument("--out", type=Path, default=os.environ.get("TRAINPIPE_EVAL_FILE") or None,
                        help="where the metrics JSON goes (default: $TRAINPIPE_EVAL_FILE)")
    parser.add_argument("--seed", type=int, default=0, help="picks the held-out batches (the trainer's --seed)")
    parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches scored")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per batch")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    add_model_options(parser)
    args = parser.parse_args(argv)
    for flag in ("data_dir", "out"):
        if getattr(args, flag) is None:
            parser.error(f"--{flag.replace('_', '-')} is required (trainpipe sets it through TRAINPIPE_* variables)")
    return args


@torch.no_grad()
def eval_loss(args: argparse.Namespace) -> float:
    torch.set_num_threads(args.threads)
    # One process on purpose: DCP's note that it loads without a process group says nothing the user needs.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    data = TokenWindows(args.data_dir, seq_len=args.seq_len, vocab_size=args.vocab_size)
    model = GPT(model_config(args))
    load_model_weights(args.checkpoint, model)
    model.eval()
    losses = [next_token_loss(model, batch).item()
              for batch in data.eval_batches(args.seed, args.eval_batches, args.batch_size)]
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        loss = eval_loss(args)
    except (DataError, CheckpointError) as exc:
        print(f"evaluate error: {exc}", file=sys.stderr, flush=True)
        return 1
    metrics = {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(metrics))
    print(f"evaluate: {args.checkpoint}: eval_loss {loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
