"""Token windows from a node-local dataset (manifest.json + raw uint16 shards), as a pure function of the step.

Every batch is drawn from (seed, step) alone, so the data position of a run *is* its step: a run resumed at
step s + 1 sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MANIFEST_NAME = "manifest.json"
DATASET_FORMAT = "trainpipe-tokens-v1"
TOKEN_DTYPE = "uint16"

# Separate seed streams keep the eval batches out of the training order whatever the step count.
_TRAIN_STREAM = 0
_EVAL_STREAM = 1


class DataError(ValueError):
    """A dataset that cannot be read for training; the message names the file and the fix."""


@dataclass(frozen=True)
class Manifest:
    vocab_size: int
    loss_floor: float | None
    shards: tuple[tuple[str, int], ...]  # (file name, token count), in stream order


def read_manifest(data_dir: Path) -> Manifest:
    path = data_dir / MANIFEST_NAME
    if not path.is_file():
        raise DataError(f"{path}: no dataset manifest: stage the dataset into {data_dir} first")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}): re-stage the dataset") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path}: expected a JSON object with format, dtype, vocab_size, shards: re-stage the dataset")
    if raw.get("format") != DATASET_FORMAT:
        raise DataError(f"{path}: format {raw.get('format')!r} is not {DATASET_FORMAT!r}: re-export the dataset")
    if raw.get("dtype") != TOKEN_DTYPE:
        raise DataError(f"{path}: dtype {raw.get('dtype')!r} is not {TOKEN_DTYPE!r}: re-export the dataset")
    try:
        vocab_size = int(raw["vocab_size"])
        shards = [(str(s["name"]), int(s["tokens"])) for s in raw["shards"]]
        loss_floor = None if raw.get("loss_floor") is None else float(raw["loss_floor"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: missing or malformed field {exc}: re-export the dataset") from None
    if not shards:
        raise DataError(f"{path}: lists no shards: re-export the dataset with at least one shard")
    return Manifest(
        vocab_size=vocab_size,
        loss_floor=loss_floor,
        shards=tuple(shards),
    )


class TokenWindows:
    """Random windows of seq_len + 1 tokens, each inside one shard (a window never spans two shards)."""

    def __init__(self, data_dir: Path, seq_len: int, vocab_size: int) -> None:
        manifest = read_manifest(data_dir)
        if manifest.vocab_size != vocab_size:
            raise DataError(
                f"{data_dir / MANIFEST_NAME}: dataset vocab_size {manifest.vocab_size} != model vocab_size "
                f"{vocab_size}: set the model's vocab_size (--vocab-size) to {manifest.vocab_size}"
            )
        self.window = seq_len + 1
        self.loss_floor = manifest.loss_floor
        self.shards = [self._open_shard(data_dir / name, tokens) for name, tokens in manifest.shards]
        starts_per_shard = np.array([max(len(s) - self.window + 1, 0) for s in self.shards], dtype=np.int64)
        self.num_windows = int(starts_per_shard.sum())
        if self.num_windows == 0:
            raise DataError(
                f"{data_dir / MANIFEST_NAME}: no shard holds {self.window} tokens (seq_len + 1): "
                "lower --seq-len or write larger shards"
            )
        # Window index w lies in shard i when first_window[i] <= w < first_window[i + 1].
        self._first_window = np.concatenate([[0], np.cumsum(starts_per_shard)])

    @staticmethod
    def _open_shard(path: Path, tokens: int) -> np.memmap:
        if not path.is_file():
            raise DataError(f"{path}: shard listed in the manifest is missing: re-stage the dataset")
        expected = tokens * np.dtype(np.uint16).itemsize
        size = path.stat().st_size
        if size != expected:
            raise DataError(f"{path}: {size} bytes but the manifest says {expected}: re-stage the dataset")
        return np.memmap(path, dtype="<u2", mode="r", shape=(tokens,))

    def _windows(self, rng: np.random.Generator, count: int) -> torch.Tensor:
        indices = rng.integers(0, self.num_windows, size=count)
        shard_of = np.searchsorted(self._first_window, indices, side="right") - 1
        offsets = indices - self._first_window[shard_of]
        rows = [self.shards[s][o : o + self.window] for s, o in zip(shard_of, offsets, strict=True)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def train_batch(self, seed: int, step: int, rank: int, world_size: int, batch_size: int) -> torch.Tensor:
        """This rank's (batch_size, seq_len + 1) int64 slice of the global batch of `step`."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}: check RANK and WORLD_SIZE")
        rng = np.random.default_rng([seed, _TRAIN_STREAM, step])
        global_batch = self._windows(rng, batch_size * world_size)
        return global_batch[rank * batch_size : (rank + 1) * batch_size]

    def eval_batches(self, seed: int, num_batches: int, batch_size: int) -> list[torch.Tensor]:
        """A fixed held-out set: the same batches for every run with this seed, whatever its length."""
        rng = np.random.default_rng([seed, _EVAL_STREAM])
        return [self._windows(rng, batch_size) for _ in range(num_batches)]
