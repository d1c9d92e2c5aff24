"""`probe`: can this node run the job? Reachable, dirs writable, enough free disk, a free port for rendezvous."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from infra.dataset.stagecache import cached_bytes
from infra.node.events import NodeEvent, emit
from infra.node.ports import free_port
from infra.node.protocol import NodeRequest, ProbeRequest, as_request


def check_dir(path: Path) -> tuple[int, str | None]:
    """Free bytes, and the problem if the dir cannot be written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-") as handle:
            handle.write(b"ok")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        return 0, f"{path}: not writable ({exc.strerror}): fix its permissions or mount"
    return shutil.disk_usage(path).free, None


def main(request: NodeRequest) -> int:
    probe = as_request(request, ProbeRequest)
    problems = []
    free = {}
    for path in map(Path, probe.dirs):
        free[str(path)], problem = check_dir(path)
        if problem:
            problems.append(problem)
    if probe.dirs and not problems:
        # Cached dataset objects are either this run's (reused, no new space) or evictable.
        first = str(Path(probe.dirs[0]))
        available = free[first] + cached_bytes(Path(probe.cache) if probe.cache else None)
        if available < probe.need_bytes:
            held = ("this node's share of the dataset needs" if probe.budget is None
                    else f"this node's disk budget ({probe.budget}) needs")
            problems.append(f"{first}: {available / 1e9:.2f} GB free, {held} {probe.need_bytes / 1e9:.2f} GB: free "
                            "space, use dataset.shard: split, or nodes with larger local disks")
    emit(NodeEvent.PROBE, host=socket.gethostname(), python=sys.version.split()[0], platform=platform.platform(),
         cpus=os.cpu_count(), free_bytes=free, free_port=free_port(), problems=problems)
    return 1 if problems else 0
