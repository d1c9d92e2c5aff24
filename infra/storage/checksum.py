"""sha256 of local files: whole files, files written in parts in any order, and a cache of verified files.

Staged datasets and checkpoints are verified against their manifest's sha256; the cache lets a rerun
trust a file it verified before (same size and mtime) instead of hashing gigabytes again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from infra.storage.local import write_all, write_atomically

log = logging.getLogger(__name__)

_CHUNK = 4 << 20  # large reads: fewer syscalls and hash calls per byte
CACHE_NAME = ".trainpipe-verified.json"
_CACHE_VERSION = 1


def sha256_file(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


class PrefixHasher:
    """sha256 of a file of known size whose parts are written in any order, by any thread.

    Each part reports itself once it is on disk; the contiguous prefix is hashed as soon as it grows,
    reading it back through fd (from the page cache: the bytes were just written or read), so no part
    is held in memory waiting for its predecessors.
    """

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self.size = size
        self._hash = hashlib.sha256()
        self._hashed_to = 0
        self._done: dict[int, int] = {}  # offset -> length of parts written beyond the hashed prefix
        self._hashing = False
        self._lock = threading.Lock()

    def part_done(self, offset: int, length: int, data: bytes | memoryview | None = None) -> bool:
        """Record a written part; True exactly once: for the call after which the whole file is hashed.

        data, the part's bytes, lets the part that extends the prefix be hashed without reading it back.
        """
        with self._lock:
            direct = data is not None and not self._hashing and offset == self._hashed_to
            if not direct:
                self._done[offset] = length
                if self._hashing:
                    return False  # the thread hashing now will pick this part up
            self._hashing = True
        if direct:
            self._hash.update(data)  # type: ignore[arg-type] - direct implies data is not None
            with self._lock:
                self._hashed_to = offset + length
                if self._hashed_to == self.size:
                    self._hashing = False
                    return True
        while True:
            with self._lock:
                start = end = self._hashed_to
                while end in self._done:
                    end += self._done.pop(end)
                if end == start:
                    self._hashing = False
                    return False
            self._hash_range(start, end)
            with self._lock:
                self._hashed_to = end
                if end == self.size:
                    self._hashing = False
                    return True

    def _hash_range(self, start: int, end: int) -> None:
        position = start
        while position < end:
            chunk = os.pread(self._fd, min(_CHUNK, end - position), position)
            if not chunk:
                raise OSError(f"file shrank while hashing: expected {end} bytes, found {position}")
            self._hash.update(chunk)
            position += len(chunk)

    def hexdigest(self) -> str:
        if self._hashed_to != self.size:
            raise RuntimeError(f"hashed {self._hashed_to} of {self.size} bytes: every part must be done first")
        return self._hash.hexdigest()


@dataclass(frozen=True)
class Verified:
    size: int
    mtime_ns: int
    sha256: str
    etag: str | None = None  # the source object's etag, to trust the file when no sha256 is expected


class VerifiedCache:
    """rel path -> what a file was when it was last verified, kept as CACHE_NAME in its directory.

    An entry is trusted only while the file keeps that size and mtime_ns: any rewrite changes them.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / CACHE_NAME
        self._entries = self._load()
        self._changed = False
        self._lock = threading.Lock()

    def _load(self) -> dict[str, Verified]:
        try:
            raw = json.loads(self.path.read_text())
            if raw.get("version") != _CACHE_VERSION:
                raise ValueError(f"version {raw.get('version')!r}, expected {_CACHE_VERSION}")
            return {rel: Verified(**fields) for rel, fields in raw["files"].items()}
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            # Only a cache: losing it costs one re-hash of each file, so start over rather than fail the job.
            log.warning("%s is unreadable (%s): ignoring it; files will be verified again", self.path, exc)
            return {}

    def lookup(self, rel: str, st: os.stat_result) -> Verified | None:
        with self._lock:
            entry = self._entries.get(rel)
        if entry is None or entry.size != st.st_size or entry.mtime_ns != st.st_mtime_ns:
            return None
        return entry

    def record(self, rel: str, st: os.stat_result, sha256: str, etag: str | None) -> None:
        with self._lock:
            self._entries[rel] = Verified(st.st_size, st.st_mtime_ns, sha256, etag)
            self._changed = True

    def save(self) -> None:
        """Write the cache atomically, dropping entries whose file is gone; a no-op when nothing changed."""
        with self._lock:
            if not self._changed:
                return
            entries = {rel: asdict(entry) for rel, entry in sorted(self._entries.items())}
            self._changed = False
        entries = {rel: fields for rel, fields in entries.items() if (self.directory / rel).is_file()}
        payload = json.dumps({"version": _CACHE_VERSION, "files": entries}, indent=0).encode()
        write_atomically(self.path, lambda fd: write_all(fd, payload))
