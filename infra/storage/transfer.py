"""The transfer engine: many objects, split into fixed-size parts, moved by one bounded pool of workers.

One pool over the parts of every file at once keeps all workers busy whether a job is a million small
shards or a few huge checkpoint files. Work in flight is bounded in bytes and in parts (back-pressure:
memory and open files stay flat however many files there are), each part is retried on transient
errors, and every downloaded file is verified before it gets its final name.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import shutil
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

from infra.errors import is_transient
from infra.storage.base import ChecksumMismatch, ObjectInfo, ObjectNotFound, ObjectStore, StorageError
from infra.storage.checksum import PrefixHasher, VerifiedCache, sha256_file
from infra.storage.local import is_safe_key, os_errors_named, write_all

__all__ = [
    "DEFAULT_RETRY",
    "FileResult",
    "FileSpec",
    "MultipartUploads",
    "Progress",
    "RetryPolicy",
    "TransferResult",
    "call_with_retries",
    "download",
    "is_transient",
    "sha256_file",
    "upload",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

TICK_S = 0.1  # progress callbacks and failure checks happen at most this often
PART_SUFFIX = ".part"
DEFAULT_PART_SIZE = 8 << 20
DEFAULT_INFLIGHT_BYTES = 256 << 20
TASKS_PER_WORKER = 4  # queued + running parts per worker: enough to never starve, few enough to bound open files
MAX_MULTIPART_PARTS = 10_000  # S3's limit; the part size grows for objects that would need more


# -- results and progress -----------------------------------------------------------------------------


@dataclass(frozen=True)
class FileSpec:
    """One object to move; its expected size and sha256 when known (e.g. from a manifest)."""

    key: str
    size: int | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class Progress:
    """Passed to the progress callback at most every TICK_S seconds, and once at the end.

    Totals count only what is moved: files skipped as already valid are in neither.
    """

    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    elapsed_s: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes_done / 1e6 / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float:
        """Seconds left at the rate so far; inf before anything has moved."""
        remaining = self.bytes_total - self.bytes_done
        if remaining <= 0:
            return 0.0
        rate = self.bytes_done / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return remaining / rate if rate > 0 else math.inf


@dataclass(frozen=True)
class FileResult:
    key: str
    size: int
    sha256: str
    skipped: bool


@dataclass(frozen=True)
class TransferResult:
    files: list[FileResult]
    seconds: float

    @property
    def bytes_moved(self) -> int:
        return sum(f.size for f in self.files if not f.skipped)

    @property
    def bytes_skipped(self) -> int:
        return sum(f.size for f in self.files if f.skipped)

    @property
    def files_skipped(self) -> int:
        return sum(1 for f in self.files if f.skipped)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_moved / 1e6 / self.seconds if self.seconds > 0 else 0.0


# -- retries ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    base_s: float = 0.2
    max_s: float = 10.0

    def delay_s(self, retry: int) -> float:
        """Exponential backoff with jitter, so parts that failed together do not retry together."""
        ceiling = min(self.max_s, self.base_s * 2 ** (retry - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)


DEFAULT_RETRY = RetryPolicy()


class _Cancelled(Exception):
    """Raised inside a worker whose transfer already failed elsewhere; never reaches the caller."""


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def call_with_retries(
    call: Callable[[], T],
    what: str,
    policy: RetryPolicy = DEFAULT_RETRY,
    cancel: threading.Event | None = None,
) -> T:
    """call(), retried with backoff while it fails transiently; what names the operation in logs and errors."""
    attempt = 1
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            if attempt >= policy.attempts:
                raise StorageError(
                    f"{what}: failed {attempt} times, last with {_one_line(exc)}: "
                    "check the network and the store, then run again"
                ) from exc
            delay = policy.delay_s(attempt)
            log.warning(
                "%s failed (%s): retry %d/%d in %.2fs", what, _one_line(exc), attempt, policy.attempts - 1, delay
            )
            if cancel is None:
                time.sleep(delay)
            elif cancel.wait(delay):
                raise _Cancelled(what) from exc
            attempt += 1


# -- the pool -----------------------------------------------------------------------------------------


class _Pool:
    """The bounded worker pool shared by every part of one transfer, with back-pressure and progress.

    The first failure of any task cancels the rest and is raised to the caller's thread; progress
    callbacks run on the caller's thread too, so they never race each other.
    """

    def __init__(
        self, workers: int, max_inflight_bytes: int, progress: Callable[[Progress], None] | None, started: float
    ) -> None:
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="trainpipe-transfer")
        self._max_bytes = max_inflight_bytes
        self._max_tasks = TASKS_PER_WORKER * workers
        self._cond = threading.Condition()
        self._bytes_in_flight = 0
        self._tasks_in_flight = 0
        self._error: BaseException | None = None
        self.cancel = threading.Event()
        self._progress = progress
        self._started = started
        self._last_report = -math.inf
        self.bytes_total = self.files_total = self.bytes_done = self.files_done = 0
        self._totals_known = False  # no progress while planning: "0 of 0 bytes" would mislead

    def submit(self, nbytes: int, task: Callable[[], T]) -> Future[T]:
        """Run task on a worker once fewer than the bounded bytes and tasks are in flight."""
        while True:
            with self._cond:
                if self._error is not None:
                    raise self._error
                fits = self._tasks_in_flight < self._max_tasks and self._bytes_in_flight + nbytes <= self._max_bytes
                # A part larger than the whole budget still runs, alone.
                if fits or self._tasks_in_flight == 0:
                    self._tasks_in_flight += 1
                    self._bytes_in_flight += nbytes
                    break
                self._cond.wait(TICK_S)
            self.report()
        return self._executor.submit(self._run, nbytes, task)

    def _run(self, nbytes: int, task: Callable[[], T]) -> T:
        try:
            if self.cancel.is_set():
                raise _Cancelled()
            return task()
        except BaseException as exc:
            with self._cond:
                if self._error is None and not isinstance(exc, _Cancelled):
                    self._error = exc
                self.cancel.set()
            raise
        finally:
            with self._cond:
                self._tasks_in_flight -= 1
                self._bytes_in_flight -= nbytes
                self._cond.notify_all()

    def wait_idle(self) -> None:
        """Block until every submitted task has finished; raise the first failure."""
        while True:
            with self._cond:
                if self._error is not None:
                    raise self._error
                if self._tasks_in_flight == 0:
                    return
                self._cond.wait(TICK_S)
            self.report()

    def shutdown(self, *, cancel: bool) -> None:
        """Stop the workers (after their current part when cancelling); no thread outlives the transfer."""
        if cancel:
            self.cancel.set()
        self._executor.shutdown(wait=True, cancel_futures=cancel)

    def set_totals(self, bytes_total: int, files_total: int) -> None:
        with self._cond:
            self.bytes_total, self.files_total = bytes_total, files_total
            self._totals_known = True

    def add_bytes(self, n: int) -> None:
        with self._cond:
            self.bytes_done += n

    def file_done(self) -> None:
        with self._cond:
            self.files_done += 1

    def report(self, *, final: bool = False) -> None:
        now = time.monotonic()
        if self._progress is None or not self._totals_known or (not final and now - self._last_report < TICK_S):
            return
        self._last_report = now
        with self._cond:
            snapshot = Progress(
                self.bytes_done, self.bytes_total, self.files_done, self.files_total, now - self._started
            )
        self._progress(snapshot)


def _check_args(workers: int, part_size: int, max_inflight_bytes: int) -> None:
    for name, value in (("workers", workers), ("part_size", part_size), ("max_inflight_bytes", max_inflight_bytes)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be at least 1")


def _checked_keys(keys: Sequence[str], where: str) -> None:
    seen: set[str] = set()
    for key in keys:
        if not is_safe_key(key):
            raise StorageError(
                f"{where}: unsafe key {key!r}: use a relative '/'-separated path without '', '.' or '..' parts"
            )
        if key in seen:
            raise StorageError(f"{where}: key {key!r} is listed twice: list each file once")
        seen.add(key)


# -- download -----------------------------------------------------------------------------------------


class _Fetch:
    """One object downloaded into <dest>.part at part offsets, verified, then renamed to dest."""

    def __init__(
        self,
        store: ObjectStore,
        spec: FileSpec,
        size: int,
        etag: str | None,
        dest_dir: Path,
        cache: VerifiedCache,
        retry: RetryPolicy,
    ) -> None:
        self.store, self.key, self.size, self.sha256, self.etag = store, spec.key, size, spec.sha256, etag
        self.url = store.url_for(spec.key)
        self.dest = dest_dir / spec.key
        self.part_path = self.dest.with_name(self.dest.name + PART_SUFFIX)
        self.cache, self.retry = cache, retry
        self.fd = -1
        self.hasher: PrefixHasher | None = None
        self.result: FileResult | None = None

    def open(self) -> None:
        """Create the preallocated <dest>.part that parts are written into."""
        with os_errors_named(str(self.part_path), "create"):
            self.dest.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.part_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
            os.ftruncate(self.fd, self.size)
        self.hasher = PrefixHasher(self.fd, self.size)

    def fetch_part(self, offset: int, length: int, pool: _Pool) -> None:
        assert self.hasher is not None, "open() comes first"
        # One byte past the end of the last part reveals an object larger than expected.
        want = length + 1 if offset + length == self.size else length
        data = call_with_retries(
            lambda: self.store.get_range(self.key, offset, want),
            f"GET {self.url} bytes {offset}-{offset + want - 1}",
            self.retry,
            pool.cancel,
        )
        if len(data) != length:
            raise StorageError(
                f"{self.url}: {len(data) if len(data) < want else 'more'} bytes at offset {offset} where {length} were "
                f"expected (object of {self.size} bytes): it changed, or the manifest is wrong: fix it and run again"
            )
        with os_errors_named(str(self.part_path), "write"):
            write_all(self.fd, data, offset)
            pool.add_bytes(length)
            if self.hasher.part_done(offset, length, data):
                self.finish(pool)

    def finish(self, pool: _Pool) -> None:
        """Verify the complete .part and give it its final name."""
        assert self.hasher is not None, "open() comes first"
        digest = self.hasher.hexdigest()
        with os_errors_named(str(self.part_path), "finish"):
            # Stamp the file one second in the past: a later write, even within the same clock tick as this
            # download, then always changes mtime, so the verified cache can never trust a modified file.
            past_ns = time.time_ns() - 1_000_000_000
            os.utime(self.fd, ns=(past_ns, past_ns))
            os.fsync(self.fd)  # the final name must never point at data a crash can lose
            written = os.fstat(self.fd)
            os.close(self.fd)
            self.fd = -1
            if written.st_size != self.size:
                raise StorageError(f"{self.part_path}: {written.st_size} bytes instead of {self.size}: run again")
            if self.sha256 is not None and digest != self.sha256:
                self.part_path.unlink()
                raise ChecksumMismatch(
                    f"{self.url}: sha256 {digest} does not match the expected {self.sha256}: "
                    "the object or its manifest is corrupt: re-upload the object or fix the manifest"
                )
            os.replace(self.part_path, self.dest)
        self.cache.record(self.key, written, digest, self.etag)
        self.result = FileResult(self.key, self.size, digest, skipped=False)
        pool.file_done()

    def discard(self) -> None:
        """After a failed transfer: no partial file is left behind, under either name."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.result is None:
            self.part_path.unlink(missing_ok=True)


def _valid_local_sha256(
    store: ObjectStore, spec: FileSpec, size: int, etag: str | None, dest: Path, cache: VerifiedCache
) -> str | None:
    """The sha256 of dest when it already holds the object (so it need not be fetched), else None."""
    with os_errors_named(str(dest), "check"):
        try:
            st = dest.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return None
        known = cache.lookup(spec.key, st)
        if spec.sha256 is None:
            # Without an expected sha256 only a file verified from this very version of the object is trusted.
            return known.sha256 if known is not None and etag is not None and known.etag == etag else None
        if known is not None and known.sha256 == spec.sha256:
            return known.sha256
        actual = sha256_file(dest)
    if actual != spec.sha256:
        log.info(
            "%s differs from %s (sha256 %s, expected %s): fetching it again",
            dest,
            store.url_for(spec.key),
            actual,
            spec.sha256,
        )
        return None
    cache.record(spec.key, st, actual, etag)
    return actual


def _plan_fetch(
    store: ObjectStore, spec: FileSpec, dest_dir: Path, cache: VerifiedCache, retry: RetryPolicy, pool: _Pool
) -> FileResult | _Fetch:
    """Skip the object when dest already holds it, else say how to fetch it."""
    url = store.url_for(spec.key)
    size, etag = spec.size, None
    # With no expected sha256, the etag is what proves a local copy current.
    if size is None or spec.sha256 is None:
        info = call_with_retries(lambda: store.head(spec.key), f"HEAD {url}", retry, pool.cancel)
        if info is None:
            raise ObjectNotFound(f"{url}: no such object: check the key, or the manifest that lists it")
        if size is not None and info.size != size:
            raise StorageError(f"{url}: {info.size} bytes where {size} are expected: fix the manifest or the object")
        size, etag = info.size, info.etag
    sha = _valid_local_sha256(store, spec, size, etag, dest_dir / spec.key, cache)
    if sha is not None:
        return FileResult(spec.key, size, sha, skipped=True)
    return _Fetch(store, spec, size, etag, dest_dir, cache, retry)


def _check_free_space(dest_dir: Path, fetches: Sequence[_Fetch]) -> None:
    needed = sum(fetch.size for fetch in fetches)
    free = shutil.disk_usage(dest_dir).free
    if needed > free:
        raise StorageError(
            f"{dest_dir}: {len(fetches)} files need {needed / 1e9:.2f} GB but {free / 1e9:.2f} GB is free: "
            "free space or choose another directory"
        )


def download(
    store: ObjectStore,
    files: Sequence[FileSpec],
    dest_dir: Path,
    *,
    workers: int = 8,
    part_size: int = DEFAULT_PART_SIZE,
    max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
    progress: Callable[[Progress], None] | None = None,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> TransferResult:
    """Fetch every object to dest_dir/<key>, verified; objects already there and valid are skipped."""
    _check_args(workers, part_size, max_inflight_bytes)
    started = time.monotonic()
    dest_dir = Path(dest_dir)
    _checked_keys([spec.key for spec in files], store.url)
    with os_errors_named(str(dest_dir), "create"):
        dest_dir.mkdir(parents=True, exist_ok=True)
    cache = VerifiedCache(dest_dir)
    pool = _Pool(workers, max_inflight_bytes, progress, started)
    fetches: list[_Fetch] = []
    try:
        plans = [pool.submit(0, partial(_plan_fetch, store, spec, dest_dir, cache, retry, pool)) for spec in files]
        pool.wait_idle()
        outcomes = [plan.result() for plan in plans]
        fetches = [outcome for outcome in outcomes if isinstance(outcome, _Fetch)]
        _check_free_space(dest_dir, fetches)
        pool.set_totals(sum(fetch.size for fetch in fetches), len(fetches))
        for fetch in fetches:
            fetch.open()
            if fetch.size == 0:
                fetch.finish(pool)
            for offset in range(0, fetch.size, part_size):
                length = min(part_size, fetch.size - offset)
                pool.submit(length, partial(fetch.fetch_part, offset, length, pool))
        pool.wait_idle()
    except BaseException:
        pool.shutdown(cancel=True)
        for fetch in fetches:
            fetch.discard()
        _save_after_failure(cache)
        raise
    pool.shutdown(cancel=False)
    cache.save()
    pool.report(final=True)
    results = [outcome.result if isinstance(outcome, _Fetch) else outcome for outcome in outcomes]
    return TransferResult(_all_finished(results), time.monotonic() - started)


def _all_finished(results: Sequence[FileResult | None]) -> list[FileResult]:
    finished = [result for result in results if result is not None]
    if len(finished) != len(results):
        raise RuntimeError(f"{len(results) - len(finished)} files never finished although no transfer failed")
    return finished


def _save_after_failure(cache: VerifiedCache) -> None:
    # Files verified before the failure stay trusted on the rerun; the transfer's own error is what the
    # caller must see, so a cache that cannot be written is reported here rather than replacing it.
    try:
        cache.save()
    except (OSError, StorageError) as exc:
        log.error("%s: could not save after a failed download (%s): the next run verifies files again", cache.path, exc)


# -- upload -------------------------------------------------------------------------------------------


@runtime_checkable
class MultipartUploads(Protocol):
    """A store that accepts one object as parts uploaded in parallel (S3 multipart, GCS XML multipart).

    The engine uses it for files larger than a part; stores without it get put_bytes / put_file.
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


class _Put:
    """One local file sent to the store: in one request, or as parts when the store takes multipart uploads."""

    def __init__(self, store: ObjectStore, path: Path, key: str, size: int, retry: RetryPolicy) -> None:
        self.store, self.path, self.key, self.size, self.retry = store, path, key, size, retry
        self.url = store.url_for(key)
        self.fd = -1
        self.upload_id: str | None = None
        self.tags: list[str] = []
        self.result: FileResult | None = None

    def schedule(self, pool: _Pool, part_size: int) -> None:
        if isinstance(self.store, MultipartUploads):
            multipart_part = max(part_size, self.store.min_part_size, -(-self.size // MAX_MULTIPART_PARTS))
            if self.size > multipart_part:
                self._schedule_parts(pool, self.store, multipart_part)
                return
        pool.submit(min(self.size, part_size), partial(self._put_whole, part_size, pool))

    def _put_whole(self, part_size: int, pool: _Pool) -> None:
        if self.size <= part_size:
            # Small enough to hold: one read serves both the hash and the request.
            with os_errors_named(str(self.path), "read"):
                data = self.path.read_bytes()
            self._check_unchanged(len(data))
            sha = hashlib.sha256(data).hexdigest()
            info = call_with_retries(
                lambda: self.store.put_bytes(self.key, data), f"PUT {self.url}", self.retry, pool.cancel
            )
        else:
            with os_errors_named(str(self.path), "read"):
                sha = sha256_file(self.path)
            info = call_with_retries(
                lambda: self.store.put_file(self.path, self.key), f"PUT {self.url}", self.retry, pool.cancel
            )
        pool.add_bytes(self.size)
        self._stored(info, sha, pool)

    def _check_unchanged(self, size: int) -> None:
        if size != self.size:
            raise StorageError(
                f"{self.path}: changed size while uploading ({self.size} -> {size} bytes): "
                "upload files only once they are completely written"
            )

    def _stored(self, info: ObjectInfo, sha: str, pool: _Pool) -> None:
        if info.size != self.size:
            raise StorageError(
                f"{self.url}: stored {info.size} bytes of {self.path}'s {self.size}: run the upload again"
            )
        self.result = FileResult(self.key, self.size, sha, skipped=False)
        pool.file_done()

    def _schedule_parts(self, pool: _Pool, store: MultipartUploads, part_size: int) -> None:
        with os_errors_named(str(self.path), "open"):
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        hasher = PrefixHasher(self.fd, self.size)
        self.upload_id = call_with_retries(
            lambda: store.start_multipart(self.key), f"start multipart upload of {self.url}", self.retry, pool.cancel
        )
        count = -(-self.size // part_size)
        self.tags = [""] * count
        for number, offset in enumerate(range(0, self.size, part_size), start=1):
            length = min(part_size, self.size - offset)
            pool.submit(length, partial(self._put_part, store, hasher, number, count, offset, length, pool))

    def _put_part(
        self,
        store: MultipartUploads,
        hasher: PrefixHasher,
        number: int,
        count: int,
        offset: int,
        length: int,
        pool: _Pool,
    ) -> None:
        assert self.upload_id is not None, "_schedule_parts starts the upload first"
        upload_id = self.upload_id
        with os_errors_named(str(self.path), "read"):
            data = os.pread(self.fd, length, offset)
        if len(data) != length:
            self._check_unchanged(offset + len(data))
        self.tags[number - 1] = call_with_retries(
            lambda: store.put_part(self.key, upload_id, number, offset, data),
            f"PUT {self.url} part {number}/{count}",
            self.retry,
            pool.cancel,
        )
        pool.add_bytes(length)
        with os_errors_named(str(self.path), "read"):
            complete = hasher.part_done(offset, length, data)
        if complete:
            info = call_with_retries(
                lambda: store.finish_multipart(self.key, upload_id, self.tags),
                f"finish multipart upload of {self.url}",
                self.retry,
                pool.cancel,
            )
            os.close(self.fd)
            self.fd = -1
            self._stored(info, hasher.hexdigest(), pool)

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
                _one_line(exc),
            )


def upload(
    src_dir: Path,
    rel_paths: Sequence[str],
    store: ObjectStore,
    *,
    workers: int = 8,
    part_size: int = DEFAULT_PART_SIZE,
    max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
    progress: Callable[[Progress], None] | None = None,
    retry: RetryPolicy = DEFAULT_RETRY,
    keys: Sequence[str] | None = None,
) -> TransferResult:
    """Send src_dir/<rel> to the store as key <rel> (or keys[i], when given) for every rel path.

    Returns each file's sha256, under its key.
    """
    _check_args(workers, part_size, max_inflight_bytes)
    started = time.monotonic()
    src_dir = Path(src_dir)
    _checked_keys(rel_paths, str(src_dir))
    if keys is None:
        keys = rel_paths
    elif len(keys) != len(rel_paths):
        raise ValueError(f"{len(keys)} keys for {len(rel_paths)} files: give one key per file")
    else:
        _checked_keys(keys, store.url)
    puts: list[_Put] = []
    for rel, key in zip(rel_paths, keys, strict=True):
        path = src_dir / rel
        with os_errors_named(str(path), "read"):
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise StorageError(f"{path}: no such local file: write it before uploading it") from None
        puts.append(_Put(store, path, key, size, retry))
    pool = _Pool(workers, max_inflight_bytes, progress, started)
    pool.set_totals(sum(put.size for put in puts), len(puts))
    try:
        for put in puts:
            put.schedule(pool, part_size)
        pool.wait_idle()
    except BaseException:
        pool.shutdown(cancel=True)
        for put in puts:
            put.abort()
        raise
    pool.shutdown(cancel=False)
    pool.report(final=True)
    return TransferResult(_all_finished([put.result for put in puts]), time.monotonic() - started)
