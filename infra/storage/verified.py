"""What the transfer engine remembers about files it verified, kept OUTSIDE the directory it fills.

A download's destination receives exactly the objects it asked for. The record that lets a rerun trust a file it
verified before (same size and mtime) instead of reading it again lives in a state directory: one the caller names
(the node agent passes one under the node's workdir) or the user's cache dir ($XDG_CACHE_HOME/trainpipe/verified,
else ~/.cache/trainpipe/verified), one JSON file per destination, named by a hash of its absolute path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from infra.storage.files import write_all, write_atomically

log = logging.getLogger(__name__)

_VERSION = 2


def default_state_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "trainpipe" / "verified"


@dataclass(frozen=True)
class Verified:
    size: int
    mtime_ns: int
    checksum: str | None  # tagged (infra.storage.checksum), None when only the source's version was checked
    etag: str | None = None  # the source object's version, to trust the file when no checksum is expected


class VerifiedFiles:
    """rel path -> what a file under `destination` was when it was last verified.

    An entry is trusted only while the file keeps that size and mtime_ns: any rewrite changes them.
    """

    def __init__(self, destination: Path, state_dir: Path | None = None) -> None:
        self.destination = Path(destination).resolve()
        name = hashlib.sha256(str(self.destination).encode()).hexdigest()[:32]
        self.path = (state_dir or default_state_dir()) / f"{name}.json"
        self._entries = self._load()
        self._confirmed: set[str] = set()  # entries whose file this run saw or wrote: no need to look again
        self._changed = False
        self._lock = threading.Lock()

    def _load(self) -> dict[str, Verified]:
        try:
            raw = json.loads(self.path.read_text())
            if raw.get("version") != _VERSION or raw.get("destination") != str(self.destination):
                raise ValueError(f"version {raw.get('version')!r} of {raw.get('destination')!r}")
            return {rel: Verified(**fields) for rel, fields in raw["files"].items()}
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            # Only a cache: losing it costs one re-read of each file, so start over rather than fail the job.
            log.warning("%s is unreadable (%s): ignoring it; files will be verified again", self.path, exc)
            return {}

    def lookup(self, rel: str, st: os.stat_result) -> Verified | None:
        with self._lock:
            entry = self._entries.get(rel)
        if entry is None or entry.size != st.st_size or entry.mtime_ns != st.st_mtime_ns:
            return None
        with self._lock:
            self._confirmed.add(rel)
        return entry

    def record(self, rel: str, st: os.stat_result, checksum: str | None, etag: str | None) -> None:
        with self._lock:
            self._entries[rel] = Verified(st.st_size, st.st_mtime_ns, checksum, etag)
            self._confirmed.add(rel)
            self._changed = True

    def save(self) -> None:
        """Write the state atomically, dropping entries whose file is gone; a no-op when nothing changed."""
        with self._lock:
            if not self._changed:
                return
            entries = {rel: asdict(entry) for rel, entry in sorted(self._entries.items())}
            confirmed = set(self._confirmed)
            self._changed = False
        entries = {rel: fields for rel, fields in entries.items()
                   if rel in confirmed or os.path.isfile(os.path.join(self.destination, rel))}
        payload = json.dumps({"version": _VERSION, "destination": str(self.destination), "files": entries}).encode()
        write_atomically(self.path, lambda fd: write_all(fd, payload))
