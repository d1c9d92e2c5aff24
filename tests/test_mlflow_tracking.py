"""The tracking section against a real `mlflow server` (SQLite, local artifact root, one for this module): plan's
check of the server, the job's params with secrets out, and the tracker riding out a server that goes away.

The whole retraining nights with tracking and the registry's mirror are in test_mlflow_nights.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_trainpipe
from jobs import job_config, make_dataset, write_config
from mlflow import MlflowClient
from mlflow_server import MlflowServer, free_port, mlflow_server

from infra.job.plan import PlanError
from infra.job.spec import ConfigError, parse_job
from infra.job.tracking_spec import MlflowSpec
from infra.tracking.check import check_tracking
from infra.tracking.mlflow_run import MlflowRun, flatten, numeric_metrics
from tasks.tracking import SECRET_REFS


@pytest.fixture(scope="module")
def mlflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


def tracked(config: dict, uri: str, **mlflow: object) -> dict:
    return {**config, "tracking": {"mlflow": {"uri": uri, **mlflow}}}


def test_plan_checks_the_server_and_names_the_field(mlflow: MlflowServer, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    config = job_config(tmp_path, "file:///nowhere")
    # Experiment defaults to the job's name, created by the check (it can be written to).
    check_tracking(parse_job(tracked(config, mlflow.uri)), None)
    experiment = MlflowClient(mlflow.uri).get_experiment_by_name("e2e")
    assert experiment is not None and experiment.tags["trainpipe.job"] == "e2e"

    # A server that does not answer: one line naming the field, quickly (MLflow's own retries are off), and the
    # credential's value in no message.
    monkeypatch.setenv("MY_MLFLOW_TOKEN", "tok-s3cr3t-value")
    dead = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(PlanError) as refused:
        check_tracking(parse_job(tracked(config, dead, secrets={"MLFLOW_TRACKING_TOKEN": {"env": "MY_MLFLOW_TOKEN"}})),
                       None)
    assert time.monotonic() - started < 30
    message = str(refused.value)
    assert message.startswith(f"tracking.mlflow.uri: {dead} does not answer") and "\n" not in message
    assert "tok-s3cr3t-value" not in message

    monkeypatch.delenv("MY_MLFLOW_TOKEN")
    with pytest.raises(PlanError, match=r"^tracking\.mlflow\.secrets\.MLFLOW_TRACKING_TOKEN: environment variable "
                       r"MY_MLFLOW_TOKEN is not set"):
        check_tracking(parse_job(tracked(config, mlflow.uri,
                                         secrets={"MLFLOW_TRACKING_TOKEN": {"env": "MY_MLFLOW_TOKEN"}})), None)
    with pytest.raises(ConfigError, match=r"tracking\.mlflow\.secrets: .*secret HF_TOKEN: MLflow reads its "):
        parse_job(tracked(config, mlflow.uri, secrets={"HF_TOKEN": {"env": "X"}}))
    with pytest.raises(ConfigError, match=r"training MLFLOW_RUN_ID: tracking.mlflow gives it to every node"):
        parse_job(tracked({**config, "training": {**config["training"], "env": {"MLFLOW_RUN_ID": "x"}}}, mlflow.uri))

    # `trainpipe plan` says it in one line on stderr, exit 2, before anything else is looked at.
    dataset = make_dataset(tmp_path / "data", tokens=20_000, shard_tokens=10_000)
    path = write_config(tmp_path / "job.yaml", tracked(job_config(tmp_path, dataset), dead))
    done = run_trainpipe("plan", str(path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: tracking.mlflow.uri: {dead} does not answer")


def test_params_are_the_job_flattened_with_secrets_out(tmp_path: Path) -> None:
    config = job_config(tmp_path, "file:///data")
    config["training"]["secrets"] = {"HF_TOKEN": {"env": "HF_TOKEN"}}
    job = parse_job(tracked(config, "http://127.0.0.1:1", secrets={"MLFLOW_TRACKING_TOKEN": {"prefect_secret": "t"}}))
    params = flatten(job.model_dump(mode="json"), drop=SECRET_REFS)
    assert params["cluster.nodes"] == "2" and params["tracking.mlflow.uri"] == "http://127.0.0.1:1"
    assert params["training.command"].startswith('["-m", "trainer.train"')
    assert not [key for key in params if "secrets" in key]
    assert numeric_metrics({"step": 3, "loss": 1.5, "ok": True, "t": {"io_ms": 2}, "nan": float("nan"),
                            "name": "x"}) == {"loss": 1.5, "t.io_ms": 2.0}


def test_a_server_away_mid_run_costs_nothing_and_loses_nothing(mlflow: MlflowServer, caplog: pytest.LogCaptureFixture
                                                               ) -> None:
    """Stopped while metrics stream, started again on the same port and database: every point is in MLflow after,
    the outage said once; a rerun of the run id continues the same MLflow run; past the buffer's bound the oldest
    points are dropped and counted, never waited for."""
    spec = MlflowSpec(uri=mlflow.uri, experiment="outage")
    logger = logging.getLogger("test.tracking")
    run = MlflowRun.open(spec, "outage", "outage-run-1", {}, {"a": "1"}, {"trainpipe.provider": "local"}, logger)
    bounded = MlflowRun.open(spec.model_copy(update={"buffer": 1000}), "outage", "outage-run-2", {}, {}, {}, logger)
    for step in range(1, 301):
        run.log_metrics({"loss": 1.0 / step}, step, time.time())
    assert run.flush(30)
    mlflow.stop()
    caplog.set_level(logging.WARNING, logger="test.tracking")
    for step in range(301, 601):
        logging_started = time.monotonic()
        run.log_metrics({"loss": 1.0 / step}, step, time.time())
        assert time.monotonic() - logging_started < 0.05, "logging waited on the server"
    for step in range(1, 1501):
        bounded.log_metrics({"loss": float(step)}, step)
    assert not run.flush(1.0)  # held in the buffer while the server is away
    # Closed while the server is away: its deadline kept, what was not recorded counted and said.
    bounded_closing = time.monotonic()
    lost = bounded.close("FAILED", 3)
    assert time.monotonic() - bounded_closing < 3 + 2 * spec.send_timeout_s
    assert (lost.points_dropped, lost.points_unsent, lost.points_sent) == (500, 1000, 0), lost
    assert lost.errors[0] == ("1500 metric points not recorded in MLflow (500 dropped past the buffer's 1000, 1000 "
                              "unsent at the end)")
    assert lost.errors[1].startswith("status FAILED not recorded: tracking.mlflow.uri: ")
    mlflow.start()
    closing = time.monotonic()
    outcome = run.close("FINISHED", 60)
    print(f"figures: after a restart, close drained 300 buffered points in {time.monotonic() - closing:.2f}s")
    assert outcome.points_sent == 600 and outcome.points_dropped == outcome.points_unsent == 0, outcome
    assert outcome.unreachable_s > 0 and not outcome.errors
    said = [r.getMessage() for r in caplog.records if "metrics are buffered" in r.getMessage()]
    assert len([m for m in said if "(at most 100000 points)" in m]) == 1, f"said once a run, not per try: {said}"
    assert f"tracking.mlflow.uri: {mlflow.uri} does not answer (ConnectionError)" in said[0]

    client = MlflowClient(mlflow.uri)
    history = client.get_metric_history(run.id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 601))
    assert client.get_run(run.id).info.status == "FINISHED"
    assert client.get_run(run.id).data.params == {"a": "1"}

    again = MlflowRun.open(spec, "outage", "outage-run-1", {}, {"b": "2"}, {"trainpipe.attempts": "2"}, logger)
    assert again.id == run.id and again.outcome.continued
    assert again.close("KILLED", 30).errors == []
    assert client.get_run(run.id).info.status == "KILLED"
    assert client.get_run(run.id).data.tags["trainpipe.attempts"] == "2"
    assert client.get_run(run.id).data.params == {"a": "1"}, "params are the first attempt's: MLflow keeps them"

