"""Shared fixtures. Prefect tests share one real (ephemeral, sqlite) Prefect server for the session."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from azurite import AzuriteServer, azurite
from servers import GcsServer, S3Server, create_gcs_bucket, gcs_emulator, rclone_s3

# No telemetry from tests: the machines have no network and the tests must not try.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# The cloud stand-ins' nodes each have a HOME of their own: one agent environment for all of them on this machine
# (made once, under its lock), as one real node keeps it across runs, instead of one per node per test.
os.environ.setdefault("TRAINPIPE_AGENT_DIR", str(Path.home() / ".trainpipe" / "agent"))

# Container engines and the test image (tests/containers.py): session fixtures shared by every test file.
pytest_plugins = ["containers"]

REPO = Path(__file__).resolve().parent.parent
TRAINPIPE = str(Path(sys.executable).with_name("trainpipe"))
# Below pytest's own timeout (pyproject: 600 s), which kills the test without a word of what the command printed.
CLI_TIMEOUT_S = 540.0


# The slowest files first (seconds of a full run on 2 cores, 2026-12-07): under pytest-xdist (`--dist loadfile`, what
# `make test` runs) each worker takes the next file as it frees up, so the long ones start early and the short ones
# fill the end, instead of a 6-minute file starting last on one worker while the other idles.
SLOWEST_FILES = ("test_slurm_provider.py", "test_kill_matrix.py", "test_prefect_server.py", "test_azure_provider.py",
                 "test_examples.py", "test_replace_nodes.py", "test_container_runs.py", "test_pipeline_e2e.py",
                 "test_ssh_partition.py", "test_preemption.py", "test_unattended_run.py", "test_cloud_teardown.py",
                 "test_control_plane_outage.py", "test_agent_fanout.py", "test_stall.py", "test_crash_formats.py",
                 "test_retraining.py", "test_cancel.py", "test_unattended_sync.py", "test_nebius_provider.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order is kept


PREFECT_DB = "prefect.db"


@functools.cache
def _migrated_prefect_db() -> Path:
    """A Prefect database at the installed Prefect's schema, made once a session: in a fresh PREFECT_HOME every
    `trainpipe run` would have its temporary server migrate a new database first (seconds of CPU each time)."""
    home = Path(tempfile.mkdtemp(prefix="prefect-template-"))
    atexit.register(shutil.rmtree, home, True)
    env = {name: value for name, value in os.environ.items()
           if name not in ("PREFECT_API_URL", "PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_PROFILES_PATH")}
    subprocess.run([str(Path(sys.executable).with_name("prefect")), "server", "database", "upgrade", "-y"],
                   env={**env, "PREFECT_HOME": str(home)}, check=True, capture_output=True, timeout=300)
    return home / PREFECT_DB


def prefect_home(path: Path) -> str:
    """A PREFECT_HOME of a test's own for `trainpipe run` (its temporary server keeps its database there), with the
    database already migrated, as a user's is from their second run on."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_migrated_prefect_db(), path / PREFECT_DB)
    return str(path)


def run_trainpipe(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO,
                  timeout: float = CLI_TIMEOUT_S, program: str = TRAINPIPE) -> subprocess.CompletedProcess[str]:
    """The installed console script in its own process; one that hangs fails the test with what it printed."""
    try:
        return subprocess.run([program, *args], cwd=cwd, env=dict(os.environ) if env is None else env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as hung:
        # POSIX hands back what was read so far as bytes, whatever `text` said.
        output = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part
                         for part in (hung.stdout or b"", hung.stderr or b""))
        pytest.fail(f"trainpipe {' '.join(args)} still ran after {timeout:.0f} s:\n{output[-8000:]}")


def cannot_run_here(problem: str) -> NoReturn:
    """A test that needs what this machine lacks (root, a system tool) skips, saying so; in CI (CI=true) it fails
    instead, so a CI machine that lost a dependency never passes by skipping."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"cannot run in CI: {problem}")
    pytest.skip(problem)


@pytest.fixture(scope="session", autouse=True)
def user_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The transfer engine's verified state (and any other user cache) goes to a temp dir, not ~/.cache."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache))
        yield cache


@pytest.fixture(scope="session", autouse=True)
def prefect_server() -> Iterator[None]:
    """One real Prefect server for the session: the tests' own flows report to it, and so does every command they
    start (PREFECT_API_URL in the environment), since a `trainpipe run` without one starts a temporary server of its
    own (seconds of CPU per command). A test of that temporary server takes the variable out of its command's
    environment (without_prefect_api)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120), pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_API_URL", str(PREFECT_API_URL.value()))
        yield


def without_prefect_api(env: dict[str, str]) -> dict[str, str]:
    """A command's environment in which `trainpipe run` starts its own temporary Prefect server, as a user's first
    run does."""
    return {name: value for name, value in env.items() if name != "PREFECT_API_URL"}


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An isolated TRAINPIPE_HOME, so local clusters and run summaries of one test never meet another's."""
    home = tmp_path / "home"
    monkeypatch.setenv("TRAINPIPE_HOME", str(home))
    return home


# -- object-store servers (tests/servers.py): one per session, a fresh bucket per test ------------------


def _fresh_bucket(env: dict[str, str], monkeypatch: pytest.MonkeyPatch, make: Callable[[str], str],
                  prefix: str) -> str:
    """The URL of a new bucket (or container) named `prefix`-random, with the server's environment set for the SDKs."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return make(f"{prefix}-{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with rclone_s3(tmp_path_factory.mktemp("s3") / "root") as server:
        yield server


@pytest.fixture
def s3_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """s3:// of a new, empty bucket, with the environment pointing boto3 (and s5cmd/aws) at the server."""
    return _fresh_bucket(s3_server.env(), monkeypatch, s3_server.make_bucket, "bucket")


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsServer]:
    with gcs_emulator(tmp_path_factory.mktemp("gcs")) as server:
        yield server


@pytest.fixture
def gs_url(gcs_server: GcsServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """gs:// of a new, empty bucket, with STORAGE_EMULATOR_HOST pointing google-cloud-storage at the emulator."""
    return _fresh_bucket(gcs_server.env(), monkeypatch, lambda name: create_gcs_bucket(gcs_server, name), "bucket")


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteServer]:
    with azurite(tmp_path_factory.mktemp("azurite") / "data") as server:
        yield server


@pytest.fixture
def az_url(azurite_server: AzuriteServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """az:// of a new, empty container, with AZURE_STORAGE_CONNECTION_STRING pointing the SDK at Azurite."""
    return _fresh_bucket(azurite_server.env(), monkeypatch, azurite_server.make_container, "container")
