"""`diskbench`: sequential write and read throughput of the node's local disk, the T_io a job will pay there.

Writes with fsync (what a checkpoint save costs) and drops the file from the page cache before reading it back,
so the read measures the disk rather than memory.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from infra.node.events import emit, fail

BLOCK = 4 * 1024 * 1024


def write_file(path: Path, total: int) -> float:
    block = os.urandom(BLOCK)  # random bytes: a compressing or deduplicating disk cannot shortcut them
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < total:
            written += os.write(fd, block[: min(BLOCK, total - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def read_file(path: Path) -> tuple[int, float]:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        started = time.perf_counter()
        total = 0
        while chunk := os.read(fd, BLOCK):
            total += len(chunk)
        return total, time.perf_counter() - started
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.node diskbench")
    parser.add_argument("--dir", required=True, type=Path, help="a directory on the disk to measure")
    parser.add_argument("--megabytes", type=int, default=256, help="size of the test file")
    args = parser.parse_args(argv)
    if args.megabytes < 1:
        return fail(f"--megabytes {args.megabytes}: measure at least 1 MB")
    target = args.dir / ".diskbench"
    try:
        args.dir.mkdir(parents=True, exist_ok=True)
        total = args.megabytes * 1024 * 1024
        write_s = write_file(target, total)
        read_bytes, read_s = read_file(target)
    except OSError as exc:
        return fail(f"{args.dir}: disk benchmark failed ({exc.strerror}): check the disk is mounted and has "
                    f"{args.megabytes} MB free")
    finally:
        target.unlink(missing_ok=True)
    emit("diskbench", dir=str(args.dir), bytes=read_bytes, write_s=round(write_s, 4), read_s=round(read_s, 4),
         write_mb_per_s=round(total / 1e6 / write_s, 1), read_mb_per_s=round(read_bytes / 1e6 / max(read_s, 1e-9), 1))
    return 0
