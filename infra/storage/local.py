"""The file:// object store: a directory tree whose '/'-separated relative paths are the keys.

Used as the embedded default (no cloud account) and in tests; it honours the same contract as the
cloud backends: atomic puts, recursive key-ordered listing, idempotent deletes.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from infra.storage.base import ObjectInfo, ObjectNotFound, ObjectStore, StorageError

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
        temp = target.parent / f".{uuid.uuid4().hex[:16]}{TEMP_SUFFIX}"
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


def write_atomically(target: Path, fill: Callable[[int], None]) -> os.stat_result:
    """Write through fill(fd) into a temp file beside target, fsync, and rename it over target.

    A reader sees the old file or the whole new one. Returns the stat of the new file.
    """
    temp, fd = _open_temp_beside(target)
    try:
        try:
            fill(fd)
            os.fsync(fd)
            written = os.fstat(fd)
        finally:
            os.close(fd)
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)
    return written


def write_all(fd: int, data: bytes | memoryview, offset: int | None = None) -> None:
    """Write every byte (os.write/os.pwrite may write fewer than asked)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        view = view[written:]
        if offset is not None:
            offset += written


def _copy_into(src: Path) -> Callable[[int], None]:
    def fill(fd: int) -> None:
        with open(src, "rb") as source, open(fd, "wb", closefd=False) as sink:
            shutil.copyfileobj(source, sink, 1 << 20)

    return fill


def _read_range(fd: int, start: int, length: int) -> bytes:
    """Up to length bytes from start (os.pread may return fewer than asked before the end)."""
    chunks: list[bytes] = []
    remaining = length
    while remaining:
        chunk = os.pread(fd, remaining, start + length - remaining)
        if not chunk:
            break  # end of the file
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _info(key: str, st: os.stat_result) -> ObjectInfo:
    # size+mtime_ns is a cheap etag that changes whenever a put replaces the content.
    return ObjectInfo(key=key, size=st.st_size, etag=f"{st.st_size:x}-{st.st_mtime_ns:x}", mtime=st.st_mtime)


class FileStore(ObjectStore):
    """Objects as files under a local directory, addressed as file:///abs/path (the path is taken literally)."""

    scheme = "file"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        if not self.url.startswith("file://"):
            raise StorageError(f"{url}: not a file:// URL: use file:///absolute/path")
        path = self.url.removeprefix("file://")
        if not path.startswith("/"):
            raise StorageError(f"{url}: a file:// URL needs an absolute path: use file:///absolute/path")
        self.root = Path(path)

    # -- keys --------------------------------------------------------------------------------------

    def _checked(self, key: str, *, prefix: bool = False) -> str:
        """The key itself when it stays under the root; a prefix may be empty or end in '/'."""
        body = key.removesuffix("/") if prefix else key
        if prefix and not body:
            return key
        if not is_safe_key(body):
            raise StorageError(
                f"{self.url}: invalid key {key!r}: use a relative '/'-separated path without '', '.' or '..' parts"
            )
        return key

    def _path(self, key: str) -> Path:
        return self.root / self._checked(key)

    # -- reads -------------------------------------------------------------------------------------

    def child(self, prefix: str) -> FileStore:
        return FileStore(self.url_for(self._checked(prefix, prefix=True).removesuffix("/")))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._checked(prefix, prefix=True)
        # Only the directory that holds every possible match is walked.
        start_rel = prefix.rpartition("/")[0]
        start = self.root / start_rel if start_rel else self.root
        found: list[ObjectInfo] = []
        with os_errors_named(self.url_for(prefix), "list"):
            self._collect(start, f"{start_rel}/" if start_rel else "", prefix, found)
        found.sort(key=lambda info: info.key)
        return iter(found)

    def _collect(self, directory: Path, rel: str, prefix: str, found: list[ObjectInfo]) -> None:
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return  # no such prefix (yet), or removed by a concurrent delete
        for entry in entries:
            key = rel + entry.name
            try:
                if entry.is_dir():
                    if (key + "/").startswith(prefix) or prefix.startswith(key + "/"):
                        self._collect(Path(entry.path), key + "/", prefix, found)
                elif key.startswith(prefix) and not entry.name.endswith(TEMP_SUFFIX):
                    found.append(_info(key, entry.stat()))
            except FileNotFoundError:
                continue  # deleted while we listed

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        with os_errors_named(self.url_for(key), "stat"):
            try:
                st = path.stat()
            except (FileNotFoundError, NotADirectoryError):
                return None
        return None if stat.S_ISDIR(st.st_mode) else _info(key, st)

    @contextmanager
    def _reading(self, key: str) -> Iterator[int]:
        url = self.url_for(key)
        path = self._path(key)
        with os_errors_named(url, "read"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                raise ObjectNotFound(f"{url}: no such object: check the key, or upload it first") from None
            try:
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    raise ObjectNotFound(f"{url}: no such object (it is a prefix): check the key")
                yield fd
            finally:
                os.close(fd)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise StorageError(f"{self.url_for(key)}: invalid range start={start} length={length}: both must be >= 0")
        with self._reading(key) as fd:
            return _read_range(fd, start, length)

    def get_bytes(self, key: str) -> bytes:
        with self._reading(key) as fd:
            return _read_range(fd, 0, os.fstat(fd).st_size)

    def get_file(self, key: str, path: Path) -> ObjectInfo:
        source = self._path(key)
        info = self.head(key)
        if info is None:
            raise ObjectNotFound(f"{self.url_for(key)}: no such object: check the key, or upload it first")
        with os_errors_named(str(path), "write"):
            try:
                write_atomically(Path(path), _copy_into(source))
            except FileNotFoundError as exc:
                if exc.filename == str(source):
                    raise ObjectNotFound(f"{self.url_for(key)}: deleted while being copied: retry") from None
                raise
        return info

    # -- writes ------------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        target = self._path(key)
        with os_errors_named(self.url_for(key), "write"):
            return _info(key, write_atomically(target, lambda fd: write_all(fd, data)))

    def put_file(self, path: Path, key: str) -> ObjectInfo:
        target = self._path(key)
        path = Path(path)
        if not path.is_file():
            raise StorageError(f"{path}: no such local file: check the path before uploading it to {self.url_for(key)}")
        with os_errors_named(self.url_for(key), "write"):
            return _info(key, write_atomically(target, _copy_into(path)))

    def delete(self, key: str) -> None:
        path = self._path(key)
        with os_errors_named(self.url_for(key), "delete"):
            try:
                path.unlink()
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                return
            # Object stores have no directories: drop the ones this delete left empty.
            parent = path.parent
            while parent != self.root and parent.is_relative_to(self.root):
                try:
                    parent.rmdir()
                except OSError:
                    break  # not empty, or already gone
                parent = parent.parent
