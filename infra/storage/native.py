"""The native engine: whole files handed to the store's own engine (awscrt's S3 client, google-cloud-storage's
transfer_manager), which splits, parallelizes, retries and checksums them without passing bytes through Python.

The transfer engine still owns what is the same for every store: which files to move, how many at once, the
landing of each download (verified before it gets its final name) and the verified state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from infra.storage.base import ObjectStore, StorageError
from infra.storage.checksum import Checksum
from infra.storage.files import os_errors_named
from infra.storage.landing import Landing
from infra.storage.pool import Pending, Pool, Threaded
from infra.storage.records import FileJob, FileResult, TransferConfig
from infra.storage.retry import call_with_retries
from infra.storage.stall import StalledRequest


class PendingFetch(Pending, Protocol):
    """One object on its way into a file, moved by the store's engine without a thread of the transfer's."""

    def result(self) -> Checksum | None:
        """Once done: what fetch_file's contract says the GET returns; raises StorageError when it failed."""
        ...


@runtime_checkable
class NativeTransfers(Protocol):
    """A store with an engine of its own for whole files."""

    def start_fetch(self, key: str, path: Path, size: int, expected: Checksum | None, job: FileJob) -> PendingFetch:
        """Begin writing the object (of size > 0) into path, created or truncated; returns at once.

        With expected, the bytes are checked against it as they arrive (ChecksumMismatch naming the object when
        they differ) and the result is expected; without, the checksum the store reported and the bytes were
        checked against, or None when there was none. An engine without a way to wait for a file other than
        blocking a thread runs it through job.background.
        """
        ...

    def send_file(self, path: Path, key: str, size: int, job: FileJob) -> Checksum:
        """Upload path as key, its checksum sent along so the store checks it; returns that checksum."""
        ...

    def files_in_flight(self, config: TransferConfig) -> int:
        """How many files its engine moves well at once."""
        ...

    def url_for(self, key: str) -> str: ...


def uses_native(store: ObjectStore, config: TransferConfig) -> bool:
    return config.engine == "native" and isinstance(store, NativeTransfers)


class NativeFetch:
    """One object downloaded by the store's engine into its landing file."""

    def __init__(
        self, store: NativeTransfers, landing: Landing, expected: Checksum | None, config: TransferConfig
    ) -> None:
        self.store, self.landing, self.expected, self.config = store, landing, expected, config

    def schedule(self, pool: Pool) -> None:
        # No bytes of it are held here: the store's engine bounds its own memory (config.memory_limit).
        pool.start(lambda: self._begin(pool), lambda fetch: self._finish(fetch, pool))

    def _begin(self, pool: Pool) -> PendingFetch:
        landing = self.landing
        landing.prepare()
        if landing.size == 0:
            # Nothing to fetch (and a ranged GET of nothing is an error on some servers): the file is empty.
            with os_errors_named(str(landing.part_path), "create"):
                landing.part_path.write_bytes(b"")
            return Threaded.done(None)
        job = FileJob(self.config, pool.add_bytes, pool.cancel, pool.background)
        return self.store.start_fetch(landing.key, landing.part_path, landing.size, self.expected, job)

    def _finish(self, fetch: PendingFetch, pool: Pool) -> None:
        self.landing.finish(self.expected, fetch.result(), direct_io=self.config.direct_io)
        pool.file_done()

    def discard(self) -> None:
        self.landing.discard()


class NativePut:
    """One local file uploaded by the store's engine."""

    def __init__(self, store: NativeTransfers, path: Path, key: str, size: int, config: TransferConfig) -> None:
        self.store, self.path, self.key, self.size, self.config = store, path, key, size, config
        self.result: FileResult | None = None

    def schedule(self, pool: Pool) -> None:
        pool.submit(0, lambda: self._run(pool))

    def _run(self, pool: Pool) -> None:
        job = FileJob(self.config, pool.add_bytes, pool.cancel, pool.background)
        # A stalled request was cancelled before it could finish: the whole file goes again. The engine's other
        # failures are final here (the store's engine retried them already).
        checksum = call_with_retries(lambda: self.store.send_file(self.path, self.key, self.size, job),
                                     f"PUT {self.store.url_for(self.key)}", self.config.retry, pool.cancel,
                                     retryable=lambda exc: isinstance(exc, StalledRequest))
        check_unchanged(self.path, self.size)
        self.result = FileResult.of(self.key, self.size, checksum, skipped=False)
        pool.file_done()

    def abort(self) -> None:
        """Nothing to drop: the store's engine aborts its own unfinished multipart uploads."""


def check_unchanged(path: Path, size: int) -> None:
    """Raise when a file to upload no longer has the size it was planned with."""
    with os_errors_named(str(path), "read"):
        now = path.stat().st_size
    if now != size:
        raise StorageError(
            f"{path}: changed size while uploading ({size} -> {now} bytes): "
            "upload files only once they are completely written"
        )
