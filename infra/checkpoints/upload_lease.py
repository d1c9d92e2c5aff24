"""The node-local upload lease: which checkpoint a node's syncer is uploading, named in its sync dir.

The syncer names the checkpoint it is uploading in its sync dir (TRAINPIPE_SYNC_DIR), so a trainer's local retention
that honours it (trainer.checkpoint.prune_local) leaves that step alone; without it a syncer slower than two
checkpoint intervals would see every upload deleted under it and never commit. The syncer still tolerates a
checkpoint vanishing (a framework's own retention, the race between listing and leasing), so this lease is about
progress, not safety. A lease whose process is gone (kill -9) does not count.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from infra.checkpoints.layout import CheckpointError

UPLOAD_LEASE = "uploading"


def write_lease(directory: Path, name: str, step: int) -> None:
    temp = directory / f".{name}.tmp-{os.getpid()}"
    temp.write_text(json.dumps({"step": step, "pid": os.getpid()}))
    os.replace(temp, directory / name)


def clear_lease(directory: Path, name: str) -> None:
    (directory / name).unlink(missing_ok=True)


def leased_step(directory: Path, name: str) -> int | None:
    """The step named by a live process's lease of that name in directory, or None."""
    try:
        lease = json.loads((directory / name).read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{directory / name}: corrupt lease ({exc.msg}): delete it") from None
    return int(lease["step"]) if _process_alive(int(lease["pid"])) else None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
