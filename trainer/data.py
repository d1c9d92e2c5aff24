"""Token windows from a dataset (manifest.json + raw uint16 shards), as a pure function of the step.

Every batch is drawn from (seed, step) alone, so the data position of a run *is* its step: a run resumed at
step s + 1 sees exactly the batches an uninterrupted run would have seen.

Where the tokens come from is a reader's business, and the choice of windows is not: a node-local copy
(the staged dataset, read through np.memmap) and an object store (one ranged GET per window, as a mounted
object store pays a request per sample read) yield the same batches bit for bit.
"""

from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import torch

from infra.dataset.manifest import MANIFEST_KEY, TOKEN_BYTES, DatasetError, DatasetManifest, load_manifest
from infra.storage import ObjectStore, StorageError, open_store

# Separate seed streams keep the eval batches out of the training order whatever the step count.
_TRAIN_STREAM = 0
_EVAL_STREAM = 1
_TOKEN_DTYPE = np.dtype("<u2")
LATENCY_PROBES = 5


class DataError(ValueError):
    """A dataset that cannot be read for training; the message names the file and the fix."""


def read_manifest(data_dir: Path) -> DatasetManifest:
    """The staged dataset's manifest, parsed by the same model the dataset tools write it with."""
    return _load(open_store(str(data_dir)))


def _load(store: ObjectStore) -> DatasetManifest:
    try:
        return load_manifest(store)
    except (DatasetError, StorageError) as exc:
        raise DataError(str(exc)) from None


class WindowReader(ABC):
    """Reads token ranges of the manifest's shards; the only part of TokenWindows that depends on the source."""

    source: str  # StepBreakdown.data_source: "local" or "remote"

    def __init__(self, manifest: DatasetManifest, manifest_location: str) -> None:
        self.manifest = manifest
        self.manifest_location = manifest_location  # named by errors about the dataset as a whole

    @abstractmethod
    def read(self, shard: int, start: int, tokens: int) -> np.ndarray:
        """Tokens [start, start + tokens) of shard `shard` (its index in the manifest), little-endian uint16."""

    @abstractmethod
    def read_byte(self, shard: int, offset: int) -> None:
        """One byte of a shard: the smallest read the source serves, to measure its latency."""

    def read_latency_s(self, probes: int = LATENCY_PROBES) -> float:
        """Median time of `probes` 1-byte reads spread over the shards (the median ignores one slow first read)."""
        shards = [(index, shard.bytes) for index, shard in enumerate(self.manifest.shards) if shard.bytes > 0]
        times = []
        for probe in range(probes):
            shard, size = shards[probe % len(shards)]
            started = time.perf_counter()
            # A prime stride spreads the probes so a cache of the previous probe's block does not answer them.
            self.read_byte(shard, (probe * 7919) % size)
            times.append(time.perf_counter() - started)
        return statistics.median(times)


class MemmapReader(WindowReader):
    """A node-local dataset dir (the staged copy), every shard mapped into memory once."""

    source = "local"

    def __init__(self, data_dir: Path) -> None:
        super().__init__(read_manifest(data_dir), str(data_dir / MANIFEST_KEY))
        self._maps = [self._open_shard(data_dir / shard.name, shard.tokens) for shard in self.manifest.shards]

    @staticmethod
    def _open_shard(path: Path, tokens: int) -> np.memmap:
        if not path.is_file():
            raise DataError(f"{path}: shard listed in the manifest is missing: re-stage the dataset")
        expected = tokens * _TOKEN_DTYPE.itemsize
        size = path.stat().st_size
        if size != expected:
            raise DataError(f"{path}: {size} bytes but the manifest says {expected}: re-stage the dataset")
        return np.memmap(path, dtype=_TOKEN_DTYPE, mode="r", shape=(tokens,))

    def read(self, shard: int, start: int, tokens: int) -> np.ndarray:
        return np.array(self._maps[shard][start : start + tokens])

    def read_byte(self, shard: int, offset: int) -> None:
        self._maps[shard].view(np.uint8)[offset].item()


class StoreReader(WindowReader):
    """A dataset read in place from an object store: one ranged GET per read, sequential, nothing cached."""

    source = "remote"

    def __init__(self, url: str) -> None:
        try:
            self.store = open_store(url)
        except StorageError as exc:
            raise DataError(f"{exc} (--data-url)") from None
        super().__init__(_load(self.store), self.store.url_for(MANIFEST_KEY))
        self._keys = [shard.name for shard in self.manifest.shards]
        for shard in self.manifest.shards:
            self._check_shard(shard.name, shard.tokens * _TOKEN_DTYPE.itemsize)

    def _check_shard(self, key: str, expected: int) -> None:
        url = self.store.url_for(key)
        try:
            info = self.store.head(key)
        except StorageError as exc:
            raise DataError(
                f"{url}: cannot stat the shard ({exc}): check --data-url and the store's credentials"
            ) from None
        if info is None:
            raise DataError(f"{url}: shard listed in the manifest is missing: re-upload the dataset or fix --data-url")
        if info.size != expected:
            raise DataError(f"{url}: {info.size} bytes but the manifest says {expected}: re-upload the dataset")

    def _get(self, shard: int, start: int, length: int) -> bytes:
        key = self._keys[shard]
        try:
            raw = self.store.get_range(key, start, length)
        except StorageError as exc:
            raise DataError(
                f"{self.store.url_for(key)}: read of bytes {start}+{length} failed ({exc}): "
                "check the store is reachable from this node, or stage the dataset (dataset.access: staged)"
            ) from None
        if len(raw) != length:
            raise DataError(
                f"{self.store.url_for(key)}: {len(raw)} of {length} bytes at offset {start}: the shard is shorter "
                "than the manifest says: re-upload the dataset"
            )
        return raw

    def read(self, shard: int, start: int, tokens: int) -> np.ndarray:
        raw = self._get(shard, start * _TOKEN_DTYPE.itemsize, tokens * _TOKEN_DTYPE.itemsize)
        return np.frombuffer(raw, dtype=_TOKEN_DTYPE)

    def read_byte(self, shard: int, offset: int) -> None:
        self._get(shard, offset, 1)


class TokenWindows:
    """Random windows of seq_len + 1 tokens, each inside one shard (a window never spans two shards).

    `source` is a node-local dataset dir (a Path: read through np.memmap) or a store URL (a str: file://, s3://,
    gs://, read with one ranged GET per window). train_reads / train_read_bytes count what train_batch read.
    """

    def __init__(self, source: Path | str, seq_len: int, vocab_size: int) -> None:
        self.reader: WindowReader = MemmapReader(source) if isinstance(source, Path) else StoreReader(source)
        manifest = self.reader.manifest
        if manifest.vocab_size != vocab_size:
            raise DataError(
                f"{self.reader.manifest_location}: dataset vocab_size {manifest.vocab_size} != model vocab_size "
                f"{vocab_size}: set the model's vocab_size (--vocab-size) to {manifest.vocab_size}"
            )
        self.window = seq_len + 1
        self.loss_floor = manifest.loss_floor
        starts_per_shard = np.array([max(s.tokens - self.window + 1, 0) for s in manifest.shards], dtype=np.int64)
        self.num_windows = int(starts_per_shard.sum())
        if self.num_windows == 0:
            raise DataError(
                f"{self.reader.manifest_location}: no shard holds {self.window} tokens (seq_len + 1): "
                "lower --seq-len or write larger shards"
            )
        # Window index w lies in shard i when first_window[i] <= w < first_window[i + 1].
        self._first_window = np.concatenate([[0], np.cumsum(starts_per_shard)])
        self.train_reads = 0
        self.train_read_bytes = 0

    @property
    def source(self) -> str:
        return self.reader.source

    def _read_windows(self, indices: np.ndarray) -> torch.Tensor:
        shard_of = np.searchsorted(self._first_window, indices, side="right") - 1
        offsets = indices - self._first_window[shard_of]
        rows = [self.reader.read(int(s), int(o), self.window) for s, o in zip(shard_of, offsets, strict=True)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def train_batch(self, seed: int, step: int, rank: int, world_size: int, batch_size: int) -> torch.Tensor:
        """This rank's (batch_size, seq_len + 1) int64 slice of the global batch of `step`."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}: check RANK and WORLD_SIZE")
        rng = np.random.default_rng([seed, _TRAIN_STREAM, step])
        # The whole global batch is drawn so each rank's slice is the same whatever the world size; only this
        # rank's windows are read.
        indices = rng.integers(0, self.num_windows, size=batch_size * world_size)
        batch = self._read_windows(indices[rank * batch_size : (rank + 1) * batch_size])
        self.train_reads += batch_size
        self.train_read_bytes += batch_size * self.window * TOKEN_BYTES
        return batch

    def eval_batches(self, seed: int, num_batches: int, batch_size: int) -> list[torch.Tensor]:
        """A fixed held-out set: the same batches for every run with this seed, whatever its length."""
        rng = np.random.default_rng([seed, _EVAL_STREAM])
        return [self._read_windows(rng.integers(0, self.num_windows, size=batch_size)) for _ in range(num_batches)]
