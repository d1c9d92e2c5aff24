"""`probe`: can this node run the job? Reachable, dirs writable, enough free disk, a free port for rendezvous."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from infra.dataset.stagecache import cached_bytes
from infra.node.events import NodeEvent, emit
from infra.node.ports import free_port


def check_dir(path: Path) -> tuple[int, str | None]:
    """Free bytes, and the problem if the dir cannot be written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-") as handle:
            handle.write(b"ok")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        return 0, f"{path}: not writable ({exc.strerror}): fix its permissions or mount"
    return shutil.disk_usage(path).free, None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.node probe")
    parser.add_argument("--dir", action="append", default=[], type=Path, help="a dir the job writes to")
    parser.add_argument("--need-bytes", type=int, default=0, help="free bytes needed on the first --dir")
    parser.add_argument("--cache", type=Path, help="the node's dataset object cache: its bytes count as free")
    args = parser.parse_args(argv)

    problems = []
    free = {}
    for path in args.dir:
        free[str(path)], problem = check_dir(path)
        if problem:
            problems.append(problem)
    if args.dir and not problems:
        # Cached dataset objects are either this run's (reused, no new space) or evictable.
        available = free[str(args.dir[0])] + cached_bytes(args.cache)
        if available < args.need_bytes:
            problems.append(f"{args.dir[0]}: {available / 1e9:.2f} GB free, this node's share of the dataset needs "
                            f"{args.need_bytes / 1e9:.2f} GB: free space, use dataset.shard: split, or nodes with "
                            "larger local disks")
    emit(NodeEvent.PROBE, host=socket.gethostname(), python=sys.version.split()[0], platform=platform.platform(),
         cpus=os.cpu_count(), free_bytes=free, free_port=free_port(), problems=problems)
    return 1 if problems else 0
