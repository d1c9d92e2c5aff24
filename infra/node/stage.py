"""`stage`: pull the dataset's shards from the object store onto this node's local disk, verified.

Runs on the node, so the bytes travel store → node directly; the orchestrator only sees progress events.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from infra.dataset.manifest import DatasetError, load_manifest
from infra.node.events import Throttle, emit, fail
from infra.storage import StorageError, open_store
from infra.storage.transfer import DEFAULT_CONFIG, FileSpec, Progress, download

MANIFEST = "manifest.json"
VERIFIED_STATE = ".trainpipe-verified"  # beside the data dir, in the node's workdir: not among the staged files


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.node stage")
    parser.add_argument("--dataset", required=True, help="dataset root URL (holds manifest.json)")
    parser.add_argument("--dest", required=True, type=Path, help="node-local directory to fill")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--progress-interval", type=float, default=2.0)
    args = parser.parse_args(argv)

    throttle = Throttle(args.progress_interval)

    def report(progress: Progress) -> None:
        if throttle.ready() or progress.bytes_done == progress.bytes_total:
            emit("progress", bytes_done=progress.bytes_done, bytes_total=progress.bytes_total,
                 files_done=progress.files_done, files_total=progress.files_total,
                 mb_per_s=round(progress.mb_per_s, 1), eta_s=round(progress.eta_s, 1))

    try:
        store = open_store(args.dataset)
        manifest = load_manifest(store)
        shards = [FileSpec(shard.name, shard.bytes, shard.sha256) for shard in manifest.shards]
        result = download(store, shards, args.dest, DEFAULT_CONFIG.but(workers=args.workers), progress=report,
                          state_dir=args.dest.parent / VERIFIED_STATE)
        # The manifest goes last, so a dest dir holding a manifest holds every shard it lists.
        (args.dest / MANIFEST).write_text(manifest.model_dump_json(indent=2))
    except (DatasetError, StorageError) as exc:
        return fail(str(exc))
    emit("staged", files=len(result.files), bytes=result.bytes_moved, skipped_files=result.files_skipped,
         skipped_bytes=result.bytes_skipped, seconds=round(result.seconds, 3), mb_per_s=round(result.mb_per_s, 1))
    return 0
