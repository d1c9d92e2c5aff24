"""The Azure storage account named by the job config (storage.azure_account): validated, laid over the environment
(config wins over AZURE_STORAGE_ACCOUNT, a connection string for another account is refused), checked at plan, and
reached by the orchestrator and by a node command with only the key in the environment (Azurite)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from azurite import ACCOUNT, ACCOUNT_KEY, AzuriteServer
from conftest import run_trainpipe
from test_checkpoints import commit_step, node_dirs

import tasks.checkpoint
from infra.checkpoints.store import CheckpointStore
from infra.compute.providers import get_provider
from infra.job.spec import ConfigError, JobSpec, parse_job
from infra.job.store_access import azure_account_problem
from infra.storage import StorageError, open_store
from infra.storage.azure_account import (
    JobAccount,
    account_conflict,
    connection_string_account,
    job_account_environment,
    service_client,
    use_job_account,
)

STEP = 10
OTHER_CONNECTION = "DefaultEndpointsProtocol=https;AccountName=otheracct;AccountKey=a2V5;"
AZURE_VARIABLES = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY",
                   "AZURE_STORAGE_BLOB_ENDPOINT")


def azure_job(storage: dict[str, Any] | None = None, dataset: str = "az://data/tokens",
              secrets: dict[str, Any] | None = None, provider: str = "local") -> JobSpec:
    config: dict[str, Any] = {"cluster": {"provider": provider, "nodes": 1},
                              "dataset": {"url": dataset}, "checkpoints": {"url": "file:///tmp/ckpt"},
                              "training": {"command": ["train.py"], "secrets": secrets or {}}}
    if storage is not None:
        config["storage"] = storage
    return parse_job(config)


@pytest.fixture
def job_account() -> Iterator[None]:
    """The process's job account is reset after the test, as plan would for the next run."""
    try:
        yield
    finally:
        use_job_account(None)


@pytest.mark.parametrize(("storage", "error"), [
    ({"azure_account": "ab"}, "storage.azure_account: String should match pattern"),
    ({"azure_account": "MyAccount"}, "storage.azure_account: String should match pattern"),
    ({"azure_account": "a" * 25}, "storage.azure_account: String should match pattern"),
    ({"azure_account": "my-account"}, "storage.azure_account: String should match pattern"),
    ({"azure_account": "acct1", "azure_blob_endpoint": "ftp://x/y"},
     "storage.azure_blob_endpoint: String should match pattern"),
    ({"azure_blob_endpoint": "https://acct1.blob.core.chinacloudapi.cn"},
     "storage: azure_blob_endpoint is the endpoint of storage.azure_account: name the account too"),
])
def test_a_bad_account_or_endpoint_is_a_config_error(storage: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match="^config: " + error.replace("(", r"\(")):
        azure_job(storage)


def test_the_config_names_an_account_and_its_endpoint() -> None:
    job = azure_job({"azure_account": "acct1", "azure_blob_endpoint": "http://127.0.0.1:10000/acct1"})
    assert job.storage.azure == JobAccount("acct1", "http://127.0.0.1:10000/acct1")
    assert azure_job().storage.azure is None
    assert azure_job({"azure_account": "a" * 24}).storage.azure == JobAccount("a" * 24)


def test_the_config_account_wins_over_the_environment() -> None:
    environ = {"AZURE_STORAGE_ACCOUNT": "envacct", "AZURE_STORAGE_BLOB_ENDPOINT": "https://envacct.example"}
    assert job_account_environment(JobAccount("acct1"), environ) == {
        "AZURE_STORAGE_ACCOUNT": "acct1", "AZURE_STORAGE_BLOB_ENDPOINT": "https://acct1.blob.core.windows.net"}
    # The environment's endpoint is kept for the same account, the config's wins over it.
    same = {"AZURE_STORAGE_ACCOUNT": "acct1", "AZURE_STORAGE_BLOB_ENDPOINT": "https://acct1.example"}
    assert job_account_environment(JobAccount("acct1"), same)["AZURE_STORAGE_BLOB_ENDPOINT"] == "https://acct1.example"
    assert job_account_environment(JobAccount("acct1", "https://sovereign"), same)[
        "AZURE_STORAGE_BLOB_ENDPOINT"] == "https://sovereign"
    assert job_account_environment(None, environ) == {}


def test_a_connection_string_for_another_account_conflicts() -> None:
    assert connection_string_account(OTHER_CONNECTION) == "otheracct"
    assert connection_string_account("UseDevelopmentStorage=true") == ACCOUNT
    problem = account_conflict(JobAccount("acct1"), {"AZURE_STORAGE_CONNECTION_STRING": OTHER_CONNECTION})
    assert problem is not None and "acct1" in problem and "otheracct" in problem and "unset" in problem
    same = OTHER_CONNECTION.replace("otheracct", "acct1")
    assert account_conflict(JobAccount("acct1"), {"AZURE_STORAGE_CONNECTION_STRING": same}) is None
    assert account_conflict(None, {"AZURE_STORAGE_CONNECTION_STRING": OTHER_CONNECTION}) is None


def test_plan_checks_the_account() -> None:
    no_account = azure_account_problem(azure_job(), {}, {})
    assert no_account == ("dataset.url az://data/tokens: no Azure storage account: name it in storage.azure_account, "
                          "or set AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT where trainpipe runs")
    assert azure_account_problem(azure_job({"azure_account": "acct1"}), {}, {}) is None
    assert azure_account_problem(azure_job(), {"AZURE_STORAGE_ACCOUNT": "envacct"}, {}) is None
    assert azure_account_problem(azure_job(dataset="file:///tmp/data"), {}, {}) is None
    configured = azure_job({"azure_account": "acct1"})
    in_env = azure_account_problem(configured, {"AZURE_STORAGE_CONNECTION_STRING": OTHER_CONNECTION}, {})
    assert in_env is not None and in_env.endswith("(in the environment)") and "otheracct" in in_env
    in_secrets = azure_account_problem(configured, {}, {"AZURE_STORAGE_CONNECTION_STRING": OTHER_CONNECTION})
    assert in_secrets is not None and in_secrets.endswith("(in training.secrets)")


def test_the_job_account_chooses_the_credential(monkeypatch: pytest.MonkeyPatch, job_account: None) -> None:
    from azure.identity import DefaultAzureCredential

    for name in AZURE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", "envacct")
    use_job_account(JobAccount("acct1"))
    client = service_client(30.0)
    assert client.account_name == "acct1" and isinstance(client.credential, DefaultAzureCredential)
    monkeypatch.setenv("AZURE_STORAGE_KEY", ACCOUNT_KEY)
    assert service_client(30.0).credential.account_name == "acct1"  # the key, for the config's account
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", OTHER_CONNECTION)
    with pytest.raises(StorageError, match=r"storage\.azure_account is acct1 but AZURE_STORAGE_CONNECTION_STRING"):
        service_client(30.0)


def test_plan_without_an_account_exits_2(tmp_path: Path) -> None:
    config = {"cluster": {"provider": "local", "nodes": 1}, "dataset": {"url": "az://data/tokens"},
              "checkpoints": {"url": f"file://{tmp_path}/ckpt"}, "training": {"command": ["-m", "trainer.train"]}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    env = {name: value for name, value in os.environ.items() if name not in AZURE_VARIABLES}
    result = run_trainpipe("plan", str(tmp_path / "job.yaml"), env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: dataset.url az://data/tokens: no Azure storage account: name it in storage.azure_account, or set "
        "AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT where trainpipe runs"]


def test_a_node_command_reaches_the_config_account_with_only_the_key(
        azurite_server: AzuriteServer, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        job_account: None) -> None:
    """The orchestrator commits a checkpoint and the head node's verify-ckpt reads it back, both from the account
    the config names, the environment holding only its key (and another account's name, which the config beats)."""
    container = azurite_server.make_container("configured")
    for name in AZURE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", "otheracct")
    monkeypatch.setenv("AZURE_STORAGE_KEY", ACCOUNT_KEY)
    monkeypatch.setattr(tasks.checkpoint, "get_run_logger", lambda: logging.getLogger("test.azure"))
    job = azure_job({"azure_account": ACCOUNT, "azure_blob_endpoint": azurite_server.endpoint},
                    dataset=f"{container}/data")
    use_job_account(job.storage.azure)  # as plan does
    checkpoint_url = f"{container}/ckpt/run-1"
    commit_step(CheckpointStore(open_store(checkpoint_url)), node_dirs(tmp_path / "writers"), STEP)
    provider = get_provider("local")
    cluster = provider.launch("tp-az-config", job.cluster, "run-1")
    try:
        verified = tasks.checkpoint.verify_committed_checkpoint.fn(cluster, checkpoint_url, "auto",
                                                                   secrets=job.training.secrets, storage=job.storage)
    finally:
        provider.terminate(cluster.name)
    assert verified.step == STEP
