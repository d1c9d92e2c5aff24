"""The file:// object store: a directory tree whose '/'-separated relative paths are the keys.

Used as the embedded default (no cloud account) and in tests; it honours the same contract as the
cloud backends: atomic puts, recursive key-ordered listing, idempotent deletes.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from infra.storage.base import ObjectInfo, ObjectNotFound, ObjectStore, StorageError
from infra.storage.files import (
    TEMP_SUFFIX,
    create_atomically,
    is_safe_key,
    os_errors_named,
    write_all,
    write_atomically,
)

log = logging.getLogger(__name__)


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

    def put_if_absent(self, key: str, data: bytes) -> bool:
        target = self._path(key)
        with os_errors_named(self.url_for(key), "create"):
            return create_atomically(target, lambda fd: write_all(fd, data)) is not None

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
