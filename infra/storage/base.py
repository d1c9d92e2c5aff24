"""The one object-store interface every backend implements (file://, s3://, gs://).

A store is rooted at a URL (scheme, bucket and base prefix); keys are '/'-separated paths relative to
that root, so callers never branch on the backend.
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# A URL's query string carries a SAS signature (sig=), a presigned URL's X-Amz-Signature or a token: no message
# keeps one. Bare credential fields (a connection string's AccountKey=, a SAS token pasted alone) are cut too.
_QUERY = re.compile(r"\?[A-Za-z0-9_.~-]+=[^\s#'\"<>)]*")
_SECRET_FIELD = re.compile(r"(?i)\b(sig|X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|AccountKey|"
                           r"SharedAccessSignature|access_token|token)=[^&;\s'\"<>]+")
REDACTED = "<redacted>"


def redact(text: str) -> str:
    """text without the secrets a store's URLs and connection strings carry (query strings, keys, signatures)."""
    return _SECRET_FIELD.sub(rf"\1={REDACTED}", _QUERY.sub(f"?{REDACTED}", text))


class StorageError(Exception):
    """An object-store failure; the message names the object and what to do, and never a secret: a query string or
    key in it is redacted however it got there (a client library's message copied in, a URL with a SAS token).

    `original` is the client library's exception it stands for, where there is one: kept for the store's own code to
    look at, never chained, since a traceback prints a cause's message whole, signatures and all."""

    original: BaseException | None = None

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(arg) if isinstance(arg, str) else arg for arg in args))


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
    _create_only_honoured: bool | None = None  # honours_create_only's answer, once probed

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

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create-only put: write data at key only if no object is there; as atomic as put_bytes. True when this
        call wrote it; False when an object was already there (a failed precondition), which is left untouched.

        A store implements it with its conditional write: S3 `If-None-Match: *` (412 PreconditionFailed), GCS
        `ifGenerationMatch=0` (412), Azure Blob `if_none_match='*'` (409 BlobAlreadyExists / 412), a file system's
        exclusive create. Some servers (rclone serve s3, the GCS emulator) accept the precondition and overwrite
        anyway: then this returns True although it replaced an object. This default, for a store without a
        conditional write, is that case too: a plain put. Whoever needs exclusivity asks honours_create_only()."""
        self.put_bytes(key, data)
        return True

    def honours_create_only(self, probe_prefix: str) -> bool:
        """Whether put_if_absent really refuses to replace an object here, found once per store object by writing:
        a fresh probe key under probe_prefix put create-only twice must have its second put refused. The probe is
        deleted again."""
        if self._create_only_honoured is None:
            # os.urandom, not uuid: `trainpipe cp` imports this module and must start without uuid's import cost.
            probe = f"{probe_prefix.rstrip('/')}/.create-only-probe-{os.urandom(16).hex()}"
            try:
                if not self.put_if_absent(probe, b"first"):
                    raise StorageError(f"{self.url_for(probe)}: a create-only put of a fresh key was refused: the "
                                       "store's conditional writes are broken; use another store")
                self._create_only_honoured = not self.put_if_absent(probe, b"second")
            finally:
                self.delete(probe)
        return self._create_only_honoured

    def presigned_get(self, key: str, expires_s: float) -> str | None:
        """An https URL that reads the object without credentials until expires_s from now (a node that has no
        credentials of the store yet fetches with it), or None when this store or its credentials cannot make one
        (file://, a GCS identity that cannot sign). The URL is a credential: never logged, never put on a command
        line."""
        return None

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
