"""What a training script may use of trainpipe: nothing but the standard library, so it can be vendored as is.

    from trainpipe_sdk import mark_complete, log_metrics, checkpoint_dir, resume_from, data_dir

mark_complete(path) tells the checkpoint syncer (checkpoints.format marker, or auto) that a checkpoint file or
folder is whole; log_metrics appends one line to TRAINPIPE_METRICS_FILE (progress bars, the loss curve, the report
and chaos `at_step` read it). Call both from global rank 0 only (log_metrics ignores other ranks); for folders
written by every node, call mark_complete on every node's local rank 0 once that node's part is written.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

MARKER_SUFFIX = ".complete"


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def data_dir() -> Path | None:
    """The staged dataset on this node (TRAINPIPE_DATA_DIR), or None outside trainpipe."""
    return _env_path("TRAINPIPE_DATA_DIR")


def checkpoint_dir() -> Path | None:
    """Where to write checkpoints on this node (TRAINPIPE_CHECKPOINT_DIR), or None outside trainpipe."""
    return _env_path("TRAINPIPE_CHECKPOINT_DIR")


def resume_from() -> Path | None:
    """The checkpoint restored onto this node to resume from, or None on a fresh start."""
    return _env_path("TRAINPIPE_RESUME_FROM")


def mark_complete(path: str | os.PathLike[str]) -> Path:
    """Mark a checkpoint file or folder complete: writes `<path>.complete` atomically, after fsyncing the path."""
    target = Path(path)
    if not target.exists():
        raise FileNotFoundError(f"{target}: nothing to mark complete: write the checkpoint first")
    files = [p for p in ([target] if target.is_file() else sorted(target.rglob("*"))) if p.is_file()]
    for file in files:
        descriptor = os.open(file, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    marker = target.with_name(target.name + MARKER_SUFFIX)
    temp = target.with_name(f".{target.name}{MARKER_SUFFIX}.tmp-{os.getpid()}")
    temp.write_text(json.dumps({"time": time.time(), "files": len(files)}))
    os.replace(temp, marker)
    return marker


def log_metrics(step: int, loss: float | None = None, **values: Any) -> None:
    """Append {"step": step, "loss": loss, ...} to TRAINPIPE_METRICS_FILE (a no-op off rank 0 or outside trainpipe)."""
    path = _env_path("TRAINPIPE_METRICS_FILE")
    if path is None or os.environ.get("RANK", "0") != "0":
        return
    record: dict[str, Any] = {"step": int(step), **({"loss": float(loss)} if loss is not None else {}), **values}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
