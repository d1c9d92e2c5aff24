"""Which snapshot files each node stages: all of them (replicate), or a disjoint share balanced by bytes (split)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from infra.dataset.errors import DatasetError
from infra.dataset.snapshot import SnapshotFile

SHARD_MODES = ("replicate", "split")


def assign(files: Sequence[SnapshotFile], shard: str, nodes: int) -> list[list[SnapshotFile]]:
    """Per node rank, its files in key order.

    split: largest file first to the node holding the fewest bytes so far. The node that ends heaviest got its last
    file while it was the lightest, so no two nodes differ by more than the largest file.
    """
    if shard not in SHARD_MODES:
        raise DatasetError(f"dataset.shard '{shard}': use replicate or split")
    ordered = sorted(files, key=lambda f: f.key)
    if shard == "replicate":
        return [ordered for _ in range(nodes)]
    if len(files) < nodes:
        raise DatasetError(f"dataset.shard split: {len(files)} files for {nodes} nodes leaves a node without data: "
                           "use shard: replicate, fewer nodes, or a dataset in more files")
    shares: list[list[SnapshotFile]] = [[] for _ in range(nodes)]
    loads = [(0, rank) for rank in range(nodes)]
    for file in sorted(files, key=lambda f: (-f.size, f.key)):
        held, rank = heapq.heappop(loads)
        shares[rank].append(file)
        heapq.heappush(loads, (held + file.size, rank))
    return [sorted(share, key=lambda f: f.key) for share in shares]


def node_bytes(files: Sequence[SnapshotFile], shard: str, nodes: int) -> list[int]:
    """What each node will hold once staged."""
    return [sum(f.size for f in share) for share in assign(files, shard, nodes)]
