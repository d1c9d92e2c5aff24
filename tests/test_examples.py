"""The three example jobs — a plain DDP script, a Hugging Face Trainer fine-tune, a Lightning module — through
`trainpipe run` on 2 local nodes, with the dataset and the checkpoints in a real S3 (`rclone serve s3`), each
preempted once mid-run (a node taken away without notice).

Each must recover, resume from the committed step on BOTH nodes (read from the script's own output on each node),
finish, commit a checkpoint that `trainpipe ckpt verify` accepts, and its loss must have fallen. The Hugging Face
one is a retraining in the same run: it fine-tunes a base model staged to both nodes as an input, its committed
checkpoint is evaluated on a held-out input and promoted to production.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import REPO, prefect_home, run_trainpipe
from mlflow_server import MlflowServer, mlflow_server

from infra.checkpoints.store import CheckpointStore
from infra.node.events import Event, NodeEvent, parse
from infra.registry import Registry
from infra.storage import open_store

EXAMPLES = REPO / "examples"
# How each job is shortened for the test, and when its node 1 is taken away: at a step (read from the job's own
# progress output) past the first commit and well before the end, so a loaded machine's slow start-up cannot move it.
# The node goes a while after that step is reached (the head's metrics are read every second, then the injector acts):
# a job with steps of a few milliseconds would finish first, so the fast ones sleep per step, which leaves the
# preemption seconds to land in (the window: steps from at_step to the end × the delay).
JOBS = {
    "own-script": {"command": ["train.py", "--steps", "400", "--save-every", "40", "--step-delay-s", "0.05"],
                   "at_step": 200},
    # logging_steps 1: its first logged loss is the base model's on the first batch, before any update.
    "hf-trainer": {"command": ["train.py", "--model_name_or_path", "{input_base}", "--data_dir", "{data_dir}",
                               "--output_dir", "{checkpoint_dir}", "--resume_from_checkpoint", "{resume_from}",
                               "--max_steps", "120", "--save_steps", "10", "--logging_steps", "1"],
                   "at_step": 50, "dataset": "texts", "inputs": ("base", "heldout")},
    # Without its delay (~3 ms a step) the node went ~150 steps past at_step: at 300 of 600 it sometimes went after
    # the last commit (the resumed run then had nothing to do) or during the final flush (the run hung).
    "lightning": {"command": ["train.py", "--data-dir", "{data_dir}", "--ckpt-dir", "{checkpoint_dir}", "--ckpt-path",
                              "{resume_from}", "--max-steps", "300", "--save-every", "20", "--step-delay-s", "0.04"],
                  "at_step": 100},
}
RESUMED = re.compile(r"\[tp-[\w-]+-node-(\d)\] node (\d): resum\w* from (\S+) at step (\d+)")
EVENT_LINE = re.compile(r'\[tp-[\w-]+-node-(\d)\] (\{"event".*\})$', re.MULTILINE)
BASE_LOADED = re.compile(r"\[tp-[\w-]+-node-(\d)\] node (\d): fine-tuning the base model from (\S+)")


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_trainpipe(*args, env=env)


@pytest.fixture(scope="module")
def mlflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """A real `mlflow server`, started only for the example that reports to it (hf-trainer)."""
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


@pytest.mark.parametrize("example", sorted(JOBS))
def test_an_example_preempted_once_resumes_on_both_nodes_and_commits(
    example: str, s3_url: str, workspace: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = {**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_HOME": prefect_home(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    data, job = tmp_path / "data", JOBS[example]
    subprocess.run([sys.executable, str(EXAMPLES / example / "make_data.py"), str(data)], check=True)
    copied = cli("cp", "--recursive", str(data), f"{s3_url}/data", env=env)
    assert copied.returncode == 0, copied.stderr

    config = yaml.safe_load((EXAMPLES / example / "job.yaml").read_text())
    config["dataset"]["url"] = "/".join([f"{s3_url}/data", *([job["dataset"]] if "dataset" in job else [])])
    if "inputs" in job:
        config["inputs"] = {name: f"{s3_url}/data/{name}" for name in job["inputs"]}
    config["checkpoints"]["url"] = f"{s3_url}/ckpt"
    config["training"]["code"] = str(EXAMPLES / example)
    config["training"]["command"] = JOBS[example]["command"]
    config["recovery"] = {"max_recoveries": 2, "confirm_s": 2}
    config["chaos"] = {"preempt": [{"node": 1, "attempt": 0, "at_step": JOBS[example]["at_step"]}]}
    # The Hugging Face Trainer reports to MLflow (report_to=["mlflow"]) when the job is tracked: into the run's own.
    tracker = request.getfixturevalue("mlflow") if example == "hf-trainer" else None
    if tracker is not None:
        config["tracking"] = {"mlflow": {"uri": tracker.uri}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))

    result = cli("run", str(tmp_path / "job.yaml"), "--run-id", f"{example}-run", env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    summary = json.loads((workspace / "runs" / f"{example}-run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["nodes_left"] == 0
    [recovery] = summary["recoveries"]
    # Only the lost node replaced, for the user's framework as for the bundled trainer: the survivor kept its disk.
    assert (recovery["path"], recovery["replaced"]) == ("replaced-nodes", [recovery["node"]]), recovery
    resumed_from = recovery["resumed_from_step"]
    assert resumed_from is not None and resumed_from > 0, "node 1 went before the first commit: nothing to resume"

    # The script itself says, on each node, that it resumed from the committed step restored there.
    resumes = {int(node): (int(said), path, int(step)) for node, said, path, step in RESUMED.findall(output)}
    assert sorted(resumes) == [0, 1], output[-5000:]
    for node, (said, path, step) in resumes.items():
        assert said == node and step == resumed_from and f"/node-{node}/ckpt/" in path

    assert summary["initial_loss"] is not None and summary["final_loss"] < summary["initial_loss"], "loss did not fall"
    # The overhead figures hold for a user's job and for its resume, read from the job's own progress.
    assert summary["time_to_first_step_s"] > 0 and summary["steps_s"] > 0
    assert 0 < summary["overhead_s"] < summary["finished_at"] - summary["started_at"]
    assert recovery["time_to_first_step_s"] is not None and recovery["time_to_first_step_s"] > 0
    assert summary["workload"]["code_sha256"] and summary["workload"]["command"] == JOBS[example]["command"]
    verify = cli("ckpt", "verify", summary["checkpoint"], env=env)
    assert verify.returncode == 0, verify.stderr
    report = json.loads(verify.stdout)
    assert report["step"] == summary["checkpoint_step"] > resumed_from
    if example == "hf-trainer":
        fine_tuned_promoted(summary, output, data, f"{s3_url}/ckpt")
    if tracker is not None:
        trainer_joined_the_run(tracker.uri, summary)


def trainer_joined_the_run(uri: str, summary: dict) -> None:
    """Preempted and resumed, the run is one MLflow run, and the Trainer's own callback logged into it (on rank 0
    only: one point per logged step); the promotion is a model version with the checkpoint URL as its source."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("hf-trainer")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == summary["tracking"]["mlflow_run_id"] and run.info.status == "FINISHED"
    assert run.data.tags["trainpipe.attempts"] == "2" and not summary["tracking"]["errors"], summary["tracking"]
    # The Trainer's own keys (its MLflowCallback: loss, grad_norm, learning_rate at each logging step).
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "grad_norm")]
    assert set(steps) == set(range(1, summary["checkpoint_step"] + 1)), steps
    # A step twice only where the resumed attempt trained it again; never once per rank.
    resumed_from = summary["recoveries"][0]["resumed_from_step"]
    assert all(step > resumed_from for step in steps if steps.count(step) > 1), steps
    assert "eval.eval_loss" in run.data.metrics
    version = client.get_model_version_by_alias("hf-gpt2", "production")
    assert (version.source, version.run_id) == (summary["checkpoint"], run.info.run_id)


def fine_tuned_promoted(summary: dict, output: str, data: Path, root: str) -> None:
    """The HF job's retraining: base model staged to both nodes, fine-tuned from it, evaluated, promoted."""
    base = summary["inputs"]["base"]
    files = [path for path in (data / "base").rglob("*") if path.is_file()]
    assert (base["files"], base["bytes"]) == (len(files), sum(path.stat().st_size for path in files)), base
    assert base["node_bytes"] == [base["bytes"]] * 2, base
    # Each node's first staging is in its own event: the whole base model fetched from the store and verified there.
    staged: dict[int, list[Event]] = {}
    for node, line in EVENT_LINE.findall(output):
        if (event := parse(line)) is not None and event.kind is NodeEvent.INPUT_STAGED and event["name"] == "base":
            staged.setdefault(int(node), []).append(event)
    assert sorted(staged) == [0, 1], output[-5000:]
    first = {node: events[0] for node, events in staged.items()}
    for node, event in first.items():
        assert event["node_bytes"] == event["bytes"] == base["bytes"] and event["mb_per_s"] > 0, (node, event)
    # The summary keeps the first staging's figures (what fetching it cost); the recovery's, from the caches, follow.
    assert base["fetched_bytes"] == base["bytes"] and base["reused_bytes"] == 0 and base["mb_per_s"] > 0, base
    assert [again["reused_bytes"] for again in base["restaged"]] == [base["bytes"]], base
    # Each node's script loaded the base model from the input staged on that node...
    loaded = {int(node): (int(said), path) for node, said, path in BASE_LOADED.findall(output)}
    assert sorted(loaded) == [0, 1], output[-5000:]
    for node, (said, path) in loaded.items():
        assert said == node and path.endswith(f"/node-{node}/inputs/base"), path
    # ...and training started from its weights: the first logged loss (step 1's, before any update; step 2's where
    # the Trainer's bar had not drawn step 1 yet) is the base model's loss on those texts, far below an untrained
    # model's (ln 256 ≈ 5.5).
    scored = subprocess.run([sys.executable, str(EXAMPLES / "hf-trainer" / "evaluate.py"), "--checkpoint",
                             str(data / "base"), "--data_dir", str(data / "texts"), "--eval_file",
                             str(data.parent / "base-eval.json")], capture_output=True, text=True, timeout=300)
    assert scored.returncode == 0, scored.stderr[-3000:]
    base_loss = json.loads((data.parent / "base-eval.json").read_text())["eval_loss"]
    assert abs(summary["initial_loss"] - base_loss) < 0.1 * base_loss, (summary["initial_loss"], base_loss)
    assert base_loss < 0.5 * math.log(256)

    # Evaluated on the held-out input: in the summary and in the committed step's eval record.
    eval_loss = summary["eval"]["metrics"]["eval_loss"]
    assert summary["eval"]["checkpoint"] == summary["checkpoint"] and 0 < eval_loss < base_loss
    run_url = summary["checkpoint"].rsplit("/", 1)[0]
    record = CheckpointStore(open_store(run_url)).eval(summary["checkpoint_step"])
    assert record is not None and record.metrics["eval_loss"] == eval_loss
    # Promoted: the model's first run, production points at the committed step.
    assert summary["promotion"]["promoted"], summary["promotion"]
    # From the last step's log line (the Trainer writes no metrics file with times) to the decision.
    assert summary["promotion"]["decided_after_training_s"] is not None, summary["promotion"]
    assert Registry(root).resolve("hf-gpt2", "production").target == summary["checkpoint"]
    print(f"figures: input base {base['bytes']:,} bytes staged to each node in "
          f"{[first[node]['seconds'] for node in (0, 1)]} s, {[first[node]['mb_per_s'] for node in (0, 1)]} MB/s; "
          f"on the recovery {base['reused_bytes']:,} bytes reused from the cache; base loss {base_loss:.4f}, "
          f"first logged {summary['initial_loss']:.4f}; eval_loss {eval_loss:.4f} promoted "
          f"{summary['checkpoint']}")
