"""Job config validation: every bad value fails at load time with one line naming the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.job.spec import ConfigError, load_job, parse_job

REPO = Path(__file__).resolve().parent.parent


def base() -> dict:
    return {"dataset": {"url": "file:///data/ds"}, "checkpoints": {"url": "s3://bucket/ckpt"},
            "training": {"command": ["train.py"]}}


def error_for(config: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_job(config, source="job.yaml")
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_example_config_loads() -> None:
    job = load_job(REPO / "examples" / "local.yaml")
    assert job.cluster.provider == "local" and job.cluster.nodes == 2
    assert job.dataset.url.startswith("file:///") and job.dataset.url.endswith(".trainpipe/datasets/markov-v256")


# ssh.yaml names key files on the user's machine: test_ssh_provider loads it with keys in place.
@pytest.mark.parametrize("config", sorted(p for p in (REPO / "examples").rglob("*.yaml") if p.name != "ssh.yaml"),
                         ids=lambda p: str(p.relative_to(REPO / "examples")))
def test_every_example_config_loads(config: Path) -> None:
    load_job(config)


def test_every_deployments_job_parameter_is_a_valid_job() -> None:
    """prefect.yaml's job parameters reach the server's schema check only when a deployment is served: check here."""
    import yaml

    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    jobs = [(d["name"], d["parameters"]["job"]) for d in deployments if "job" in (d.get("parameters") or {})]
    assert jobs, "prefect.yaml has no deployment with a job parameter"
    for name, job in jobs:
        parse_job(job, source=f"prefect.yaml deployment {name}")


def test_defaults_and_normalised_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    job = parse_job({"dataset": {"url": "data/ds/"}, "checkpoints": {"url": "gs://b/ckpt/"},
                     "training": {"code": "./project", "command": ["train.py", "--out", "{checkpoint_dir}"]}})
    assert job.dataset.url == f"file://{tmp_path}/data/ds"
    assert job.checkpoints.url == "gs://b/ckpt"
    assert job.checkpoints.format == "auto"
    assert job.training.code == str(tmp_path / "project")
    assert job.training.setup == () and job.training.env == {}


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (("cluster", "provider"), "azure-ish", "job.yaml: cluster.provider: unknown provider 'azure-ish': use one of"),
        (("cluster", "nodes"), 0, "job.yaml: cluster.nodes: Input should be greater than or equal to 1 (got 0)"),
        (("dataset", "url"), "ftp://host/ds", "dataset.url: unknown scheme 'ftp://': use one of file://, s3://, gs://"),
        (("training", "timeout_s"), -5, "training.timeout_s"),
        (("training", "command"), [], "training.command: Tuple should have at least 1 item"),
        (("training", "command"), ["t.py", "{bogus}"], "training.command: command[1] '{bogus}': unknown placeholder"),
        (("training", "code"), "s3://b/code.zip", "training.code: code URL s3://b/code.zip is not a .tar.gz"),
        (("training", "env"), {"TRAINPIPE_RUN_ID": "x"}, "training.env: env TRAINPIPE_RUN_ID: TRAINPIPE_* variables"),
        (("checkpoints", "format"), "keras", "checkpoints.format: Input should be 'auto', 'dcp', 'hf'"),
        (("name",), "Bad Name", "name: String should match pattern"),
        (("dataset", "validation"), "some", "dataset.validation: unknown validation 'some'"),
        (("checkpoints", "store_outage_s"), 1, "checkpoints.store_outage_s: Input should be greater than or equal"),
        (("checkpoints", "store_outage_s"), 7200, "checkpoints.store_outage_s 7200: must be below training.timeout_s"),
        (("checkpoints", "final_upload_timeout_s"), 0, "checkpoints.final_upload_timeout_s: Input should be greater"),
        (("training", "exit_grace_s"), -1, "training.exit_grace_s: Input should be greater than or equal to 0"),
        (("training", "exit_grace_s"), 3600, "training: exit_grace_s 3600: must be below timeout_s 3600"),
    ],
)
def test_bad_values_name_field_and_fix(path: tuple[str, ...], value: object, expected: str) -> None:
    config = base()
    target = config
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    assert expected in error_for(config)


def test_missing_and_unknown_fields() -> None:
    assert error_for({"dataset": {"url": "x"}, "training": {"command": ["t.py"]}}) == (
        "job.yaml: checkpoints: missing: add 'checkpoints:' to the config")
    config = base() | {"clutser": {}}
    assert "clutser: unknown field: remove it or check its spelling" in error_for(config)


def test_load_job_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_job(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("cluster: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job(broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_job(listing)
