"""Local files as the storage engine writes them: atomic replacement, whole writes, safe keys, and OSErrors as
one-line StorageErrors naming the file and the fix. Used by the file:// store, the transfer engine's landings
and verified state, and the cloud stores' multipart bookkeeping alike."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from infra.storage.base import StorageError

log = logging.getLogger(__name__)

# In-flight writes live beside their target under this suffix; listings skip them so a reader never
# sees a half-written object.
TEMP_SUFFIX = ".trainpipe-tmp"

_FIXES = {
    errno.EACCES: "fix the permissions or choose another location",
    errno.EPERM: "fix the permissions or choose another location",
    errno.ENOSPC: "free disk space or choose another location",
    errno.EDQUOT: "free space or raise the disk quota",
    errno.EROFS: "the filesystem is read-only: choose another location",
    errno.ENOTDIR: "a parent of this key is an object, not a prefix: choose another key",
    # mkdir of a key's parent reports EEXIST when that parent is already an object (a file).
    errno.EEXIST: "a parent of this key is an object, not a prefix: choose another key",
    errno.EISDIR: "this key is a prefix holding other objects: choose another key",
    errno.ENAMETOOLONG: "shorten the key",
}


def _fix_for(exc: OSError) -> str:
    return _FIXES.get(exc.errno or 0, "check the path and the disk")


@contextmanager
def os_errors_named(thing: str, action: str) -> Iterator[None]:
    """Turn an OSError into a one-line StorageError naming the thing and what to do."""
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        raise StorageError(f"{thing}: cannot {action} ({exc.strerror or exc}): {_fix_for(exc)}") from exc


def is_safe_key(key: str) -> bool:
    """True when key is a relative '/'-separated path that stays below its root (and is no temp file)."""
    parts = key.split("/")
    return not (
        key.startswith("/")
        or "\x00" in key
        or any(part in ("", ".", "..") for part in parts)
        or parts[-1].endswith(TEMP_SUFFIX)
    )


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable: without it a crash can bring back the old object.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_temp_beside(target: Path) -> tuple[Path, int]:
    """Create a fresh temp file in target's directory (creating the directory) and open it for writing."""
    attempts = 3
    attempt = 1
    while True:
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.parent / f".{os.urandom(8).hex()}{TEMP_SUFFIX}"
        try:
            # 0o666 lets the umask decide the final mode, like any other file the user writes.
            return temp, os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileNotFoundError:
            # A concurrent delete pruned the freshly created (still empty) directory: create it again.
            if attempt == attempts:
                raise
            log.info(
                "%s vanished before writing %s (attempt %d/%d): recreating it",
                target.parent,
                target.name,
                attempt,
                attempts,
            )
            attempt += 1


def _write_beside(target: Path, fill: Callable[[int], None], publish: Callable[[Path, Path], None]
                  ) -> os.stat_result:
    """fill(fd) into a temp file beside target, fsynced, then publish(temp, target); the temp never outlives it."""
    temp, fd = _open_temp_beside(target)
    try:
        try:
            fill(fd)
            os.fsync(fd)
            written = os.fstat(fd)
        finally:
            os.close(fd)
        publish(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)
    return written


def write_atomically(target: Path, fill: Callable[[int], None]) -> os.stat_result:
    """Write through fill(fd) into a temp file beside target, fsync, and rename it over target.

    A reader sees the old file or the whole new one. Returns the stat of the new file.
    """
    return _write_beside(target, fill, os.replace)


def create_atomically(target: Path, fill: Callable[[int], None]) -> os.stat_result | None:
    """Like write_atomically, but only when target does not exist: the whole file is hard-linked to target, which
    fails rather than replace one. The new file's stat, or None when target already existed (left untouched)."""
    existed = False

    def link_then_drop(temp: Path, target: Path) -> None:
        nonlocal existed
        try:
            os.link(temp, target)  # link(2) never replaces an existing name
        except FileExistsError:
            existed = True
        temp.unlink()

    written = _write_beside(target, fill, link_then_drop)
    return None if existed else written


def write_all(fd: int, data: bytes | memoryview, offset: int | None = None) -> None:
    """Write every byte (os.write/os.pwrite may write fewer than asked)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        view = view[written:]
        if offset is not None:
            offset += written
