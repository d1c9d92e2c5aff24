"""Shared fixtures. Prefect tests share one real (ephemeral, sqlite) Prefect server for the session."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import GcsServer, S3Server, create_gcs_bucket, gcs_emulator, rclone_s3

# No telemetry from tests: the machines have no network and the tests must not try.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

REPO = Path(__file__).resolve().parent.parent
TRAINPIPE = str(Path(sys.executable).with_name("trainpipe"))


@pytest.fixture(scope="session", autouse=True)
def user_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The transfer engine's verified state (and any other user cache) goes to a temp dir, not ~/.cache."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache))
        yield cache


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


# -- object-store servers (tests/servers.py): one per session, a fresh bucket per test ------------------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with rclone_s3(tmp_path_factory.mktemp("s3") / "root") as server:
        yield server


@pytest.fixture
def s3_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """s3:// of a new, empty bucket, with the environment pointing boto3 (and s5cmd/aws) at the server."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server.make_bucket(f"bucket-{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsServer]:
    with gcs_emulator(tmp_path_factory.mktemp("gcs")) as server:
        yield server


@pytest.fixture
def gs_url(gcs_server: GcsServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """gs:// of a new, empty bucket, with STORAGE_EMULATOR_HOST pointing google-cloud-storage at the emulator."""
    for name, value in gcs_server.env().items():
        monkeypatch.setenv(name, value)
    return create_gcs_bucket(gcs_server, f"bucket-{uuid.uuid4().hex[:12]}")
