"""`restore`: download a committed checkpoint onto this node's local disk, verified against its manifest.

Without --step it takes the newest committed checkpoint and falls back to the previous committed one when
the newest turns out damaged, so a resumed job loses at most one checkpoint interval instead of failing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from infra.checkpoints import CheckpointError, CheckpointStore, NoCommittedCheckpoint
from infra.node.events import emit, fail
from infra.storage import StorageError, open_store

EXIT_NO_CHECKPOINT = 3


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.node restore", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the run's checkpoint root URL")
    parser.add_argument("--dest", required=True, type=Path, help="local dir; the step lands in DEST/step-XXXXXXXX/")
    parser.add_argument("--step", type=int, help="restore this committed step instead of the newest")
    args = parser.parse_args(argv)

    started = time.monotonic()
    try:
        checkpoints = CheckpointStore(open_store(args.url))
        if args.step is None:
            path, manifest, warnings = checkpoints.restore_latest(args.dest)
        else:
            manifest, warnings = checkpoints.manifest(args.step), []
            path = checkpoints.restore(args.dest, args.step)
    except NoCommittedCheckpoint as exc:
        return fail(f"restore: {exc}", EXIT_NO_CHECKPOINT)
    except (CheckpointError, StorageError) as exc:
        return fail(f"restore: {exc}")
    except OSError as exc:
        return fail(f"restore: {exc.filename or args.dest}: {exc.strerror or exc}: fix --dest or free disk space")
    for warning in warnings:
        print(f"restore: warning: {warning}", file=sys.stderr, flush=True)
    emit("restored", step=manifest.step, path=str(path), bytes=manifest.total_bytes,
         seconds=round(time.monotonic() - started, 3), config_hash=manifest.config_hash, warnings=warnings)
    return 0
