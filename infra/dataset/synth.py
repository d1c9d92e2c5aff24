"""Synthetic token datasets whose best achievable loss is known exactly.

The source is a Markov chain on a vocab of V tokens: a seeded permutation sigma of the vocab orders the tokens
on a ring, and each step moves k_t places along it, x_{t+1} = sigma[(sigma^-1[x_t] + k_t) mod V] with
k_t ~ Categorical(branching) i.i.d. Every token thus has exactly K = len(branching) distinct successors, each
step is a permutation of the vocab (the chain is doubly stochastic, so uniform is stationary), and the first
token is drawn uniformly: the entropy rate, and so the loss floor of a model trained on it, is H(branching).
"""

from __future__ import annotations

import hashlib
import logging
import math
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from infra.dataset.manifest import (
    MANIFEST_KEY,
    SHARD_NAME_RE,
    TOKEN_BYTES,
    DatasetError,
    DatasetManifest,
    ShardInfo,
    shard_name,
    write_manifest,
)
from infra.storage.base import ObjectStore

logger = logging.getLogger(__name__)

GENERATOR_KIND = "permuted-ring-markov-v1"
# Steps are drawn from the generator in blocks of this many, whatever the shard size, so that one seed gives
# one token stream however it is cut into shards (and a shorter dataset is a prefix of a longer one).
BLOCK_TOKENS = 1 << 20
_SUM_TOLERANCE = 1e-9


def entropy_nats(probabilities: Sequence[float]) -> float:
    return -math.fsum(p * math.log(p) for p in probabilities if p > 0)


def _check_arguments(tokens: int, vocab_size: int, shard_tokens: int, branching: Sequence[float]) -> None:
    if tokens < 1:
        raise DatasetError(f"tokens: must be at least 1 (got {tokens}): pass --tokens N with N >= 1")
    if not 2 <= vocab_size <= 65536:
        raise DatasetError(f"vocab_size: must be in [2, 65536] to fit uint16 tokens (got {vocab_size}): pick one")
    if shard_tokens < 1:
        raise DatasetError(f"shard_tokens: must be at least 1 (got {shard_tokens}): pass a positive shard size")
    if not branching or any(not p > 0 for p in branching):
        raise DatasetError(f"branching: needs at least one probability, all > 0 (got {list(branching)}): fix it")
    if abs(math.fsum(branching) - 1) > _SUM_TOLERANCE:
        raise DatasetError(f"branching: probabilities sum to {math.fsum(branching)!r}, not 1: normalise them")
    if len(branching) >= vocab_size:
        raise DatasetError(
            f"branching: {len(branching)} successors per token needs vocab_size > {len(branching)} "
            f"(got {vocab_size}): raise vocab_size or shorten branching"
        )


def token_stream(vocab_size: int, branching: Sequence[float], seed: int) -> Iterator[np.ndarray]:
    """The chain's tokens in order, as an endless run of uint16 chunks (chunk boundaries carry no meaning)."""
    rng = np.random.default_rng(seed)
    sigma = rng.permutation(vocab_size).astype(np.uint16)
    ring_position = int(rng.integers(vocab_size))
    cdf = np.cumsum(np.asarray(branching, dtype=np.float64))
    cdf /= cdf[-1]
    last_step = len(branching) - 1
    yield sigma[[ring_position]]
    while True:
        # min() guards u just below 1 landing past a last cdf value rounded below 1.
        steps = np.minimum(np.searchsorted(cdf, rng.random(BLOCK_TOKENS), side="right"), last_step)
        positions = (ring_position + np.cumsum(steps)) % vocab_size
        ring_position = int(positions[-1])
        yield sigma[positions]


class _Chunker:
    """Cuts a stream of chunks into pieces of any length, keeping the remainder for the next piece."""

    def __init__(self, chunks: Iterator[np.ndarray]) -> None:
        self._chunks = chunks
        self._pending = np.empty(0, dtype=np.uint16)

    def pieces(self, count: int) -> Iterator[np.ndarray]:
        while count:
            if not len(self._pending):
                self._pending = next(self._chunks)
            piece, self._pending = self._pending[:count], self._pending[count:]
            count -= len(piece)
            yield piece


def _write_shard(store: ObjectStore, name: str, tokens: Iterator[np.ndarray], scratch: Path) -> ShardInfo:
    digest = hashlib.sha256()
    count = 0
    path = scratch / name
    with path.open("wb") as out:
        for piece in tokens:
            data = piece.astype("<u2", copy=False).tobytes()
            digest.update(data)
            out.write(data)
            count += len(piece)
    store.put_file(path, name)
    path.unlink()
    return ShardInfo(name=name, bytes=count * TOKEN_BYTES, sha256=digest.hexdigest(), tokens=count)


def synthesize(
    store: ObjectStore,
    tokens: int,
    *,
    vocab_size: int = 256,
    shard_tokens: int = 16_000_000,
    branching: Sequence[float] = (0.6, 0.2, 0.1, 0.1),
    seed: int = 0,
) -> DatasetManifest:
    """Write a dataset of `tokens` tokens under the store's root, manifest last; return its manifest."""
    _check_arguments(tokens, vocab_size, shard_tokens, branching)
    # A dataset being overwritten must not look complete while its shards are being replaced.
    store.delete(MANIFEST_KEY)
    chunker = _Chunker(token_stream(vocab_size, branching, seed))
    shards: list[ShardInfo] = []
    with tempfile.TemporaryDirectory(prefix="trainpipe-synth-") as scratch:
        for index, start in enumerate(range(0, tokens, shard_tokens)):
            count = min(shard_tokens, tokens - start)
            shards.append(_write_shard(store, shard_name(index), chunker.pieces(count), Path(scratch)))
            logger.debug("wrote %s (%d tokens)", store.url_for(shards[-1].name), count)
    written = {shard.name for shard in shards}
    for stale in [info.key for info in store.list() if SHARD_NAME_RE.match(info.key) and info.key not in written]:
        logger.info("deleting %s: left over from an earlier dataset at this URL", store.url_for(stale))
        store.delete(stale)
    manifest = DatasetManifest(
        vocab_size=vocab_size,
        seed=seed,
        generator={
            "kind": GENERATOR_KIND,
            "branching": list(branching),
            "block_tokens": BLOCK_TOKENS,
            "shard_tokens": shard_tokens,
        },
        loss_floor=entropy_nats(branching),
        total_tokens=tokens,
        shards=shards,
    )
    write_manifest(store, manifest)
    logger.info(
        "wrote dataset %s: %d tokens in %d shards, vocab %d, loss floor %.4f nats/token",
        store.url,
        tokens,
        len(shards),
        vocab_size,
        manifest.loss_floor,
    )
    return manifest
