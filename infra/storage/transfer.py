"""The transfer engine: many objects moved between a store and a local directory, verified end to end.

    download(store, [FileSpec(key, size, crc=...)], dest_dir)     # -> TransferResult
    upload(src_dir, rel_paths, store)                              # each FileResult carries the file's CRC

Files go through the store's native engine where it has one (S3: awscrt; GCS: transfer_manager) and otherwise
as ranged parts on a bounded worker pool (parts.py); TransferConfig tunes both. Every downloaded file is checked
against its expected checksum (the manifest's, else the one the store reports) before it gets its final name;
files already there and valid are skipped, remembered in a verified state kept outside the destination.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from pathlib import Path

from infra.errors import is_transient
from infra.storage.base import ObjectNotFound, ObjectStore, StorageError
from infra.storage.checksum import Checksum, checksum_file, checksum_or_none, sha256_file
from infra.storage.files import is_safe_key, os_errors_named
from infra.storage.landing import PART_SUFFIX, Landing
from infra.storage.native import NativeFetch, NativePut, NativeTransfers, uses_native
from infra.storage.parts import MultipartUploads, PartFetch, PartPut
from infra.storage.pool import TICK_S, Pool, Progress, Threaded
from infra.storage.records import DEFAULT_CONFIG, FileResult, FileSpec, TransferConfig, TransferResult
from infra.storage.retry import DEFAULT_RETRY, RetryPolicy, call_with_retries
from infra.storage.stall import CANCEL_WAIT_S
from infra.storage.verified import VerifiedFiles

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_PART_SIZE",
    "DEFAULT_RETRY",
    "PART_SUFFIX",
    "TICK_S",
    "FileResult",
    "FileSpec",
    "MultipartUploads",
    "NativeTransfers",
    "Progress",
    "RetryPolicy",
    "TransferConfig",
    "TransferResult",
    "call_with_retries",
    "download",
    "is_transient",
    "sha256_file",
    "upload",
]

log = logging.getLogger(__name__)

DEFAULT_PART_SIZE = DEFAULT_CONFIG.part_size

Fetch = NativeFetch | PartFetch
Put = NativePut | PartPut


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


def _pool(store: ObjectStore, config: TransferConfig, progress: Callable[[Progress], None] | None,
          started: float) -> Pool:
    if isinstance(store, NativeTransfers) and uses_native(store, config):
        # The store's engine moves the files; the slots bound how many it holds at once, and workers are started
        # only as waiting (or the finishing of a file) needs them.
        files = store.files_in_flight(config)
        return Pool(files, config.max_inflight_bytes, progress, started, max_tasks=files, stuck_s=_stuck_s(config))
    return Pool(config.workers, config.max_inflight_bytes, progress, started, stuck_s=_stuck_s(config))


def _stuck_s(config: TransferConfig) -> float:
    """How long a transfer may move nothing before it is stuck: longer than every attempt of one request
    stalling, being cancelled and backing off, so only work that ignores its own bounds reaches it."""
    return config.retry.attempts * (config.stall_timeout_s + CANCEL_WAIT_S + config.retry.max_s)


def _all_finished(results: Sequence[FileResult | None]) -> list[FileResult]:
    finished = [result for result in results if result is not None]
    if len(finished) != len(results):
        raise RuntimeError(f"{len(results) - len(finished)} files never finished although no transfer failed")
    return finished


# -- download -----------------------------------------------------------------------------------------


def _valid_local(landing: Landing, expected: Checksum | None) -> FileResult | None:
    """The result for a dest that already holds the object (so it need not be fetched), else None."""
    dest, verified = landing.dest, landing.verified
    with os_errors_named(str(dest), "check"):
        try:
            st = dest.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size != landing.size:
            return None
        known = verified.lookup(landing.key, st)
        if expected is None:
            # Without an expected checksum only a file verified from this very version of the object is trusted.
            if known is None or landing.etag is None or known.etag != landing.etag:
                return None
            return FileResult.of(landing.key, st.st_size, checksum_or_none(known.checksum), skipped=True)
        if known is not None and known.checksum == str(expected):
            return FileResult.of(landing.key, st.st_size, expected, skipped=True)
        actual = checksum_file(dest, expected.algorithm)
    if actual != expected:
        log.info("%s differs from %s (%s, expected %s): fetching it again", dest, landing.url, actual, expected)
        return None
    verified.record(landing.key, st, str(actual), landing.etag)
    return FileResult.of(landing.key, st.st_size, actual, skipped=True)


def _plan(store: ObjectStore, spec: FileSpec, dest_dir: Path, verified: VerifiedFiles, config: TransferConfig,
          pool: Pool) -> Future[FileResult | Fetch]:
    """_plan_fetch: on a worker when it may wait (a HEAD, reading a local copy), else here and now."""
    plan = partial(_plan_fetch, store, spec, dest_dir, verified, config, pool)
    if spec.size is not None and not os.path.lexists(dest_dir / spec.key):
        return Threaded.done(plan()).future
    return pool.submit(0, plan)


def _plan_fetch(
    store: ObjectStore, spec: FileSpec, dest_dir: Path, verified: VerifiedFiles, config: TransferConfig, pool: Pool
) -> FileResult | Fetch:
    """Skip the object when dest already holds it, else say how to fetch it."""
    url = store.url_for(spec.key)
    size, etag, expected = spec.size, spec.etag, spec.expected
    # A spec without a size asks the store (a listing gave size and etag already). With no expected checksum the
    # store's own is what a copy is held to: from this HEAD, or else the one the native engine meets in the GET.
    if size is None:
        info = call_with_retries(lambda: store.head(spec.key), f"HEAD {url}", config.retry, pool.cancel)
        if info is None:
            raise ObjectNotFound(f"{url}: no such object: check the key, or the manifest that lists it")
        size, etag = info.size, info.etag
        # The caller's checksum (a manifest's) outranks the store's: the store holds whatever was put there.
        expected = expected or checksum_or_none(info.checksum)
    landing = Landing(url, spec.key, dest_dir / spec.key, size, etag, verified)
    skipped = _valid_local(landing, expected)
    if skipped is not None:
        return skipped
    if uses_native(store, config):
        assert isinstance(store, NativeTransfers)
        return NativeFetch(store, landing, expected, config)
    return PartFetch(store, landing, expected, config)


def _check_free_space(dest_dir: Path, fetches: Sequence[Fetch]) -> None:
    needed = sum(fetch.landing.size for fetch in fetches)
    free = shutil.disk_usage(dest_dir).free
    if needed > free:
        raise StorageError(
            f"{dest_dir}: {len(fetches)} files need {needed / 1e9:.2f} GB but {free / 1e9:.2f} GB is free: "
            "free space or choose another directory"
        )


def download(store: ObjectStore, files: Sequence[FileSpec], dest_dir: Path, config: TransferConfig = DEFAULT_CONFIG,
             *, progress: Callable[[Progress], None] | None = None, state_dir: Path | None = None) -> TransferResult:
    """Fetch every object to dest_dir/<key>, verified; objects already there and valid are skipped.

    dest_dir receives only the objects; what was verified is remembered under state_dir (default: the user's
    cache dir, infra.storage.verified) for the next run to skip.
    """
    started = time.monotonic()
    store = store.with_stall_timeout(config.stall_timeout_s)
    dest_dir = Path(dest_dir)
    _checked_keys([spec.key for spec in files], store.url)
    with os_errors_named(str(dest_dir), "create"):
        dest_dir.mkdir(parents=True, exist_ok=True)
    verified = VerifiedFiles(dest_dir, state_dir)
    fetches: list[Fetch] = []

    def undo() -> None:
        for fetch in fetches:
            fetch.discard()
        _save_after_failure(verified)

    with _pool(store, config, progress, started).running(undo) as pool:
        plans = [_plan(store, spec, dest_dir, verified, config, pool) for spec in files]
        pool.wait_idle()
        outcomes = [plan.result() for plan in plans]
        fetches = [outcome for outcome in outcomes if not isinstance(outcome, FileResult)]
        _check_free_space(dest_dir, fetches)
        pool.set_totals(sum(fetch.landing.size for fetch in fetches), len(fetches))
        for fetch in fetches:
            fetch.schedule(pool)
    verified.save()
    results = [outcome if isinstance(outcome, FileResult) else outcome.landing.result for outcome in outcomes]
    engine = "native" if uses_native(store, config) else "python"
    return TransferResult(_all_finished(results), time.monotonic() - started, engine)


def _save_after_failure(verified: VerifiedFiles) -> None:
    # Files verified before the failure stay trusted on the rerun; the transfer's own error is what the
    # caller must see, so a state that cannot be written is reported here rather than replacing it.
    try:
        verified.save()
    except (OSError, StorageError) as exc:
        log.error("%s: could not save after a failed download (%s): the next run verifies files again", verified.path,
                  exc)


# -- upload -------------------------------------------------------------------------------------------


def upload(src_dir: Path, rel_paths: Sequence[str], store: ObjectStore, config: TransferConfig = DEFAULT_CONFIG, *,
           progress: Callable[[Progress], None] | None = None, keys: Sequence[str] | None = None) -> TransferResult:
    """Send src_dir/<rel> to the store as key <rel> (or keys[i], when given) for every rel path.

    Returns each file's CRC (FileResult.crc), under its key: the checksum the store was given to check.
    """
    started = time.monotonic()
    store = store.with_stall_timeout(config.stall_timeout_s)
    src_dir = Path(src_dir)
    _checked_keys(rel_paths, str(src_dir))
    if keys is None:
        keys = rel_paths
    elif len(keys) != len(rel_paths):
        raise ValueError(f"{len(keys)} keys for {len(rel_paths)} files: give one key per file")
    else:
        _checked_keys(keys, store.url)
    native = uses_native(store, config)
    puts: list[Put] = []
    for rel, key in zip(rel_paths, keys, strict=True):
        path = src_dir / rel
        with os_errors_named(str(path), "read"):
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise StorageError(f"{path}: no such local file: write it before uploading it") from None
        if native:
            assert isinstance(store, NativeTransfers)
            puts.append(NativePut(store, path, key, size, config))
        else:
            puts.append(PartPut(store, path, key, size, config))
    with _pool(store, config, progress, started).running(lambda: [put.abort() for put in puts]) as pool:
        pool.set_totals(sum(put.size for put in puts), len(puts))
        for put in puts:
            put.schedule(pool)
    return TransferResult(_all_finished([put.result for put in puts]), time.monotonic() - started,
                          "native" if native else "python")
