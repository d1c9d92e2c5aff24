"""A user's own training job through `trainpipe run`: code shipped to every node, its setup, its command under
torchrun, the environment contract, and failures that end the run with the command's own last lines."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import prefect_home, run_trainpipe
from jobs import COMMIT_TINY_CHECKPOINT, job_config, make_dataset, probe_project, write_config

PROBE = COMMIT_TINY_CHECKPOINT + """
import json, os, sys
env = {k: v for k, v in os.environ.items() if k.startswith("TRAINPIPE_") or k in ("RANK", "WORLD_SIZE", "HELLO")}
env["cwd"] = os.getcwd()
env["argv"] = sys.argv[1:]
env["setup_marker"] = open("setup-ran").read().strip()
env["data_files"] = sorted(os.listdir(os.environ["TRAINPIPE_DATA_DIR"]))
# Local nodes share this machine's disk: the test reads what each process was told from outside the cluster.
out = os.path.join(os.environ["PROBE_OUT"], "probe-" + os.environ["RANK"] + ".json")
with open(out + ".tmp", "w") as handle:
    json.dump(env, handle)
os.replace(out + ".tmp", out)
commit_tiny_checkpoint([2.0, 1.0])
if os.environ["RANK"] == "0":
    with open(os.environ["TRAINPIPE_METRICS_FILE"], "a") as metrics:
        metrics.write(json.dumps({"eval_loss": 0.9, "note": "from the script"}) + "\\n")
"""


def run(config: dict, tmp_path: Path, workspace: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_HOME": prefect_home(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    path = write_config(tmp_path / "job.yaml", config)
    return run_trainpipe("run", str(path), *args, env=env)


@pytest.fixture
def dataset_url(tmp_path: Path) -> str:
    return make_dataset(tmp_path / "dataset", tokens=40_000, shard_tokens=20_000)


def own_config(tmp_path: Path, dataset_url: str, code: Path, **training: object) -> dict:
    config = job_config(tmp_path, dataset_url)
    config["training"] = {"code": str(code), **training}
    return config


def test_the_script_gets_its_code_setup_environment_and_placeholders(workspace: Path, tmp_path: Path,
                                                                    dataset_url: str) -> None:
    code, probes = probe_project(tmp_path, PROBE)
    config = own_config(tmp_path, dataset_url, code, setup=["echo ran > setup-ran"],
                        env={"HELLO": "world", "PROBE_OUT": str(probes)},
                        command=["probe.py", "--data", "{data_dir}", "--out", "{checkpoint_dir}",
                                 "--resume", "{resume_from}", "--run", "{run_id}"])
    result = run(config, tmp_path, workspace, "--run-id", "probe-run")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    summary = json.loads((workspace / "runs" / "probe-run" / "summary.json").read_text())
    workload = summary["workload"]
    assert workload["command"][0] == "probe.py" and len(workload["code_sha256"]) == 64
    assert workload["setup_s"] > 0
    assert (summary["steps"], summary["initial_loss"], summary["final_loss"]) == (2, 2.0, 1.5)
    assert summary["final_eval_loss"] == 0.9 and summary["metrics"]["note"] == "from the script"
    assert "workload: probe.py" in result.stdout and "setup" in result.stdout
    assert summary["checkpoint"].endswith("/probe-run/step-00000002"), "numbered by the script's last step"

    told = [json.loads((probes / f"probe-{rank}.json").read_text()) for rank in (0, 1)]
    for rank, env in enumerate(told):
        node = Path(env["TRAINPIPE_CHECKPOINT_DIR"]).parent
        assert env["cwd"] == str(node / "code"), "the command runs in the shipped code dir"
        assert env["setup_marker"] == "ran", "the setup ran in the code dir before training"
        assert env["argv"] == ["--data", str(node / "data"), "--out", str(node / "ckpt"), "--run", "probe-run"]
        assert env["TRAINPIPE_DATA_DIR"] == str(node / "data") and "manifest.json" in env["data_files"]
        assert (env["TRAINPIPE_RUN_ID"], env["TRAINPIPE_ATTEMPT"], env["TRAINPIPE_NUM_NODES"]) == ("probe-run", "0",
                                                                                                   "2")
        assert env["TRAINPIPE_NODE_RANK"] == str(rank) and env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["TRAINPIPE_RESUME_FROM"] == "" and env["TRAINPIPE_NODE_IPS"] == "127.0.0.1,127.0.0.1"
        assert env["TRAINPIPE_METRICS_FILE"] == str(node / "logs" / "metrics.jsonl") and env["HELLO"] == "world"
    assert told[0]["TRAINPIPE_CHECKPOINT_DIR"] != told[1]["TRAINPIPE_CHECKPOINT_DIR"], "each node has its own disk"


def test_a_failing_setup_ends_the_run_with_its_output_and_no_retry(workspace: Path, tmp_path: Path,
                                                                   dataset_url: str) -> None:
    code = tmp_path / "project"
    code.mkdir()
    (code / "train.py").write_text("print('never runs')\n")
    config = own_config(tmp_path, dataset_url, code, setup=["echo installing requirements", "echo 'ERROR: no such "
                                                           "package: torchh' >&2; exit 3"], command=["train.py"])
    result = run(config, tmp_path, workspace, "--run-id", "setup-fails")
    assert result.returncode == 1, result.stdout[-3000:]
    assert "training.setup exited 3" in result.stderr and "no such package: torchh" in result.stderr
    assert result.stdout.count("installing requirements") <= 2 * 2, "the setup was retried"
    summary = json.loads((workspace / "runs" / "setup-fails" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["nodes_left"] == 0 and "train" not in summary["phases"], (
        summary.get("teardown_error"), result.stderr[-3000:])


def test_a_script_that_writes_no_checkpoint_fails_saying_so(workspace: Path, tmp_path: Path,
                                                             dataset_url: str) -> None:
    code = tmp_path / "project"
    code.mkdir()
    (code / "train.py").write_text("print('trained, saved nothing')\n")
    config = own_config(tmp_path, dataset_url, code, command=["train.py"])
    result = run(config, tmp_path, workspace, "--run-id", "no-ckpt")
    assert result.returncode == 1
    assert "no checkpoint that checkpoints.format auto recognises" in result.stderr


def test_a_script_that_fails_at_once_ends_the_run_with_its_last_lines(workspace: Path, tmp_path: Path,
                                                                     dataset_url: str) -> None:
    code = tmp_path / "project"
    code.mkdir()
    (code / "train.py").write_text("import sys\nprint('loading config.yaml', flush=True)\n"
                                   "raise SystemExit('bad config: learning_rate must be positive, got -3')\n")
    config = own_config(tmp_path, dataset_url, code, command=["train.py"])
    started = time.monotonic()
    result = run(config, tmp_path, workspace, "--run-id", "script-fails")
    assert result.returncode == 1, result.stdout[-3000:]
    assert time.monotonic() - started < 300
    assert "training exited 1" in result.stderr
    assert "bad config: learning_rate must be positive, got -3" in result.stderr
    summary = json.loads((workspace / "runs" / "script-fails" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["recoveries"] == [] and summary["nodes_left"] == 0
