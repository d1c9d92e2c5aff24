"""`verify-ckpt`: check a committed checkpoint in the store file by file against its manifest (size and sha256)."""

from __future__ import annotations

import argparse
import time

from infra.checkpoints.layout import CheckpointError
from infra.checkpoints.store import CheckpointStore
from infra.node.events import NodeEvent, emit, fail
from infra.storage import StorageError, open_store


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.node verify-ckpt")
    parser.add_argument("--url", required=True, help="the run's checkpoint root URL")
    parser.add_argument("--step", type=int, default=None, help="default: the latest committed step")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        manifest = CheckpointStore(open_store(args.url)).verify(args.step, deep=True)
    except (CheckpointError, StorageError) as exc:
        return fail(str(exc))
    emit(NodeEvent.VERIFIED, step=manifest.step, files=len(manifest.files), bytes=sum(f.bytes for f in manifest.files),
         seconds=round(time.perf_counter() - started, 3))
    return 0
