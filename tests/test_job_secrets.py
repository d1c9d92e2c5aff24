"""training.secrets: a job names where each secret is kept; the run resolves it when it starts a node command, and a
missing one fails plan with one line naming it and the fix."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from conftest import run_trainpipe
from jobs import job_config, make_dataset, write_config

from infra.job.plan import PlanError, plan_job
from infra.job.secrets import SecretMissing
from infra.job.spec import parse_job


def secret_job(tmp_path: Path, refs: dict[str, dict[str, str]]) -> dict:
    config = job_config(tmp_path, make_dataset(tmp_path / "dataset", tokens=20_000, shard_tokens=10_000))
    config["training"]["secrets"] = refs
    return config


def test_plan_refuses_a_job_whose_secret_is_not_set(tmp_path: Path, workspace: Path) -> None:
    config = secret_job(tmp_path, {"HF_TOKEN": {"env": "TP_TEST_NOT_SET_ANYWHERE"}})
    result = run_trainpipe("plan", str(write_config(tmp_path / "job.yaml", config)))
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "training.secrets.HF_TOKEN: environment variable TP_TEST_NOT_SET_ANYWHERE is not set" in line
    assert "export TP_TEST_NOT_SET_ANYWHERE" in line


def test_plan_passes_a_set_secret_and_shows_no_value(tmp_path: Path, workspace: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    value = "hf_" + secrets.token_urlsafe(24)
    monkeypatch.setenv("TP_TEST_HF_TOKEN", value)
    job = parse_job(secret_job(tmp_path, {"HF_TOKEN": {"env": "TP_TEST_HF_TOKEN"}}))
    assert value not in plan_job(job, "secrets-plan").render()
    assert value not in job.model_dump_json(), "a job holds the names of its secrets, never their values"


def test_prefect_secret_blocks_resolve_at_run_time_and_a_missing_one_fails_plan(
        prefect_server: None, tmp_path: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.blocks.system import Secret

    from tasks.secrets import job_secrets, read_secret_block

    value = "tok-" + secrets.token_urlsafe(24)
    Secret(value=value).save("tp-test-token", overwrite=True)
    monkeypatch.setenv("TP_TEST_DB_PASSWORD", "pw")
    job = parse_job(secret_job(tmp_path, {"TOKEN": {"prefect_secret": "tp-test-token"},
                                          "DB_PASSWORD": {"env": "TP_TEST_DB_PASSWORD"}}))
    assert job_secrets(job) == {"TOKEN": value, "DB_PASSWORD": "pw"}

    missing = parse_job(secret_job(tmp_path, {"TOKEN": {"prefect_secret": "tp-test-no-such-block"}}))
    with pytest.raises(PlanError, match=r"training.secrets.TOKEN: Prefect Secret block 'tp-test-no-such-block' is "
                                        r"not set: create it"):
        plan_job(missing, "secrets-block", secret_blocks=read_secret_block)
    with pytest.raises(SecretMissing, match="tp-test-no-such-block"):
        job_secrets(missing)


@pytest.mark.parametrize(("refs", "message"), [
    ({"A": {}}, "name exactly one place the value is kept"),
    ({"A": {"env": "X", "prefect_secret": "b"}}, "name exactly one place the value is kept"),
    ({"TRAINPIPE_A": {"env": "X"}}, "TRAINPIPE_\\* variables are set by trainpipe"),
    ({"A B": {"env": "X"}}, "not a valid environment variable name"),
])
def test_secret_refs_are_checked_with_the_config(tmp_path: Path, refs: dict, message: str) -> None:
    from infra.job.spec import ConfigError

    config = job_config(tmp_path, "file:///nowhere")
    config["training"]["secrets"] = refs
    with pytest.raises(ConfigError, match=message):
        parse_job(config)
