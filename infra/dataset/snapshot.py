"""The run's dataset snapshot: the selected objects of dataset.url as they were at plan, kept beside the run's
checkpoints (<checkpoints.url>/<run-id>/_dataset/snapshot.json), so every recovery and every rerun of the run id
stages exactly these bytes. An object that changed or vanished since is an error naming it, never mixed data.

Each of the job's inputs (base weights, a tokenizer, an eval set) is any prefix too, and gets a snapshot of its own
the same way (<checkpoints.url>/<run-id>/_inputs/<name>/snapshot.json); `what` names the config section (dataset,
inputs.<name>) in every error.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from pydantic import Field, ValidationError

from infra.dataset.checksums import object_checksum
from infra.dataset.errors import DatasetError
from infra.dataset.listing import Listed, list_prefix
from infra.storage import open_store
from infra.storage.base import ObjectNotFound, ObjectStore
from infra.strict_model import StrictModel

log = logging.getLogger(__name__)

SNAPSHOT_KEY = "_dataset/snapshot.json"
DATASET = "dataset"  # the config section a snapshot is of, as errors name it
SNAPSHOT_FORMAT = "trainpipe-dataset-snapshot-v1"
_CHECKSUM_THREADS = 8
_SHOWN = 3  # changed objects named in one error line


class SnapshotFile(StrictModel):
    key: str = Field(description="Relative to the snapshot's url; also the file's path under the node's data dir.")
    size: int = Field(ge=0)
    etag: str | None = Field(description="The store's version of the object when the snapshot was taken.")
    checksum: str = Field(pattern=r"^(md5|crc32c|sha256):[0-9a-f]+$")
    computed: bool = Field(False, description="The store keeps no checksum: trainpipe read the object once at plan.")


class DatasetSnapshot(StrictModel):
    format: Literal["trainpipe-dataset-snapshot-v1"] = SNAPSHOT_FORMAT
    url: str
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    taken_at: float
    files: tuple[SnapshotFile, ...] = Field(min_length=1)
    # An input named by a model alias (model@alias): the alias, resolved to url at the run's first attempt. Every
    # later attempt keeps url, wherever the alias points by then.
    ref: str | None = None

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file_url(self, file: SnapshotFile) -> str:
        return f"{self.url}/{file.key}"


def snapshot_digest(snapshot: DatasetSnapshot) -> str:
    """sha256 of what a snapshot holds (each file's key, size and checksum): equal digests, equal bytes."""
    listing = json.dumps([file.model_dump(mode="json") for file in snapshot.files], sort_keys=True)
    return hashlib.sha256(listing.encode()).hexdigest()


def input_snapshot_key(name: str) -> str:
    """Where the snapshot of input `name` lives under the run's checkpoint root."""
    return f"_inputs/{name}/snapshot.json"


def snapshot_url(checkpoint_url: str, key: str = SNAPSHOT_KEY) -> str:
    """Where a run's snapshot lives, given the run's checkpoint root (<checkpoints.url>/<run-id>)."""
    return f"{checkpoint_url}/{key}"


def select(listing: Sequence[Listed], url: str, include: Sequence[str], exclude: Sequence[str],
           what: str = DATASET) -> list[Listed]:
    """The objects the globs select; a prefix with nothing in it, an include glob that matches nothing, or a
    selection left empty are each an error naming what to fix."""
    if not listing:
        raise DatasetError(f"{what}.url {url}: no objects under this prefix: upload the files or fix the URL")
    for glob in include:
        if not any(fnmatch.fnmatchcase(item.key, glob) for item in listing):
            raise DatasetError(f"{what}.include '{glob}' matches none of the {len(listing)} objects under {url}: "
                               f"fix the glob (it is matched against keys relative to {what}.url)")
    chosen = [item for item in listing
              if (not include or any(fnmatch.fnmatchcase(item.key, glob) for glob in include))
              and not any(fnmatch.fnmatchcase(item.key, glob) for glob in exclude)]
    if not chosen:
        raise DatasetError(f"{what}.exclude leaves none of the {len(listing)} objects under {url}: "
                           "narrow the exclude globs")
    return chosen


# Checksums trainpipe computed, by (object URL, size, etag, algorithm): planning twice in one process (the CLI checks
# the plan before the flow plans again) reads each object once.
_computed: dict[tuple[str, int, str | None, str], str] = {}
_computed_lock = threading.Lock()


def computed_checksum(store: ObjectStore, key: str, size: int, etag: str | None, algorithm: str = "sha256") -> str:
    """"<algorithm>:<hex>" of an object, read once per process for each version (etag) of it."""
    memo_key = (store.url_for(key), size, etag, algorithm)
    with _computed_lock:
        known = _computed.get(memo_key)
    if known is None:
        known = object_checksum(store, key, size, algorithm)
        with _computed_lock:
            _computed[memo_key] = known
    return known


def _checksum(store: ObjectStore, item: Listed) -> tuple[str, bool]:
    if item.checksum is not None:
        return item.checksum, False
    return computed_checksum(store, item.key, item.size, item.etag), True


def take_snapshot(store: ObjectStore, include: Sequence[str] = (), exclude: Sequence[str] = (),
                  what: str = DATASET) -> DatasetSnapshot:
    """List the store's root, select, and give every file a checksum (computed once where the store has none)."""
    chosen = select(list_prefix(store), store.url, include, exclude, what)
    with ThreadPoolExecutor(max_workers=_CHECKSUM_THREADS) as pool:
        checksums = list(pool.map(lambda item: _checksum(store, item), chosen))
    computed = sum(1 for _, was_computed in checksums if was_computed)
    if computed:
        log.info("%s: computed sha256 of %d objects the store keeps no checksum for", store.url, computed)
    files = tuple(SnapshotFile(key=item.key, size=item.size, etag=item.etag, checksum=checksum, computed=was)
                  for item, (checksum, was) in zip(chosen, checksums, strict=True))
    return DatasetSnapshot(url=store.url, include=tuple(include), exclude=tuple(exclude), taken_at=time.time(),
                           files=files)


def changes_since(snapshot: DatasetSnapshot, listing: Sequence[Listed], keys: set[str] | None = None) -> list[str]:
    """One phrase per snapshot file (among keys, when given) that vanished or changed in the listing."""
    now = {item.key: item for item in listing}
    problems = []
    for file in snapshot.files:
        if keys is not None and file.key not in keys:
            continue
        item = now.get(file.key)
        if item is None:
            problems.append(f"{snapshot.file_url(file)} vanished")
        elif item.size != file.size or item.etag != file.etag:
            size = f"{file.size} -> {item.size} bytes" if item.size != file.size else f"etag {file.etag} -> {item.etag}"
            problems.append(f"{snapshot.file_url(file)} changed ({size})")
    return problems


def unchanged_error(problems: Sequence[str], run: str, what: str = DATASET) -> DatasetError:
    more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
    return DatasetError(f"{what} changed since {run}'s snapshot: {'; '.join(problems[:_SHOWN])}{more}: restore the "
                        "objects, or start a new run (a new run id) to train on the data as it is now")


def check_unchanged(snapshot: DatasetSnapshot, store: ObjectStore, run: str, keys: set[str] | None = None,
                    what: str = DATASET) -> None:
    """Raise DatasetError naming the first objects of the snapshot that vanished or changed since it was taken."""
    problems = changes_since(snapshot, list_prefix(store), keys)
    if problems:
        raise unchanged_error(problems, run, what)


def _read(store: ObjectStore, key: str) -> DatasetSnapshot | None:
    try:
        raw = store.get_bytes(key)
    except ObjectNotFound:
        return None
    try:
        return DatasetSnapshot.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as exc:
        reason = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else "not valid JSON"
        raise DatasetError(f"{store.url_for(key)}: unreadable dataset snapshot ({reason}): delete it to snapshot the "
                           "dataset again, or use a new run id") from None


def load_snapshot(store: ObjectStore, key: str = SNAPSHOT_KEY) -> DatasetSnapshot | None:
    """The snapshot kept in a run's checkpoint store, None when the run has none yet."""
    return _read(store, key)


def read_snapshot(url: str) -> DatasetSnapshot:
    """The snapshot at url (what a node reads); its absence is an error."""
    parent, _, name = url.rpartition("/")
    snapshot = _read(open_store(parent), name)
    if snapshot is None:
        raise DatasetError(f"{url}: no dataset snapshot: plan the run first (trainpipe run)")
    return snapshot


def save_snapshot(store: ObjectStore, snapshot: DatasetSnapshot, key: str = SNAPSHOT_KEY) -> str:
    store.put_bytes(key, snapshot.model_dump_json(indent=1).encode())
    return store.url_for(key)


def matches_config(snapshot: DatasetSnapshot, url: str, include: Sequence[str], exclude: Sequence[str],
                   what: str = DATASET) -> str | None:
    """What differs between a run's snapshot and the dataset config it is planned with again, if anything."""
    for name, frozen, now in (("url", snapshot.url, url), ("include", snapshot.include, tuple(include)),
                              ("exclude", snapshot.exclude, tuple(exclude))):
        if frozen != now:
            return f"{what}.{name} is {list(now) if name != 'url' else now} but the run's snapshot was taken with " \
                   f"{list(frozen) if name != 'url' else frozen}"
    return None
