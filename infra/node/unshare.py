"""`unshare`: once every node's exchange of a stage has ended (the orchestrator stops the peer servers first), unlink
what the node's fan-out share dir holds for it: the dataset's and the inputs' pieces (links to the stage cache's
objects) and a restored checkpoint's files (links to the checkpoint dir's). A link left there keeps its bytes on the
disk after the cache evicts the object or the script deletes the checkpoint: each replace-one recovery would keep one
more whole checkpoint per node.

Left in place: the peer replicas' dir (the syncer's, infra/node/replica.py, which prunes it itself) and the names
the request keeps (the code archive, which a replacement takes from the survivors, and whose bytes the node keeps
anyway). The next exchange publishes again what it needs: a node publishes what it holds of its share when its
exchange starts. Prints an `unshared` event: the links removed and the bytes that freed (those that were the last
link to their file).
"""

from __future__ import annotations

from pathlib import Path

from infra.node.events import NodeEvent, emit, fail
from infra.node.protocol import NodeRequest, UnshareRequest, as_request
from infra.node.replica import REPLICA_DIR


def unshare(share_dir: Path, keep: frozenset[str]) -> tuple[int, int]:
    """Unlink every entry of share_dir but the replicas' dir and `keep`; returns (links removed, bytes freed)."""
    removed = freed = 0
    if not share_dir.is_dir():
        return removed, freed
    for entry in share_dir.iterdir():
        if entry.name == REPLICA_DIR or entry.name in keep or entry.is_dir():
            continue
        status = entry.stat(follow_symlinks=False)
        entry.unlink(missing_ok=True)
        removed += 1
        if status.st_nlink == 1:
            freed += status.st_size
    return removed, freed


def main(request: NodeRequest) -> int:
    unsharing = as_request(request, UnshareRequest)
    try:
        removed, freed = unshare(Path(unsharing.dir), frozenset(unsharing.keep))
    except OSError as exc:
        return fail(f"unshare: {exc.filename or unsharing.dir}: {exc.strerror or exc}")
    emit(NodeEvent.UNSHARED, dir=unsharing.dir, removed=removed, freed_bytes=freed)
    return 0
