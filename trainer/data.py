"""Token windows from a node-local dataset (manifest.json + raw uint16 shards), as a pure function of the step.

Every batch is drawn from (seed, step) alone, so the data position of a run *is* its step: a run resumed at
step s + 1 sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from infra.dataset.manifest import MANIFEST_KEY, DatasetError, DatasetManifest, load_manifest
from infra.storage import open_store

# Separate seed streams keep the eval batches out of the training order whatever the step count.
_TRAIN_STREAM = 0
_EVAL_STREAM = 1


class DataError(ValueError):
    """A dataset that cannot be read for training; the message names the file and the fix."""


def read_manifest(data_dir: Path) -> DatasetManifest:
    """The staged dataset's manifest, parsed by the same model the dataset tools write it with."""
    try:
        return load_manifest(open_store(str(data_dir)))
    except DatasetError as exc:
        raise DataError(str(exc)) from None


class TokenWindows:
    """Random windows of seq_len + 1 tokens, each inside one shard (a window never spans two shards)."""

    def __init__(self, data_dir: Path, seq_len: int, vocab_size: int) -> None:
        manifest = read_manifest(data_dir)
        if manifest.vocab_size != vocab_size:
            raise DataError(
                f"{data_dir / MANIFEST_KEY}: dataset vocab_size {manifest.vocab_size} != model vocab_size "
                f"{vocab_size}: set the model's vocab_size (--vocab-size) to {manifest.vocab_size}"
            )
        self.window = seq_len + 1
        self.loss_floor = manifest.loss_floor
        self.shards = [self._open_shard(data_dir / shard.name, shard.tokens) for shard in manifest.shards]
        starts_per_shard = np.array([max(len(s) - self.window + 1, 0) for s in self.shards], dtype=np.int64)
        self.num_windows = int(starts_per_shard.sum())
        if self.num_windows == 0:
            raise DataError(
                f"{data_dir / MANIFEST_KEY}: no shard holds {self.window} tokens (seq_len + 1): "
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
