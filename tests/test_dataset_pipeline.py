"""A team's own dataset through the whole pipeline: Parquet, CSV and JSONL tables (beside the bundled trainer's
token shards) in a real S3 (`rclone serve s3`), a Great Expectations suite at plan, staged onto 2 local nodes,
the suite's table in the report; bad data and bad input stopped at plan with one line and exit 2.

Real parts only: the S3 server, the Prefect test server, local nodes with real processes, torchrun training.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from conftest import REPO, TRAINPIPE, cannot_run_here, prefect_home
from jobs import job_config, write_config
from polling import Polling
from test_cli import error_line, invoke

from infra.dataset.snapshot import SNAPSHOT_KEY
from infra.dataset.synth import synthesize
from infra.job.spec import parse_job
from infra.node.protocol import ProbeRequest
from infra.storage import ObjectStore, open_store

ROWS = 2000
SUITE: list[dict[str, Any]] = [
    {"type": "expect_column_values_to_be_between", "column": "token", "min_value": 0, "max_value": 255,
     "files": "shard-*"},
    {"type": "expect_column_values_to_be_between", "column": "age", "min_value": 0, "max_value": 120,
     "files": "tables/*"},
    {"type": "expect_column_values_to_not_be_null", "column": "email", "files": "tables/*"},
    {"type": "expect_column_values_to_be_unique", "column": "id", "files": "tables/*"},
    {"type": "expect_table_columns_to_match_set", "column_set": ["id", "age", "email"], "files": "tables/*"},
]


def people(start: int, rows: int = ROWS) -> pd.DataFrame:
    ids = range(start, start + rows)
    return pd.DataFrame({"id": list(ids), "age": [18 + i % 60 for i in ids], "email": [f"u{i}@x.org" for i in ids]})


def tables(bad: bool = False, rows: int = ROWS) -> dict[str, bytes]:
    """One table in each format; bad: out-of-range ages in the CSV and missing emails in the JSONL."""
    parquet, csv, jsonl = people(0, rows), people(rows, rows), people(2 * rows, rows)
    if bad:
        csv.loc[[17, 400], "age"] = [212, -4]
        jsonl.loc[[5, 6], "email"] = None
    out = io.BytesIO()
    parquet.to_parquet(out, row_group_size=max(1, rows // 20))
    return {"tables/people.parquet": out.getvalue(), "tables/people.csv": csv.to_csv(index=False).encode(),
            "tables/people.jsonl": jsonl.to_json(orient="records", lines=True).encode()}


def make_dataset(url: str, bad: bool = False) -> dict[str, bytes]:
    """The bundled trainer's token shards (what it trains on) and the team's tables, under one prefix."""
    store = open_store(url)
    synthesize(store, 200_000, shard_tokens=100_000, seed=3)
    for key, data in tables(bad).items():
        store.put_bytes(key, data)
    return {info.key: store.get_bytes(info.key) for info in store.list()}


def config_for(tmp_path: Path, dataset_url: str, **dataset: Any) -> dict[str, Any]:
    config = job_config(tmp_path, dataset_url, steps=30, ckpt_every=15)
    config["dataset"].update({"expectations": SUITE, **dataset})
    return config


def nothing_launched(workspace: Path) -> bool:
    clusters = workspace / "clusters"
    return not clusters.exists() or not any(clusters.iterdir())


class DataDirWatcher(Polling):
    """Copies every node's data dir the moment its stage finished (data-files.txt written): teardown removes them."""

    interval_s = 0.02

    def __init__(self, workspace: Path, cluster: str, nodes: int) -> None:
        self.nodes = [workspace / "clusters" / cluster / f"node-{rank}" for rank in range(nodes)]
        self.trees: dict[int, dict[str, bytes]] = {}
        self.listed: dict[int, list[str]] = {}

    def poll(self) -> bool:
        for rank, node in enumerate(self.nodes):
            listing = node / "data-files.txt"
            if rank not in self.trees and listing.is_file():
                data = node / "data"
                self.listed[rank] = listing.read_text().splitlines()
                self.trees[rank] = {p.relative_to(data).as_posix(): p.read_bytes()
                                    for p in sorted(data.rglob("*")) if p.is_file()}
        return len(self.trees) == len(self.nodes)


def test_tables_pass_the_suite_stage_byte_exact_on_2_nodes_and_the_report_holds_the_suite(
        prefect_server: None, workspace: Path, tmp_path: Path, s3_url: str) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.retrain import retrain

    dataset_url = f"{s3_url}/teams/churn"
    source = make_dataset(dataset_url)
    job = parse_job(config_for(tmp_path, dataset_url))

    with DataDirWatcher(workspace, "tp-ds-run", nodes=2) as watcher:
        summary = retrain(job, "ds-run")

    assert summary["status"] == "completed", summary["error"]
    assert sorted(watcher.trees) == [0, 1], "a node's stage was not seen"
    for rank in (0, 1):
        assert watcher.trees[rank] == source, f"node {rank}'s data dir is not byte-exactly the dataset"
        assert watcher.listed[rank] == sorted(source)
    dataset = summary["dataset"]
    assert (dataset["files"], dataset["bytes"]) == (len(source), sum(len(d) for d in source.values()))
    assert dataset["formats"] == {"tokens": 2, "json": 1, "parquet": 1, "csv": 1, "jsonl": 1}
    assert dataset["snapshot"] == f"{job.checkpoints.url}/ds-run/{SNAPSHOT_KEY}"
    results = dataset["validation"]["results"]
    assert [(r["type"], r["success"]) for r in results] == [(e["type"], True) for e in SUITE]
    assert [r["files"] for r in results] == [2, 3, 3, 3, 3]
    assert results[1]["rows"] == 3 * ROWS and results[0]["rows"] == 200_000
    staged = summary["stage"]
    assert staged["bytes"] == dataset["bytes"] and staged["skipped_bytes"] == 0

    key = "retrain-e2e-dataset-expectations"
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert artifacts, f"no {key} table artifact"
    # The newest: earlier tests' runs of a job with the same name published under the same key on this server.
    rows = json.loads(max(artifacts, key=lambda artifact: artifact.created).data)
    assert [(row["expectation"], row["column"], row["success"]) for row in rows] == [
        (e["type"], e.get("column", ""), True) for e in SUITE]
    docs = workspace / "runs" / "ds-run" / "dataset-validation.html"
    assert docs.is_file() and "values must never be null" in docs.read_text()
    assert (workspace / "runs" / "ds-run" / "summary.json").is_file()


def test_nulls_and_out_of_range_values_stop_run_and_plan_with_exit_2_naming_them(
        workspace: Path, tmp_path: Path, s3_url: str) -> None:
    dataset_url = f"{s3_url}/teams/churn"
    make_dataset(dataset_url, bad=True)
    config = write_config(tmp_path / "job.yaml", config_for(tmp_path, dataset_url))
    env = {**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_HOME": prefect_home(tmp_path / "prefect")}

    run = subprocess.run([TRAINPIPE, "run", str(config), "--run-id", "bad-run"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)

    assert run.returncode == 2, run.stdout + run.stderr
    line = error_line(run.stderr)
    assert (f"dataset expectation expect_column_values_to_be_between failed on column 'age' in "
            f"{dataset_url}/tables/people.csv: 2 of 6,000 rows unexpected, e.g. 212, -4") in line
    assert "(and 1 more failed expectation)" in line and "dataset-validation.html" in line
    assert nothing_launched(workspace), "a cluster was launched for bad data"
    assert open_store(f"file://{tmp_path}/store/ckpt/bad-run").head(SNAPSHOT_KEY) is None, \
        "no snapshot is frozen for a run that never started"
    docs = (workspace / "runs" / "bad-run" / "dataset-validation.html").read_text()
    assert "212" in docs

    plan = invoke("plan", str(config))
    assert plan.exit_code == 2, plan.output
    assert "expect_column_values_to_be_between failed on column 'age'" in error_line(plan.stderr)
    with_nulls_first = config_for(tmp_path, dataset_url)
    with_nulls_first["dataset"]["expectations"] = [SUITE[2]]
    nulls = invoke("plan", str(write_config(tmp_path / "nulls.yaml", with_nulls_first)))
    assert nulls.exit_code == 2, nulls.output
    assert (f"expect_column_values_to_not_be_null failed on column 'email' in {dataset_url}/tables/people.jsonl: "
            "2 of 6,000 rows unexpected, e.g. null") in error_line(nulls.stderr)


def _bad_input_cases(tmp_path: Path, s3_url: str, dataset_url: str) -> dict[str, tuple[dict[str, Any], str]]:
    broken = tmp_path / "broken-suite.json"
    broken.write_text("{\"expectations\": [")
    missing = tmp_path / "no-such-suite.json"
    return {
        "empty-prefix": ({"url": f"{s3_url}/nothing-here"},
                         f"dataset.url {s3_url}/nothing-here: no objects under this prefix"),
        "missing-suite-file": ({"expectations": str(missing)},
                               f"dataset.expectations: expectation suite {missing}: not a readable file"),
        "unreadable-suite": ({"expectations": str(broken)},
                             f"expectation suite {broken}: not valid JSON"),
        "unknown-expectation": ({"expectations": [{"type": "expect_column_to_be_pretty", "column": "age"}]},
                                "dataset.expectations[0]: unknown expectation type 'expect_column_to_be_pretty'"),
        "bad-arguments": ({"expectations": [{"type": "expect_column_values_to_be_between", "colum": "age"}]},
                          "dataset.expectations[0] (expect_column_values_to_be_between): 'column': field required"),
        "glob-matches-nothing": ({"include": ["tables/*.avro"]},
                                 f"dataset.include 'tables/*.avro' matches none of the 6 objects under {dataset_url}"),
        "split-too-few-files": ({"shard": "split", "include": ["tables/people.csv"]},
                                "dataset.shard split: 1 files for 2 nodes leaves a node without data"),
    }


def test_bad_dataset_input_is_one_line_and_exit_2_before_anything_launches(
        workspace: Path, tmp_path: Path, s3_url: str) -> None:
    dataset_url = f"{s3_url}/teams/churn"
    make_dataset(dataset_url)
    for name, (dataset, expected) in _bad_input_cases(tmp_path, s3_url, dataset_url).items():
        config = config_for(tmp_path, dataset_url)
        config["dataset"].update(dataset)
        result = invoke("plan", str(write_config(tmp_path / f"{name}.yaml", config)), "--run-id", name)
        assert result.exit_code == 2, (name, result.output)
        assert expected in error_line(result.stderr), name
        assert nothing_launched(workspace), name


def test_inspect_reports_formats_rows_schemas_and_a_sampled_suite_read_by_ranged_gets(
        workspace: Path, tmp_path: Path, s3_url: str) -> None:
    store = open_store(f"{s3_url}/tables")
    for key, data in tables(rows=60_000).items():
        store.put_bytes(key.removeprefix("tables/"), data)
    store.put_bytes("images/cat.jpg", b"\xff\xd8not really a jpeg")
    suite = tmp_path / "suite.json"  # an ExpectationSuite as GX writes it (type, kwargs, meta)
    suite.write_text(json.dumps({"name": "churn", "expectations": [
        {"type": e["type"], "kwargs": {k: v for k, v in e.items() if k not in ("type", "files")}, "meta": {}}
        for e in SUITE[1:]]}))

    sampled = invoke("dataset", "inspect", store.url, "--expectations", str(suite), "--validation", "sample",
                     "--sample-rows", "100", "--json")

    assert sampled.exit_code == 0, sampled.output
    report = json.loads(sampled.stdout)
    assert report["files"] == 4 and set(report["formats"]) == {"parquet", "csv", "jsonl", "image"}
    assert {t["key"]: t["rows"] for t in report["tabular"]} == {
        "people.csv": 60_000, "people.jsonl": 60_000, "people.parquet": 60_000}
    assert [set(entry["schema"]) for entry in report["schemas"]] == [{"id", "age", "email"}] * len(report["schemas"])
    validation = report["validation"]
    assert validation["mode"] == "sample" and validation["rows"] == 300
    assert all(r["success"] for r in validation["results"])
    assert validation["bytes_read"] < validation["bytes_total"] / 10, "sampling read whole objects"

    full = invoke("dataset", "inspect", store.url, "--expectations", str(suite))
    assert full.exit_code == 0, full.output
    assert f"{store.url}: 4 files" in full.stdout and "tabular: 3 files, 180,000 rows" in full.stdout
    assert "expectations: 4 on 3 tabular files (every row; 180,000 rows" in full.stdout
    assert "ok   expect_column_values_to_be_between (age): 180,000 rows" in full.stdout


def _mount_tmpfs(path: Path, megabytes: int) -> None:
    if os.geteuid() != 0:
        cannot_run_here("mounting a small tmpfs as the nodes' disk needs root")
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)], check=True)


def test_a_dataset_larger_than_the_nodes_disk_fails_at_plan_and_at_verify(
        tmp_path: Path, s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "small-disk"
    _mount_tmpfs(home, 16)
    try:
        monkeypatch.setenv("TRAINPIPE_HOME", str(home))
        store = open_store(f"{s3_url}/big")
        store.put_bytes("a.bin", os.urandom(6 << 20))
        store.put_bytes("b.bin", os.urandom(6 << 20))
        config = job_config(tmp_path, store.url)
        path = write_config(tmp_path / "big.yaml", config)

        plan = invoke("plan", str(path), "--run-id", "too-big")
        assert plan.exit_code == 2, plan.output
        line = error_line(plan.stderr)
        assert "dataset: the 2 local nodes would hold 25.2 MB (12.6 MB on the largest) but" in line
        assert "MB free" in line and str(home) in line

        config["dataset"]["shard"] = "split"  # 6.3 MB a node: fits
        assert invoke("plan", str(write_config(tmp_path / "split.yaml", config))).exit_code == 0

        request = ProbeRequest(dirs=(str(home),), need_bytes=64 << 20)
        probe = subprocess.run(request.command_line(sys.executable), cwd=REPO, capture_output=True, text=True,
                               timeout=60, env=request.environment(os.environ))
        assert probe.returncode == 1
        problems = json.loads(probe.stdout.strip().splitlines()[-1])["problems"]
        assert len(problems) == 1 and "GB free, this node's share of the dataset needs 0.07 GB" in problems[0]
    finally:
        subprocess.run(["umount", str(home)], check=False)


def test_a_rerun_trains_on_its_snapshot_and_refuses_a_changed_dataset(
        workspace: Path, tmp_path: Path, s3_url: str) -> None:
    from infra.dataset.planning import freeze
    from infra.job.plan import PlanError, plan_job

    dataset_url = f"{s3_url}/teams/churn"
    make_dataset(dataset_url)
    job = parse_job(config_for(tmp_path, dataset_url))
    first = plan_job(job, "rerun")
    freeze(first.dataset, first.checkpoint_url)
    store: ObjectStore = open_store(dataset_url)
    store.put_bytes("tables/new-arrivals.csv", b"id,age,email\n1,2,a@b\n")  # not in the snapshot: ignored

    again = plan_job(job, "rerun")
    assert again.dataset.frozen and again.dataset.snapshot == first.dataset.snapshot
    assert "(the run already has it)" in again.render()

    store.put_bytes("tables/people.csv", store.get_bytes("tables/people.csv") + b"99,30,late@x.org\n")
    with pytest.raises(PlanError) as caught:
        plan_job(job, "rerun")
    message = str(caught.value)
    assert message.startswith(f"dataset changed since run rerun's snapshot: {dataset_url}/tables/people.csv changed")
    assert "\n" not in message

    narrowed = job.model_copy(update={"dataset": job.dataset.model_copy(update={"exclude": ("tables/*",)})})
    with pytest.raises(PlanError, match=r"dataset.exclude is \['tables/\*'\] but the run's snapshot was taken with"):
        plan_job(narrowed, "rerun")


def test_one_trainpipe_run_lists_the_dataset_once(
        prefect_server: None, workspace: Path, tmp_path: Path, s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`trainpipe run` plans before the flow (bad input is one line, while Prefect's server starts) and hands its plan
    to the flow's plan task, which freezes it rather than list and check the dataset again; a run started without the
    command (a deployment) plans in the flow. The flow stops after its plan here: the rest is every other run's."""
    import flows.retrain
    from infra.dataset import planning
    from infra.job.summary import LAUNCHED_AT_VAR
    from tasks.plan import plan_run

    listed: list[str] = []

    def counted(listing: Any) -> Any:
        def count(*args: Any, **kwargs: Any) -> Any:
            listed.append(listing.__name__)
            return listing(*args, **kwargs)
        return count

    monkeypatch.setattr(planning, "take_snapshot", counted(planning.take_snapshot))
    monkeypatch.setattr(planning, "check_unchanged", counted(planning.check_unchanged))
    planned = []
    monkeypatch.setattr(flows.retrain, "run_job", lambda job, run_id: planned.append(plan_run(job, run_id)) or {})
    from prefect.settings import PREFECT_API_URL

    monkeypatch.setenv("PREFECT_API_URL", str(PREFECT_API_URL.value()))  # the session's server, not one of its own
    monkeypatch.setenv(LAUNCHED_AT_VAR, "0")  # set by the command otherwise, and kept in this process
    dataset_url = f"{s3_url}/teams/churn"
    make_dataset(dataset_url)
    config = write_config(tmp_path / "job.yaml", config_for(tmp_path, dataset_url))

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = invoke("run", str(config), "--run-id", "once")
    finally:
        for signum, handler in handlers.items():  # the command's own, for its life
            signal.signal(signum, handler)
    assert result.exit_code == 0, result.output
    assert listed == ["take_snapshot"], "the dataset was listed again after the command's plan"
    [plan] = planned
    assert not plan.dataset.frozen and open_store(plan.checkpoint_url).head(SNAPSHOT_KEY) is not None

    flows.retrain.retrain(parse_job(config_for(tmp_path, dataset_url)), "deployed")
    assert listed == ["take_snapshot", "take_snapshot"] and planned[1].run_id == "deployed"
