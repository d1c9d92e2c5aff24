"""`restore`: download a committed checkpoint onto this node's local disk, verified against its manifest.

The whole checkpoint (the union of every node's files) lands in the node's checkpoint dir under the name it had
there when it was saved (`checkpoint-500/`, `snapshot.pt`, ...), where the script finds it through
TRAINPIPE_RESUME_FROM. Without --step it takes the newest committed checkpoint and falls back to the previous
committed one when the newest turns out damaged, so a resumed job loses at most one checkpoint interval instead of
failing; the damaged commit is set aside in the store (kept, never counted again) and each warning says so. With
--sync-dir it tells the node's syncer that what it restored is committed already. With --peers (fan-out) the
nodes fill each other (infra/node/peerrestore.py): the store serves each file of the checkpoint once per cluster.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from infra.checkpoints.formats import FORMATS, Detector
from infra.checkpoints.layout import CheckpointError, NoCommittedCheckpoint
from infra.checkpoints.restore import StoreFill
from infra.checkpoints.store import CheckpointStore
from infra.node.events import NodeEvent, emit, fail
from infra.node.fanout import add_peer_arguments
from infra.node.peerrestore import PeerFill
from infra.node.sync import write_restored
from infra.storage import StorageError, open_store

EXIT_NO_CHECKPOINT = 3


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.node restore", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the run's checkpoint root URL")
    parser.add_argument("--dest", required=True, type=Path, help="the node's checkpoint dir: the checkpoint lands in "
                        "DEST/<its name>")
    parser.add_argument("--step", type=int, help="restore this committed step instead of the newest")
    parser.add_argument("--sync-dir", type=Path, help="the node's sync dir: the syncer learns what was restored")
    parser.add_argument("--format", choices=FORMATS, default="auto", help="the job's checkpoint format")
    parser.add_argument("--rank", type=int, default=0, help="fan-out: this node's rank")
    parser.add_argument("--prune", action="store_true", help="afterwards DEST holds only the restored checkpoint: a "
                        "node that survived a preemption drops its saves newer than the commit (never committed, and "
                        "a syncer or script that found them would take them for this attempt's)")
    add_peer_arguments(parser)
    parser.add_argument("--holders", help="fan-out: comma-separated ranks that may hold their own parts (the "
                        "survivors of a replaced node; default every rank)")
    parser.add_argument("--replica-dir", type=Path, help="fan-out: this node's peer replicas (<workdir>/replica): "
                        "it serves the part of a node not among --holders whose replica it keeps")
    args = parser.parse_args(argv)
    peers = args.peers.split(",") if args.peers else []
    if peers and (args.share_dir is None or not 0 <= args.rank < len(peers)):
        parser.error(f"--peers needs --share-dir and a --rank among its {len(peers)} URLs")
    holders = tuple(int(rank) for rank in args.holders.split(",")) if args.holders else ()
    if any(not 0 <= rank < len(peers) for rank in holders):
        parser.error(f"--holders {args.holders}: ranks must be below the {len(peers)} --peers")
    fill: PeerFill | StoreFill = PeerFill(args.rank, peers, args.share_dir, args.peer_wait,
                                          args.peer_connect_grace, holders, args.replica_dir) if peers else StoreFill()

    started = time.monotonic()
    try:
        checkpoints = CheckpointStore(open_store(args.url))
        if args.step is None:
            path, manifest, warnings = checkpoints.restore_latest(args.dest, fill)
        else:
            manifest, warnings = checkpoints.manifest(args.step), []
            path = checkpoints.restore(args.dest, args.step, fill)
    except NoCommittedCheckpoint as exc:
        return fail(f"restore: {exc}", EXIT_NO_CHECKPOINT)
    except (CheckpointError, StorageError) as exc:
        return fail(f"restore: {exc}")
    except OSError as exc:
        return fail(f"restore: {exc.filename or args.dest}: {exc.strerror or exc}: fix --dest or free disk space")
    if args.prune:
        prune_all_but(args.dest, Path(path))
    if args.sync_dir is not None:
        # What the node's syncer will see in the checkpoint dir now is the committed step: never shipped again.
        write_restored(args.sync_dir, manifest.step, Detector(args.dest, args.format).scan())
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
