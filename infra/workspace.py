"""Where trainpipe keeps its state on the orchestrator machine: run summaries and local clusters."""

from __future__ import annotations

import os
from pathlib import Path


def workspace_dir() -> Path:
    """TRAINPIPE_HOME, else ./.trainpipe: state stays with the project a user runs it from."""
    return Path(os.environ.get("TRAINPIPE_HOME") or Path.cwd() / ".trainpipe").resolve()


def runs_dir() -> Path:
    return workspace_dir() / "runs"


def run_dir(run_id: str) -> Path:
    return runs_dir() / run_id


def local_clusters_dir() -> Path:
    return workspace_dir() / "clusters"
