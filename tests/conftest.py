"""Shared fixtures. Prefect tests share one real (ephemeral, sqlite) Prefect server for the session."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# No telemetry from tests: the machines have no network and the tests must not try.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

REPO = Path(__file__).resolve().parent.parent
TRAINPIPE = str(Path(sys.executable).with_name("trainpipe"))


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An isolated TRAINPIPE_HOME, so local clusters and run summaries of one test never meet another's."""
    home = tmp_path / "home"
    monkeypatch.setenv("TRAINPIPE_HOME", str(home))
    return home
