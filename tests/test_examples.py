"""The three example jobs — a plain DDP script, a Hugging Face Trainer fine-tune, a Lightning module — through
`trainpipe run` on 2 local nodes, with the dataset and the checkpoints in a real S3 (`rclone serve s3`), each
preempted once mid-run (a node taken away without notice).

Each must recover, resume from the committed step on BOTH nodes (read from the script's own output on each node),
finish, commit a checkpoint that `trainpipe ckpt verify` accepts, and its loss must have fallen.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_trainpipe

EXAMPLES = REPO / "examples"
# How each job is shortened for the test, and when its node 1 is taken away: at a step (read from the job's own
# progress output) past the first commit and well before the end, so a loaded machine's slow start-up cannot move it.
# The node goes a while after that step is reached (the head's metrics are read every second, then the injector acts):
# a job with steps of a few milliseconds would finish first, so the fast ones sleep per step, which leaves the
# preemption seconds to land in (the window: steps from at_step to the end × the delay).
JOBS = {
    "own-script": {"command": ["train.py", "--steps", "400", "--save-every", "40", "--step-delay-s", "0.05"],
                   "at_step": 200},
    "hf-trainer": {"command": ["train.py", "--data_dir", "{data_dir}", "--output_dir", "{checkpoint_dir}",
                               "--resume_from_checkpoint", "{resume_from}", "--max_steps", "120", "--save_steps", "10"],
                   "at_step": 50},
    # Without its delay (~3 ms a step) the node went ~150 steps past at_step: at 300 of 600 it sometimes went after
    # the last commit (the resumed run then had nothing to do) or during the final flush (the run hung).
    "lightning": {"command": ["train.py", "--data-dir", "{data_dir}", "--ckpt-dir", "{checkpoint_dir}", "--ckpt-path",
                              "{resume_from}", "--max-steps", "300", "--save-every", "20", "--step-delay-s", "0.04"],
                  "at_step": 100},
}
RESUMED = re.compile(r"\[tp-[\w-]+-node-(\d)\] node (\d): resum\w* from (\S+) at step (\d+)")


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_trainpipe(*args, env=env)


@pytest.mark.parametrize("example", sorted(JOBS))
def test_an_example_preempted_once_resumes_on_both_nodes_and_commits(
    example: str, s3_url: str, workspace: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(EXAMPLES / example / "make_data.py"), str(data)], check=True)
    copied = cli("cp", "--recursive", str(data), f"{s3_url}/data", env=env)
    assert copied.returncode == 0, copied.stderr

    config = yaml.safe_load((EXAMPLES / example / "job.yaml").read_text())
    config["dataset"]["url"] = f"{s3_url}/data"
    config["checkpoints"]["url"] = f"{s3_url}/ckpt"
    config["training"]["code"] = str(EXAMPLES / example)
    config["training"]["command"] = JOBS[example]["command"]
    config["recovery"] = {"max_recoveries": 2, "confirm_s": 2}
    config["chaos"] = {"preempt": [{"node": 1, "attempt": 0, "at_step": JOBS[example]["at_step"]}]}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))

    result = cli("run", str(tmp_path / "job.yaml"), "--run-id", f"{example}-run", env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    summary = json.loads((workspace / "runs" / f"{example}-run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["nodes_left"] == 0
    [recovery] = summary["recoveries"]
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
