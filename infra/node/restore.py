"""`restore`: download a committed checkpoint onto this node's local disk, verified against its manifest.

The whole checkpoint (the union of every node's files) lands in the node's checkpoint dir under the name it had
there when it was saved (`checkpoint-500/`, `snapshot.pt`, ...), where the script finds it through
TRAINPIPE_RESUME_FROM. Without a step it takes the newest committed checkpoint and falls back to the previous
committed one when the newest turns out damaged, so a resumed job loses at most one checkpoint interval instead of
failing; the damaged commit is set aside in the store (kept, never counted again) and each warning says so. With
a sync dir it tells the node's syncer that what it restored is committed already. With peers (fan-out) the
nodes fill each other (infra/node/peerrestore.py): the store serves each file of the checkpoint once per cluster.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from infra.checkpoints.formats import Detector
from infra.checkpoints.layout import CheckpointError, NoCommittedCheckpoint
from infra.checkpoints.restore import StoreFill
from infra.checkpoints.store import CheckpointStore
from infra.node.events import NodeEvent, emit, fail
from infra.node.peerrestore import PeerFill
from infra.node.protocol import NodeRequest, RestoreRequest, as_request
from infra.node.sync import write_restored
from infra.storage import StorageError, open_store

EXIT_NO_CHECKPOINT = 3


def main(request: NodeRequest) -> int:
    restoring = as_request(request, RestoreRequest)
    peers = restoring.peers
    fill: PeerFill | StoreFill = StoreFill() if peers is None else PeerFill(
        restoring.rank, list(peers.urls), Path(peers.share_dir), peers.wait_s, peers.connect_grace_s,
        restoring.holders, Path(restoring.replica_dir) if restoring.replica_dir else None)
    dest = Path(restoring.dest)
    started = time.monotonic()
    try:
        checkpoints = CheckpointStore(open_store(restoring.url))
        if restoring.step is None:
            path, manifest, warnings = checkpoints.restore_latest(dest, fill)
        else:
            manifest, warnings = checkpoints.manifest(restoring.step), []
            path = checkpoints.restore(dest, restoring.step, fill)
    except NoCommittedCheckpoint as exc:
        return fail(f"restore: {exc}", EXIT_NO_CHECKPOINT)
    except (CheckpointError, StorageError) as exc:
        return fail(f"restore: {exc}")
    except OSError as exc:
        return fail(f"restore: {exc.filename or dest}: {exc.strerror or exc}: fix the node's checkpoint dir or free "
                    "disk space")
    if restoring.prune:
        prune_all_but(dest, Path(path))
    if restoring.sync_dir is not None:
        # What the node's syncer will see in the checkpoint dir now is the committed step: never shipped again.
        write_restored(Path(restoring.sync_dir), manifest.step, Detector(dest, restoring.format).scan())
    for warning in warnings:
        print(f"restore: warning: {warning}", file=sys.stderr, flush=True)
    emit(NodeEvent.RESTORED, step=manifest.step, path=str(path), name=manifest.ref.name, bytes=manifest.total_bytes,
         seconds=round(time.monotonic() - started, 3), config_hash=manifest.config_hash, warnings=warnings,
         sources=fill.sources)
    return 0


def prune_all_but(directory: Path, kept: Path) -> None:
    """Remove every entry of directory but the one that holds kept."""
    top = kept.relative_to(directory).parts[0]
    for entry in directory.iterdir():
        if entry.name == top:
            continue
        print(f"restore: removing {entry}: not the restored checkpoint", file=sys.stderr, flush=True)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
