"""The python engine: files split into fixed-size parts, moved through the ObjectStore interface by the pool.

One pool over the parts of every file at once keeps all workers busy whether a job is a million small shards or
a few huge checkpoint files. Each part is retried on its own, and its CRC is computed from the bytes in hand
(downloads: as they are written; uploads: as they are sent), so no file is read twice: the part CRCs join into
the file's. Used for stores without a native engine (file://) and as the peer the native engine is measured by.
"""

from __future__ import annotations

import logging
import os
import threading
from functools import partial
from pathlib import Path
from typing import Protocol, runtime_checkable

from infra.storage.base import ObjectInfo, ObjectStore, StorageError
from infra.storage.checksum import (
    DEFAULT_ALGORITHM,
    SHA256,
    Checksum,
    PartCrcs,
    PrefixHasher,
    checksum_bytes,
    checksum_file,
)
from infra.storage.files import os_errors_named, write_all
from infra.storage.landing import Landing
from infra.storage.pool import Pool
from infra.storage.records import FileResult, TransferConfig
from infra.storage.retry import call_with_retries, one_line

log = logging.getLogger(__name__)

MAX_MULTIPART_PARTS = 10_000  # S3's limit; the part size grows for objects that would need more


@runtime_checkable
class MultipartUploads(Protocol):
    """A store that accepts one object as parts uploaded in parallel (S3 multipart, GCS XML multipart).

    The python engine uses it for files larger than a part; stores without it get put_bytes / put_file.
    """

    min_part_size: int

    def start_multipart(self, key: str) -> str:
        """Begin an upload of key; returns its upload id."""
        ...

    def put_part(self, key: str, upload_id: str, number: int, offset: int, data: bytes) -> str:
        """Store part `number` (1-based), the object's bytes [offset, offset + len(data)); returns its tag."""
        ...

    def finish_multipart(self, key: str, upload_id: str, tags: list[str]) -> ObjectInfo:
        """Make the object visible, whole, from its parts' tags in part order."""
        ...

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Drop an unfinished upload's parts; idempotent."""
        ...


class PartFetch:
    """One object fetched by ranged reads into its landing file; the CRC of each part joins into the file's."""

    def __init__(self, store: ObjectStore, landing: Landing, expected: Checksum | None, config: TransferConfig) -> None:
        self.store, self.landing, self.expected, self.config = store, landing, expected, config
        self.size = landing.size
        algorithm = expected.algorithm if expected is not None and expected.algorithm != SHA256 else DEFAULT_ALGORITHM
        self.crcs = PartCrcs(algorithm)
        self.fd = -1
        self.hasher: PrefixHasher | None = None
        self._parts_left = 0
        self._lock = threading.Lock()

    def schedule(self, pool: Pool) -> None:
        self.fd = self.landing.create()
        if self.expected is not None and self.expected.algorithm == SHA256:
            self.hasher = PrefixHasher(self.fd, self.size)  # a manifest written before the CRCs
        part_size = self.config.part_size
        self._parts_left = -(-self.size // part_size)
        if self.size == 0:
            self._finish(pool)
        for offset in range(0, self.size, part_size):
            length = min(part_size, self.size - offset)
            pool.submit(length, partial(self._fetch_part, offset, length, pool))

    def _fetch_part(self, offset: int, length: int, pool: Pool) -> None:
        # One byte past the end of the last part reveals an object larger than expected.
        want = length + 1 if offset + length == self.size else length
        url = self.landing.url
        data = call_with_retries(
            lambda: self.store.get_range(self.landing.key, offset, want),
            f"GET {url} bytes {offset}-{offset + want - 1}",
            self.config.retry,
            pool.cancel,
        )
        if len(data) != length:
            raise StorageError(
                f"{url}: {len(data) if len(data) < want else 'more'} bytes at offset {offset} where {length} were "
                f"expected (object of {self.size} bytes): it changed, or the manifest is wrong: fix it and run again"
            )
        with os_errors_named(str(self.landing.part_path), "write"):
            write_all(self.fd, data, offset)
            pool.add_bytes(length)
            self.crcs.add(offset, data)
            if self.hasher is not None:
                complete = self.hasher.part_done(offset, length, data)
            else:
                with self._lock:
                    self._parts_left -= 1
                    complete = self._parts_left == 0
        if complete:
            self._finish(pool)

    def _finish(self, pool: Pool) -> None:
        hasher = self.hasher
        actual = Checksum(SHA256, hasher.hexdigest()) if hasher is not None else self.crcs.total(self.size)
        fd, self.fd = self.fd, -1
        self.landing.finish(self.expected, actual, fd)
        pool.file_done()

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.landing.discard()


class PartPut:
    """One local file sent to the store: in one request, or as parts when the store takes multipart uploads."""

    def __init__(self, store: ObjectStore, path: Path, key: str, size: int, config: TransferConfig) -> None:
        self.store, self.path, self.key, self.size, self.config = store, path, key, size, config
        self.url = store.url_for(key)
        self.fd = -1
        self.upload_id: str | None = None
        self.tags: list[str] = []
        self.crcs = PartCrcs()
        self.result: FileResult | None = None
        self._parts_left = 0
        self._lock = threading.Lock()

    def schedule(self, pool: Pool) -> None:
        part_size = self.config.part_size
        if isinstance(self.store, MultipartUploads):
            multipart_part = max(part_size, self.store.min_part_size, -(-self.size // MAX_MULTIPART_PARTS))
            if self.size > multipart_part:
                self._schedule_parts(pool, self.store, multipart_part)
                return
        pool.submit(min(self.size, part_size), partial(self._put_whole, pool))

    def _put_whole(self, pool: Pool) -> None:
        if self.size <= self.config.part_size:
            # Small enough to hold: one read serves both the CRC and the request.
            with os_errors_named(str(self.path), "read"):
                data = self.path.read_bytes()
            self._check_unchanged(len(data))
            checksum = checksum_bytes(data)
            info = call_with_retries(
                lambda: self.store.put_bytes(self.key, data), f"PUT {self.url}", self.config.retry, pool.cancel
            )
        else:
            with os_errors_named(str(self.path), "read"):
                checksum = checksum_file(self.path)
            info = call_with_retries(
                lambda: self.store.put_file(self.path, self.key), f"PUT {self.url}", self.config.retry, pool.cancel
            )
        pool.add_bytes(self.size)
        self._stored(info, checksum, pool)

    def _check_unchanged(self, size: int) -> None:
        if size != self.size:
            raise StorageError(
                f"{self.path}: changed size while uploading ({self.size} -> {size} bytes): "
                "upload files only once they are completely written"
            )

    def _stored(self, info: ObjectInfo, checksum: Checksum, pool: Pool) -> None:
        if info.size != self.size:
            raise StorageError(
                f"{self.url}: stored {info.size} bytes of {self.path}'s {self.size}: run the upload again"
            )
        self.result = FileResult.of(self.key, self.size, checksum, skipped=False)
        pool.file_done()

    def _schedule_parts(self, pool: Pool, store: MultipartUploads, part_size: int) -> None:
        with os_errors_named(str(self.path), "open"):
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self.upload_id = call_with_retries(
            lambda: store.start_multipart(self.key),
            f"start multipart upload of {self.url}",
            self.config.retry,
            pool.cancel,
        )
        count = self._parts_left = -(-self.size // part_size)
        self.tags = [""] * count
        for number, offset in enumerate(range(0, self.size, part_size), start=1):
            length = min(part_size, self.size - offset)
            pool.submit(length, partial(self._put_part, store, number, count, offset, length, pool))

    def _put_part(
        self, store: MultipartUploads, number: int, count: int, offset: int, length: int, pool: Pool
    ) -> None:
        assert self.upload_id is not None, "_schedule_parts starts the upload first"
        upload_id = self.upload_id
        with os_errors_named(str(self.path), "read"):
            data = os.pread(self.fd, length, offset)
        if len(data) != length:
            self._check_unchanged(offset + len(data))
        self.crcs.add(offset, data)
        self.tags[number - 1] = call_with_retries(
            lambda: store.put_part(self.key, upload_id, number, offset, data),
            f"PUT {self.url} part {number}/{count}",
            self.config.retry,
            pool.cancel,
        )
        pool.add_bytes(length)
        with self._lock:
            self._parts_left -= 1
            complete = self._parts_left == 0
        if complete:
            info = call_with_retries(
                lambda: store.finish_multipart(self.key, upload_id, self.tags),
                f"finish multipart upload of {self.url}",
                self.config.retry,
                pool.cancel,
            )
            os.close(self.fd)
            self.fd = -1
            self._stored(info, self.crcs.total(self.size), pool)

    def abort(self) -> None:
        """After a failed transfer: drop this file's uploaded parts, if any."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.upload_id is None or self.result is not None or not isinstance(self.store, MultipartUploads):
            return
        try:
            self.store.abort_multipart(self.key, self.upload_id)
        except Exception as exc:
            # The transfer's own error is what the caller must see; the leftover parts are reported here.
            log.error(
                "%s: could not abort multipart upload %s (%s): abort it with the store's tools or a lifecycle rule",
                self.url,
                self.upload_id,
                one_line(exc),
            )
