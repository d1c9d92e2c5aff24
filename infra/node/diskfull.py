"""A node's disk filling up mid-training, said by the checkpoint syncer (infra/node/sync.py), the sidecar that watches
the checkpoint dir anyway: a `disk-full` event naming the node, the path and the bytes free, which the orchestrator
turns into the run's failure reason (tasks/syncers.py), rather than a trainer's traceback ending in ENOSPC.

The syncer checks the free space of the checkpoint dir's filesystem every round (one statvfs): below the floor
(SyncRequest.disk_full_bytes) it is said once, and the syncer goes on (what is complete can still be uploaded and
committed: reading needs no space). A write of its own refused with ENOSPC is said the same way, and the syncer then
exits EXIT_DISK_FULL: it cannot keep its state, and a restart would fare no better. Nothing committed is touched:
committed checkpoints live in the store, and the syncer never deletes a local file.
"""

from __future__ import annotations

import errno
import shutil
from dataclasses import dataclass
from pathlib import Path

from infra.node.events import NodeEvent, emit

EXIT_DISK_FULL = 4
DISK_FULL_BYTES = 1 << 20  # free bytes below which a disk counts as full: a save that hit ENOSPC leaves about none


@dataclass(frozen=True)
class DiskFull:
    node_rank: int
    path: str
    free_bytes: int

    def line(self) -> str:
        return f"disk full: {self.path} has {self.free_bytes:,} bytes free"


def free_bytes(path: Path) -> int:
    """What can still be written on path's filesystem (path itself may not exist: a dir not made for want of space)."""
    existing = next((p for p in (path, *path.parents) if p.exists()), path)
    return shutil.disk_usage(existing).free


def is_disk_full(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


class DiskWatch:
    """The free space under one dir (the node's checkpoint dir), said once when it falls below floor_bytes."""

    def __init__(self, node_rank: int, path: Path, floor_bytes: int = DISK_FULL_BYTES) -> None:
        self.node_rank, self.path, self.floor_bytes = node_rank, path, floor_bytes
        self.said: DiskFull | None = None

    def check(self) -> DiskFull | None:
        """The report, once, when the free space is below the floor now."""
        if self.said is not None:
            return None
        free = free_bytes(self.path)
        return self._say(str(self.path), free) if free < self.floor_bytes else None

    def refused(self, exc: OSError) -> DiskFull:
        """A write refused for want of space (ENOSPC, EDQUOT), said (again if already: the path may differ)."""
        return self._say(str(exc.filename or self.path), free_bytes(self.path))

    def _say(self, path: str, free: int) -> DiskFull:
        self.said = DiskFull(self.node_rank, path, free)
        emit(NodeEvent.DISK_FULL, node_rank=self.node_rank, path=path, free_bytes=free)
        return self.said
