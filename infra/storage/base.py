"""The one object-store interface every backend implements (file://, s3://, gs://).

A store is rooted at a URL (scheme, bucket and base prefix); keys are '/'-separated paths relative to
that root, so callers never branch on the backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class StorageError(Exception):
    """An object-store failure; the message names the object and what to do."""


class ObjectNotFound(StorageError):
    pass


class ChecksumMismatch(StorageError):
    pass


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str | None = None
    mtime: float | None = None
    checksum: str | None = None  # tagged (infra.storage.checksum): the full-object checksum the store keeps, if any


class ObjectStore(ABC):
    scheme: str

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def url_for(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def with_stall_timeout(self, seconds: float) -> ObjectStore:
        """This store, its requests failing (transiently) once they move no byte for seconds. A store with no
        network between it and its bytes (file://) has nothing to bound."""
        return self

    @abstractmethod
    def child(self, prefix: str) -> ObjectStore:
        """A store rooted at <root>/<prefix>."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under prefix (recursive), keys relative to the root, in key order."""

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and etag, or None when it does not exist."""

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """length bytes from offset start (fewer only at the end of the object)."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        """Atomic: a reader sees the old object or the whole new one, never a part."""

    @abstractmethod
    def get_file(self, key: str, path: Path) -> ObjectInfo:
        """Whole object to a local path (written beside it, then renamed)."""

    @abstractmethod
    def put_file(self, path: Path, key: str) -> ObjectInfo: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Idempotent: deleting a missing object is not an error."""

    def delete_prefix(self, prefix: str) -> int:
        keys = [info.key for info in self.list(prefix)]
        for key in keys:
            self.delete(key)
        return len(keys)

    def check_writable(self) -> None:
        """Write, read back and delete a probe object; raise StorageError saying why not."""
        probe = ".trainpipe-write-probe"
        try:
            self.put_bytes(probe, b"ok")
            if self.get_bytes(probe) != b"ok":
                raise StorageError(f"{self.url_for(probe)}: read back differs from what was written")
            self.delete(probe)
        except StorageError:
            raise
        except OSError as exc:
            raise StorageError(
                f"{self.url}: not writable ({exc.strerror or exc}): fix permissions or choose another URL"
            ) from None
