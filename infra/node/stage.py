"""`stage`: mirror this node's files of the run's dataset snapshot into its data dir, and each input's snapshot whole
into <inputs_dir>/<name>, verified.

Runs on the node, so the bytes travel store → node directly; the orchestrator only sees progress events. The data
dir ends up holding exactly the node's selected files (replicate: every snapshot file; split: its share) under their
keys, and nothing else; <workdir>/data-files.txt lists them, one path per line relative to the data dir. Objects
come from the node's cache when it holds the same bytes (by checksum); the rest are fetched in parallel parts,
verified against the snapshot's checksum, and adopted into the cache for the next run. The dataset and the inputs
go one after the other through the one cache (it is locked while staging): an input's bytes are reused by the next
run exactly as the dataset's are. Events: `staged` for the dataset, `input-staged` (with its name) per input.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from infra.dataset.assign import assign
from infra.dataset.checksums import file_matches, hasher
from infra.dataset.errors import DatasetError
from infra.dataset.snapshot import DATASET, DatasetSnapshot, SnapshotFile, check_unchanged, read_snapshot
from infra.dataset.stagecache import CacheBusy, ObjectCache, link_into
from infra.node.events import NodeEvent, Throttle, emit, fail
from infra.node.fanout import Counts, Exchange, Piece
from infra.node.protocol import NodeCommand, NodeRequest, StageRequest, as_request
from infra.storage import StorageError, open_store
from infra.storage.base import ChecksumMismatch, ObjectStore
from infra.storage.records import DEFAULT_CONFIG
from infra.storage.transfer import DEFAULT_PART_SIZE, TICK_S, FileSpec, Progress, call_with_retries, download

log = logging.getLogger(__name__)

FILES_LIST = "data-files.txt"
_VERIFY_THREADS = 4


def _spec(file: SnapshotFile) -> FileSpec:
    algorithm, _, digest = file.checksum.partition(":")
    # The engine checks sha256 while it writes; other checksums are checked here once the file is whole.
    return FileSpec(file.key, file.size, digest if algorithm == "sha256" else None)


def _changed_during_staging(snapshot: DatasetSnapshot, file: SnapshotFile, what: str) -> DatasetError:
    return DatasetError(f"{snapshot.file_url(file)}: {what} differs from the run's snapshot ({file.checksum}): the "
                        "object changed after the run was planned: restore it, or start a new run (a new run id)")


def _open_cache(cache_dir: Path, workdir: Path) -> ObjectCache:
    try:
        return ObjectCache(cache_dir)
    except CacheBusy:
        # Another run is staging on this machine now: this one keeps its own cache rather than wait.
        own = workdir / "dataset-cache"
        log.info("%s is in use by another stager: caching in %s instead", cache_dir, own)
        return ObjectCache(own)


def _mirror(data_dir: Path, mine: list[SnapshotFile], cache: ObjectCache) -> None:
    """data_dir holds exactly the node's files, each linked to its cached object; anything else is removed."""
    wanted = {file.key for file in mine}
    for file in mine:
        target = data_dir / file.key
        source = cache.path(file.checksum)
        if target.is_file() and os.path.samefile(source, target):
            continue
        link_into(source, target)
    for directory, subdirs, names in os.walk(data_dir, topdown=False):
        for name in names:
            path = Path(directory) / name
            if path.relative_to(data_dir).as_posix() not in wanted:
                path.unlink()
        for name in subdirs:
            path = Path(directory) / name
            if not any(path.iterdir()):
                path.rmdir()


def _write_files_list(path: Path, mine: list[SnapshotFile]) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text("".join(f"{file.key}\n" for file in mine))
    os.replace(temp, path)


class _Fetched:
    """Bytes and files fetched so far, for one progress line across both kinds of fetch."""

    def __init__(self, files: list[SnapshotFile], progress: Callable[[Progress], None] | None) -> None:
        self.bytes_total, self.files_total = sum(f.size for f in files), len(files)
        self.bytes = self.files = 0
        self.started = time.monotonic()
        self._progress = progress
        self._throttle = Throttle(TICK_S)
        self._lock = threading.Lock()

    def add(self, size: int) -> None:
        with self._lock:
            self.bytes += size
            self.files += 1
        if self._throttle.ready():
            self.report(0, 0)

    def report(self, extra_bytes: int, extra_files: int) -> None:
        if self._progress is not None:
            self._progress(Progress(self.bytes + extra_bytes, self.bytes_total, self.files + extra_files,
                                    self.files_total, time.monotonic() - self.started))


def _fetch_small_one(store: ObjectStore, snapshot: DatasetSnapshot, file: SnapshotFile, cache: ObjectCache) -> None:
    """One GET, checked in memory against the snapshot, straight into the cache."""
    data = call_with_retries(lambda: store.get_bytes(file.key), f"GET {store.url_for(file.key)}")
    digest = hasher(file.checksum)
    digest.update(data)
    algorithm = file.checksum.partition(":")[0]
    if len(data) != file.size or f"{algorithm}:{digest.hexdigest()}" != file.checksum:
        raise _changed_during_staging(snapshot, file, "size" if len(data) != file.size else algorithm)
    landed = cache.incoming / file.key
    landed.parent.mkdir(parents=True, exist_ok=True)
    landed.write_bytes(data)
    cache.adopt(landed, file.checksum)


def _fetch_small(store: ObjectStore, snapshot: DatasetSnapshot, files: list[SnapshotFile], cache: ObjectCache,
                 workers: int, fetched: _Fetched, on_done: Callable[[SnapshotFile], None] | None = None) -> None:
    """Objects of at most one part, one GET each (the transfer engine would first HEAD every object whose sha256 it
    is not given: twice the requests)."""
    def fetch(file: SnapshotFile) -> None:
        _fetch_small_one(store, snapshot, file, cache)
        fetched.add(file.size)
        if on_done is not None:
            on_done(file)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(fetch, files))


def _fetch_large(store: ObjectStore, snapshot: DatasetSnapshot, large: list[SnapshotFile], cache: ObjectCache,
                 workers: int, progress: Callable[[Progress], None] | None) -> None:
    """Objects of more than one part, through the transfer engine's parallel parts, then adopted into the cache."""
    try:
        download(store, [_spec(file) for file in large], cache.incoming, DEFAULT_CONFIG.but(workers=workers),
                 progress=progress, state_dir=cache.root / "transfers")
    except ChecksumMismatch as exc:
        raise DatasetError(f"{exc}: the object changed after the run was planned: restore it, or start a new run "
                           "(a new run id)") from None

    def adopt(file: SnapshotFile) -> None:
        landed = cache.incoming / file.key
        if not file.checksum.startswith("sha256:") and not file_matches(landed, file.checksum):
            landed.unlink()
            raise _changed_during_staging(snapshot, file, file.checksum.partition(":")[0])
        cache.adopt(landed, file.checksum)

    with ThreadPoolExecutor(max_workers=_VERIFY_THREADS) as pool:
        list(pool.map(adopt, large))


def stage(snapshot: DatasetSnapshot, mine: list[SnapshotFile], data_dir: Path, cache: ObjectCache, *,
          run: str, workers: int, progress: Callable[[Progress], None] | None = None,
          what: str = DATASET, exchange: Exchange | None = None) -> dict[str, object]:
    """Make data_dir the mirror of the node's files; returns the `staged` event's fields. With an exchange
    (fan-out), the node fetches only its share from the store and the rest from its peers."""
    started = time.monotonic()
    store = open_store(snapshot.url)
    check_unchanged(snapshot, store, run, keys={file.key for file in mine}, what=what)

    def verified_in_cache(file: SnapshotFile) -> bool:
        if cache.lookup(file.checksum, file.size) is not None:
            return True
        # Resume: a file an interrupted stage fetched completely is adopted once its checksum matches.
        landed = cache.incoming / file.key
        if landed.is_file() and landed.stat().st_size == file.size and file_matches(landed, file.checksum):
            cache.adopt(landed, file.checksum)
            return True
        return False

    with ThreadPoolExecutor(max_workers=_VERIFY_THREADS) as pool:
        cached = list(pool.map(verified_in_cache, mine))
    # The same bytes under two keys are fetched once.
    fetch = list({file.checksum: file for file, hit in zip(mine, cached, strict=True) if not hit}.values())
    cache.make_room(sum(file.size for file in fetch), keep={cache.name(file.checksum) for file in mine})
    fetched = _Fetched(fetch, progress)
    large = [f for f in fetch if f.size > DEFAULT_PART_SIZE]
    counts: Counts | None = None
    if exchange is None:
        _fetch_small(store, snapshot, [f for f in fetch if f.size <= DEFAULT_PART_SIZE], cache, workers, fetched)
        _fetch_large(store, snapshot, large, cache, workers, lambda p: fetched.report(p.bytes_done, p.files_done))
    else:
        counts = exchange.run(mine, fetch, store, lambda own: _fetch_own(store, snapshot, own, cache, workers,
                                                                         fetched, exchange.publish),
                              lambda source, file, key: _fetch_one(
                                  source, snapshot, _as_snapshot_file(file, key), cache,
                                  workers if source is store else exchange.peer_workers(workers), fetched))
    fetch_s = time.monotonic() - fetched.started
    if exchange is None:
        fetched.report(sum(f.size for f in large), len(large))
    # Nothing above is trusted after a crash until it is on disk: one flush for every file, before the index.
    os.sync()
    cache.save()
    _mirror(data_dir, mine, cache)
    moved = sum(file.size for file in fetch)
    total = sum(file.size for file in mine)
    return {"files": len(mine), "bytes": moved, "skipped_files": len(mine) - len(fetch), "skipped_bytes": total - moved,
            "node_bytes": total, "seconds": round(time.monotonic() - started, 3),
            "mb_per_s": round(moved / 1e6 / fetch_s, 1) if fetch and fetch_s > 0 else 0.0,
            # Where the fetched bytes came from: the store, or (fan-out) the peers; fallbacks are store bytes too.
            "store_bytes": counts.store_bytes if counts is not None else moved,
            "peer_bytes": counts.peer_bytes if counts is not None else 0,
            "fallback_files": counts.fallback_files if counts is not None else 0}


def _fetch_one(store: ObjectStore, snapshot: DatasetSnapshot, file: SnapshotFile, cache: ObjectCache, workers: int,
               fetched: _Fetched) -> None:
    """One file from store (the snapshot's, or a peer's) into the cache, verified against the snapshot."""
    if file.size <= DEFAULT_PART_SIZE:
        _fetch_small_one(store, snapshot, file, cache)
    else:
        _fetch_large(store, snapshot, [file], cache, workers, None)
    fetched.add(file.size)


def _as_snapshot_file(file: Piece, key: str) -> SnapshotFile:
    """The exchange hands back the snapshot's own file, under the key it is read by (a peer's share name)."""
    assert isinstance(file, SnapshotFile), "staging exchanges a snapshot's files"
    return file if file.key == key else file.model_copy(update={"key": key})


def _fetch_own(store: ObjectStore, snapshot: DatasetSnapshot, own: list[SnapshotFile], cache: ObjectCache,
               workers: int, fetched: _Fetched, publish: Callable[[SnapshotFile], None]) -> None:
    """A node's fan-out share from the store, each file published to its peers as soon as it is verified: the
    small ones in parallel, then the large ones one by one (each in parallel parts), each next one starting once the
    previous one's bytes are all in, while that one is flushed and checked: the store's link does not idle at each
    file's end (every node would idle at once: equal shares keep them in step)."""
    _fetch_small(store, snapshot, [f for f in own if f.size <= DEFAULT_PART_SIZE], cache, workers, fetched, publish)
    large = [file for file in own if file.size > DEFAULT_PART_SIZE]
    received = [threading.Event() for _ in large]
    failed = threading.Event()

    def one(index: int) -> None:
        if index:
            received[index - 1].wait()
        if failed.is_set():
            received[index].set()
            return

        def progress(done: Progress) -> None:
            if done.bytes_done >= done.bytes_total:
                received[index].set()

        try:
            _fetch_large(store, snapshot, [large[index]], cache, workers, progress)
        except BaseException:
            failed.set()
            raise
        finally:
            received[index].set()
        fetched.add(large[index].size)
        publish(large[index])

    with ThreadPoolExecutor(max_workers=2) as pool:  # one file finishing, the next one arriving
        list(pool.map(one, range(len(large))))


def _exchange(request: StageRequest, cache: ObjectCache) -> Exchange | None:
    """A fresh exchange per snapshot (its own counts), when fanning out."""
    if request.peers is None:
        return None
    share_dir = Path(request.peers.share_dir)
    share_dir.mkdir(parents=True, exist_ok=True)
    return Exchange(request.rank, request.peers.urls, share_dir, lambda file: cache.path(file.checksum),
                    wait_s=request.peers.wait_s, connect_grace_s=request.peers.connect_grace_s,
                    holders=request.holders, command=NodeCommand.STAGE)


def _reporter(throttle: Throttle, what: str) -> Callable[[Progress], None]:
    def report(progress: Progress) -> None:
        if throttle.ready() or progress.bytes_done == progress.bytes_total:
            emit(NodeEvent.PROGRESS, what=what, bytes_done=progress.bytes_done, bytes_total=progress.bytes_total,
                 files_done=progress.files_done, files_total=progress.files_total,
                 mb_per_s=round(progress.mb_per_s, 1), eta_s=round(progress.eta_s, 1))

    return report


def _stage_all(request: StageRequest, cache: ObjectCache) -> None:
    """The dataset (when the request names one), then each input, each with its own `staged` event."""
    throttle = Throttle(request.progress_interval)
    if request.snapshot is not None and request.dest is not None:
        snapshot = read_snapshot(request.snapshot)
        mine = assign(snapshot.files, request.shard, request.nodes)[request.rank]
        dest = Path(request.dest)
        dest.mkdir(parents=True, exist_ok=True)
        # split: each node holds its own files, nothing to exchange.
        staged = stage(snapshot, mine, dest, cache, run=request.run, workers=request.workers,
                       progress=_reporter(throttle, DATASET),
                       exchange=_exchange(request, cache) if request.shard == "replicate" else None)
        _write_files_list(Path(request.workdir) / FILES_LIST, mine)
        emit(NodeEvent.STAGED, **staged)
    for name, url in request.inputs.items():
        what = f"inputs.{name}"
        snapshot = read_snapshot(url)
        dest = Path(request.inputs_dir or "") / name
        dest.mkdir(parents=True, exist_ok=True)
        staged = stage(snapshot, list(snapshot.files), dest, cache, run=request.run, workers=request.workers,
                       progress=_reporter(throttle, what), what=what, exchange=_exchange(request, cache))
        emit(NodeEvent.INPUT_STAGED, name=name, **staged)


def main(request: NodeRequest) -> int:
    staging = as_request(request, StageRequest)
    try:
        with _open_cache(Path(staging.cache), Path(staging.workdir)) as cache:
            _stage_all(staging, cache)
    except (DatasetError, StorageError) as exc:
        return fail(str(exc))
    return 0
