"""The objects a node keeps across runs, by content: staging links them into the data dir instead of fetching again.

<root>/objects/<algorithm>-<hex> holds one verified object per checksum, read-only, hard-linked into the data dirs
that use it (so the cache costs no space beyond the data itself); <root>/index.json records each object's size and
mtime when it was verified (a file written since is hashed again, never trusted) and when it was last used (the
least recently used unlinked objects are evicted when the disk runs short). One stager at a time: the cache is
locked while staging, and a second stager on the same machine uses its own.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from infra.dataset.checksums import file_matches

log = logging.getLogger(__name__)

INDEX = "index.json"
CACHE_DIR = "dataset-cache"
_LOCK = ".lock"
_VERSION = 1


@dataclass
class _Entry:
    size: int
    mtime_ns: int
    used: float


class CacheBusy(Exception):
    """Another stager holds the cache."""


class ObjectCache:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.objects = root / "objects"
        self.incoming = root / "incoming"  # where fetched objects land before they are verified and adopted
        self.objects.mkdir(parents=True, exist_ok=True)
        self.incoming.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(root / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise CacheBusy(str(root)) from None
        self._entries = self._load()

    def close(self) -> None:
        self.save()
        os.close(self._lock_fd)

    def __enter__(self) -> ObjectCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _load(self) -> dict[str, _Entry]:
        try:
            raw = json.loads((self.root / INDEX).read_text())
            if raw.get("version") != _VERSION:
                raise ValueError(f"version {raw.get('version')!r}")
            return {name: _Entry(**fields) for name, fields in raw["objects"].items()}
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            # Only an index: without it every cached object is hashed once more before it is trusted.
            log.warning("%s is unreadable (%s): cached objects will be verified again", self.root / INDEX, exc)
            return {}

    def save(self) -> None:
        present = {name: entry for name, entry in self._entries.items() if (self.objects / name).is_file()}
        payload = json.dumps({"version": _VERSION, "objects": {n: asdict(e) for n, e in sorted(present.items())}})
        temp = self.root / f".{INDEX}.tmp"
        temp.write_text(payload)
        os.replace(temp, self.root / INDEX)

    @staticmethod
    def name(checksum: str) -> str:
        return checksum.replace(":", "-")

    def path(self, checksum: str) -> Path:
        return self.objects / self.name(checksum)

    def lookup(self, checksum: str, size: int) -> Path | None:
        """The cached object with this checksum and size, verified; None when there is none (or it was damaged)."""
        name = self.name(checksum)
        path = self.objects / name
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        entry = self._entries.get(name)
        if st.st_size != size:
            path.unlink()
            return None
        if entry is None or entry.mtime_ns != st.st_mtime_ns or entry.size != st.st_size:
            if not file_matches(path, checksum):
                log.warning("%s: modified since it was cached: fetching it again", path)
                path.unlink()
                return None
            st = path.stat()
        self._entries[name] = _Entry(st.st_size, st.st_mtime_ns, time.time())
        return path

    def adopt(self, path: Path, checksum: str) -> Path:
        """Move a verified file into the cache under its checksum (read-only: a job must not edit shared bytes)."""
        target = self.path(checksum)
        if target.exists():  # the same bytes under two keys: keep one copy
            path.unlink()
        else:
            path.chmod(0o444)
            os.replace(path, target)
        st = target.stat()
        self._entries[target.name] = _Entry(st.st_size, st.st_mtime_ns, time.time())
        return target

    def reclaimable_bytes(self) -> int:
        """Bytes of cached objects no data dir links to."""
        return sum(st.st_size for st in self._object_stats() if st.st_nlink == 1)

    def _object_stats(self) -> Iterable[os.stat_result]:
        for entry in os.scandir(self.objects):
            try:
                yield entry.stat()
            except FileNotFoundError:
                continue

    def make_room(self, need: int, keep: set[str]) -> int:
        """Evict least recently used objects that no data dir links to (and that are not in keep) until need bytes
        are free; returns the bytes evicted."""
        free = shutil.disk_usage(self.root).free
        evicted = 0
        if free >= need:
            return 0
        candidates = []
        for entry in os.scandir(self.objects):
            st = entry.stat()
            if st.st_nlink == 1 and entry.name not in keep:
                used = self._entries[entry.name].used if entry.name in self._entries else 0.0
                candidates.append((used, entry.name, st.st_size))
        for _, name, size in sorted(candidates):
            if free + evicted >= need:
                break
            (self.objects / name).unlink()
            self._entries.pop(name, None)
            evicted += size
        if evicted:
            log.info("%s: evicted %.1f MB of cached objects no run uses, to make room", self.root, evicted / 1e6)
        return evicted


def link_into(source: Path, target: Path) -> None:
    """target becomes the same file as source (a hard link; a copy across file systems)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.link")
    temp.unlink(missing_ok=True)
    try:
        os.link(source, temp)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        shutil.copy2(source, temp)
    os.replace(temp, target)


def node_cache_dir(provider: str, workdir: str) -> str:
    """Where a node keeps dataset objects across runs, on the disk of its data dir: for local and netns nodes (this
    machine's disk, <workspace>/clusters/<cluster>/node-<rank>) <workspace>/dataset-cache/node-<rank>; on an ssh
    host (<host workdir>/<cluster>) <host workdir>/dataset-cache; elsewhere in the node's workdir, which its machine
    takes along when the cluster ends."""
    path = PurePosixPath(workdir)
    if provider in ("local", "netns"):
        return str(path.parents[2] / CACHE_DIR / path.name)
    if provider == "ssh":
        return str(path.parent / CACHE_DIR)
    return str(path / CACHE_DIR)


def cached_bytes(root: Path | None) -> int:
    """Bytes of the objects in a cache (and in the per-rank caches under it, for local nodes)."""
    if root is None or not root.is_dir():
        return 0
    return sum(path.stat().st_size for path in root.glob("**/objects/*") if path.is_file())
