"""The whole pipeline for real: Prefect flow, 2 local nodes, torchrun + gloo, checkpoints committed to a file:// store.

Nothing is mocked: nodes are directories with real processes, training is real torchrun, the store is real files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import CLI_TIMEOUT_S, REPO, TRAINPIPE, prefect_home, run_trainpipe, without_prefect_api
from jobs import job_config, make_dataset, write_config

from infra.checkpoints.store import CheckpointStore
from infra.compute.providers.local import CLUSTER_TAG
from infra.job.spec import parse_job
from infra.node import processes
from infra.storage import open_store
from trainer.checkpoint import inspect_checkpoint


def prefect_servers(home: str) -> list[psutil.Process]:
    """The temporary Prefect server of a `trainpipe run` with this PREFECT_HOME, and its guard (its nodes carry the
    same environment, and are not counted)."""
    def is_server(process: psutil.Process) -> bool:
        try:
            command = " ".join(process.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return False
        return " server start " in command or "trainpipe.server_guard" in command

    return [process for process in processes.tagged_processes("PREFECT_HOME", home) if is_server(process)]


def tagged_processes(workspace: Path) -> list[psutil.Process]:
    """Node processes of local clusters in this test's workspace (other sessions' clusters are not ours)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(CLUSTER_TAG, "").startswith(str(workspace)):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _in_group(process: psutil.Process, group: int) -> bool:
    try:
        return os.getpgid(process.pid) == group
    except (ProcessLookupError, psutil.NoSuchProcess):
        return False


@pytest.fixture
def dataset_url(tmp_path: Path) -> str:
    return make_dataset(tmp_path / "dataset")


def test_flow_trains_commits_and_tears_down(prefect_server: None, workspace: Path, tmp_path: Path,
                                            dataset_url: str) -> None:
    from flows.retrain import retrain

    config = job_config(tmp_path, dataset_url, expectations=True)
    # The verify stage's bench, kept short: its figures land in the summary (its own tests check the figures).
    config["cluster"]["verify"] = {"bench": "warn", "tcp_seconds": 0.5, "allreduce_sizes_mb": [1], "disk_bytes_mb": 8,
                                   "measure": "all"}
    job = parse_job(config)
    summary = retrain(job, "e2e-run")

    assert summary["status"] == "completed"
    assert set(summary["phases"]) == {"plan", "provision", "verify", "stage", "train", "sync", "teardown"}
    assert summary["steps"] == 120 and summary["start_step"] == 1
    assert summary["final_loss"] < summary["initial_loss"] * 0.6, "loss did not fall"
    assert summary["dataset"]["files"] == 5 and summary["dataset"]["validation"]["results"][0]["success"]
    assert summary["loss_floor"] == pytest.approx(1.0889, abs=1e-3), "the trainer reports its data's floor"
    assert summary["workload"]["command"][:2] == ["-m", "trainer.train"] and summary["workload"]["code"] is None
    assert summary["final_eval_loss"] is not None and summary["breakdown"]["steps"] > 0
    wall = summary["finished_at"] - summary["started_at"]
    assert 0 < summary["steps_s"] < wall and 0 < summary["time_to_first_step_s"] < wall
    assert summary["overhead_s"] == pytest.approx(wall - summary["steps_s"], abs=0.01)
    assert summary["checkpoint"].endswith("/e2e-run/step-00000120")
    assert summary["nodes_left"] == 0
    assert [(a["instance_type"], a["outcome"]) for a in summary["attempts"]] == [("local-process", "launched")]
    assert summary["price_per_hour"] == 0.0 and summary["cost_usd"] == 0.0, "local nodes cost nothing"
    bench = summary["cluster_bench"]
    assert bench["mode"] == "warn" and bench["verdict"]["ok"], bench
    assert [(link["src"], link["dst"]) for link in bench["measurement"]["links"]] == [("node-0", "node-1")]
    assert bench["measurement"]["links"][0]["gbps"] > 0
    on_disk = json.loads((workspace / "runs" / "e2e-run" / "summary.json").read_text())
    assert on_disk["checkpoint"] == summary["checkpoint"]

    checkpoints = CheckpointStore(open_store(f"{job.checkpoints.url}/e2e-run"))
    latest = checkpoints.latest()
    assert latest is not None and latest.step == 120
    assert [c.step for c in checkpoints.committed()] == [120, 80], "retention keeps the newest 2 committed"
    loaded = inspect_checkpoint(checkpoints.restore(tmp_path / "restored"))
    assert loaded["step"] == 120 and loaded["num_params"] > 0

    assert not tagged_processes(workspace), "node processes outlived the run"
    assert not any((workspace / "clusters").iterdir()), "node directories outlived the run"


def _run_cli(args: list[str], env: dict[str, str], timeout: float = CLI_TIMEOUT_S
             ) -> subprocess.CompletedProcess[str]:
    return run_trainpipe(*args, env=env, timeout=timeout)


def test_sigkilled_run_is_swept_and_rerun_resumes(workspace: Path, tmp_path: Path, dataset_url: str) -> None:
    # Orphans go on training and committing until the sweep; 50 ms a step keeps the 360 steps after the first commit
    # (>= 18 s) well beyond the few seconds of `status` and `sweep`, however fast the machine computes.
    config = job_config(tmp_path, dataset_url, steps=400, step_delay_s=0.05)
    config_path = write_config(tmp_path / "job.yaml", config)
    home = prefect_home(tmp_path / "prefect")
    # The run's own temporary server, which must not outlive it either.
    env = without_prefect_api({**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_HOME": home,
                               "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    checkpoints = CheckpointStore(open_store(f"{config['checkpoints']['url']}/resume-run"))

    log = tmp_path / "orchestrator.log"
    orchestrator = subprocess.Popen([TRAINPIPE, "run", str(config_path), "--run-id", "resume-run"], cwd=REPO,
                                    env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while checkpoints.latest() is None:
        assert orchestrator.poll() is None, "the run ended before its first commit:\n" + log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint was committed within 300 s"
        time.sleep(0.5)
    # The orchestrator dies without any chance to clean up; the nodes run in their own sessions, as they would on
    # other machines, so they survive as orphans.
    # Prefect's public command, under the guard (not its private uvicorn launcher, which an upgrade may change).
    assert any(" server start " in " ".join(p.cmdline()) for p in prefect_servers(home)), (
        "the run's temporary Prefect server is not running `prefect server start`")
    os.killpg(orchestrator.pid, signal.SIGKILL)
    orchestrator.wait()

    assert tagged_processes(workspace), "killing the orchestrator should leave the nodes' processes running (orphans)"
    # Its temporary Prefect server (in a session of its own) is ended by its guard: before, it ran on for good.
    deadline = time.monotonic() + 30
    while left := prefect_servers(home):
        assert time.monotonic() < deadline, f"the killed run's Prefect server outlived it: {left}"
        time.sleep(0.2)
    status = _run_cli(["status"], env)
    assert "ORPHANED" in status.stdout
    swept = _run_cli(["sweep"], env)
    assert swept.returncode == 0, swept.stderr
    assert "swept 1 clusters" in swept.stdout
    assert not tagged_processes(workspace), "sweep left node processes running"

    committed = checkpoints.latest()
    assert committed is not None and 0 < committed.step < 400
    # A short run on from the commit: what is checked is where it starts, not how long it trains.
    end = committed.step + 20
    write_config(config_path, job_config(tmp_path, dataset_url, steps=end, step_delay_s=0.05))
    rerun = _run_cli(["run", str(config_path), "--run-id", "resume-run"], env)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    summary = json.loads((workspace / "runs" / "resume-run" / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["start_step"] == committed.step + 1, "the rerun did not continue from the committed step"
    assert summary["steps"] == end
    assert "0 nodes left running" in rerun.stdout
    assert not tagged_processes(workspace)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda c: c["cluster"].update(provider="azure-ish"), "unknown provider 'azure-ish'"),
        (lambda c: c["cluster"].update(nodes=0), "cluster.nodes"),
        (lambda c: c["dataset"].update(url="file:///nonexistent/dataset"), "no objects under this prefix"),
        (lambda c: c["checkpoints"].update(url="file:///proc/trainpipe-ckpt"), "checkpoints.url"),
        # The suite says token ids stop at 127 (a model with vocab 128); the shards hold ids up to 255.
        (lambda c: c["dataset"]["expectations"][0].update(max_value=127),
         "expect_column_values_to_be_between failed on column 'token' in "),
        (lambda c: c["training"].update(code="/nonexistent/project", command=["train.py"]),
         "training.code /nonexistent/project: no such directory"),
        (lambda c: c["training"].update(code=str(REPO / "examples"), command=["train_me.py"]),
         "training.command[0] train_me.py: no such file in training.code"),
        (lambda c: c["checkpoints"].update(format="keras"), "checkpoints.format: Input should be"),
        (lambda c: c["training"].update(command=["-m", "trainer.train", "--out", "{output_dir}"]),
         "unknown placeholder {output_dir}"),
    ],
    ids=["unknown-provider", "zero-nodes", "empty-prefix", "unwritable-checkpoints", "vocab-mismatch",
         "no-code-dir", "script-not-in-code", "unknown-format", "unknown-placeholder"],
)
def test_bad_input_fails_plan_with_one_line_and_exit_2(workspace: Path, tmp_path: Path, dataset_url: str,
                                                       mutate, expected: str) -> None:
    config = job_config(tmp_path, dataset_url, expectations=True)
    mutate(config)
    env = {**os.environ, "TRAINPIPE_HOME": str(workspace)}
    if expected.startswith("unknown provider"):  # once with the temporary server: its start adds no line to stderr
        env = without_prefect_api(env)
    result = _run_cli(["run", str(write_config(tmp_path / "bad.yaml", config))], env, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(error_lines) == 1 and expected in error_lines[0], result.stderr
    assert not (workspace / "clusters").exists() or not any((workspace / "clusters").iterdir()), "launched anyway"



def test_sigterm_to_the_orchestrator_tears_the_cluster_down(workspace: Path, tmp_path: Path, dataset_url: str) -> None:
    """SIGTERM is what a cancel, a stopping worker or a container runtime sends: the run must clean up after itself."""
    config_path = write_config(tmp_path / "job.yaml", job_config(tmp_path, dataset_url, steps=2000))
    # A new PREFECT_HOME, as on a user's first run: the temporary server migrates its database (the other runs'
    # homes start migrated).
    env = without_prefect_api({**os.environ, "TRAINPIPE_HOME": str(workspace),
                               "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    log = tmp_path / "orchestrator.log"
    orchestrator = subprocess.Popen([TRAINPIPE, "run", str(config_path), "--run-id", "term-run"], cwd=REPO, env=env,
                                    stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while not any("trainer.train" in " ".join(p.cmdline()) for p in tagged_processes(workspace)):
        assert orchestrator.poll() is None, "the run ended before training started:\n" + log.read_text()[-3000:]
        assert time.monotonic() < deadline, "training did not start within 300 s"
        time.sleep(0.5)
    orchestrator.send_signal(signal.SIGTERM)
    orchestrator.wait(timeout=120)
    output = log.read_text()

    assert orchestrator.returncode == 128 + signal.SIGTERM, output[-3000:]
    leftovers = [p.pid for p in psutil.process_iter() if _in_group(p, orchestrator.pid)]
    assert not leftovers, f"processes of the orchestrator (its Prefect server?) outlived it: {leftovers}"
    assert not tagged_processes(workspace), "node processes outlived a terminated run:\n" + output[-3000:]
    assert not (workspace / "clusters" / "tp-term-run").exists()
    summary = json.loads((workspace / "runs" / "term-run" / "summary.json").read_text())
    assert summary["status"] == "cancelled" and summary["nodes_left"] == 0  # a SIGTERM is a cancel, not a failure
