"""`diskbench`: sequential write and read throughput of the node's local disk, the T_io a job will pay there.

By default both directions use O_DIRECT from page-aligned buffers, so neither the write nor the read can be served
by the page cache: the figures are the device's. A filesystem that refuses O_DIRECT (tmpfs, some overlay and
network filesystems answer EINVAL) gets the buffered method instead, and the event says so in `note`: writes
with fsync (what a checkpoint save costs) and the file dropped from the page cache before it is read back.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra.node.events import NodeEvent, emit, fail
from infra.node.protocol import DiskbenchRequest, NodeRequest, as_request

BLOCK = 4 * 1024 * 1024  # a multiple of every logical block size O_DIRECT may demand (512 B, 4 KiB)


class DirectIORefused(OSError):
    """The filesystem does not do O_DIRECT here."""


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


def _open_direct(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise DirectIORefused(exc.errno, f"open with O_DIRECT: {exc.strerror}") from None
        raise


def write_direct(path: Path, total: int) -> float:
    """total must be a multiple of the device's logical block size (whole megabytes always are)."""
    # An anonymous mapping is page-aligned, which is what O_DIRECT requires of the buffer's address.
    with mmap.mmap(-1, BLOCK) as buffer:
        buffer.write(os.urandom(BLOCK))
        view = memoryview(buffer)
        try:
            fd = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            started = time.perf_counter()
            try:
                written = 0
                while written < total:
                    written += _direct_call(os.write, fd, view[: min(BLOCK, total - written)], written)
                os.fsync(fd)  # the data is on the device already; this commits the file's metadata, as a save must
            finally:
                os.close(fd)
            return time.perf_counter() - started
        finally:
            view.release()


def read_direct(path: Path) -> tuple[int, float]:
    with mmap.mmap(-1, BLOCK) as buffer:
        view = memoryview(buffer)
        try:
            fd = _open_direct(path, os.O_RDONLY)
            try:
                started = time.perf_counter()
                total = 0
                while n := _direct_call(os.readv, fd, [view], total):
                    total += n
                return total, time.perf_counter() - started
            finally:
                os.close(fd)
        finally:
            view.release()


def _direct_call(call: Callable[[int, Any], int], fd: int, buffer: Any, offset: int) -> int:
    """Some filesystems accept the O_DIRECT open and refuse only the first transfer, also with EINVAL."""
    try:
        return call(fd, buffer)
    except OSError as exc:
        if exc.errno == errno.EINVAL and offset == 0:
            raise DirectIORefused(exc.errno, f"O_DIRECT transfer: {exc.strerror}") from None
        raise


def measure(target: Path, total: int, direct: bool) -> dict[str, object]:
    note = "asked for with --buffered"
    if direct:
        try:
            write_s = write_direct(target, total)
            read_bytes, read_s = read_direct(target)
            return _figures(True, None, total, write_s, read_bytes, read_s)
        except DirectIORefused as refused:
            note = f"the filesystem refused O_DIRECT ({refused.strerror})"
    write_s = write_file(target, total)
    read_bytes, read_s = read_file(target)
    return _figures(False, f"{note}: buffered writes + fsync, reads after dropping the page cache", total, write_s,
                    read_bytes, read_s)


def _figures(direct: bool, note: str | None, total: int, write_s: float, read_bytes: int,
             read_s: float) -> dict[str, object]:
    return {"direct": direct, "note": note, "bytes": read_bytes, "write_s": round(write_s, 4),
            "read_s": round(read_s, 4), "write_mb_per_s": round(total / 1e6 / write_s, 1),
            "read_mb_per_s": round(read_bytes / 1e6 / max(read_s, 1e-9), 1)}


def main(request: NodeRequest) -> int:
    bench = as_request(request, DiskbenchRequest)
    directory = Path(bench.dir)
    target = directory / ".diskbench"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        figures = measure(target, bench.megabytes * 1024 * 1024, direct=not bench.buffered)
    except OSError as exc:
        return fail(f"{directory}: disk benchmark failed ({exc.strerror}): check the disk is mounted and has "
                    f"{bench.megabytes} MB free")
    finally:
        target.unlink(missing_ok=True)
    emit(NodeEvent.DISKBENCH, dir=str(directory), **figures)
    return 0
