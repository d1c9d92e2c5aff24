"""`trainpipe run` left alone with an HF-style script (checkpoint-N/ folders, trainer_state.json written last, one
rng_state per rank): a syncer killed mid-training is restarted and every later step is committed; a node whose rank
hangs at exit once the final checkpoint is committed costs training.exit_grace_s, not training.timeout_s, and the run
names it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import CLI_TIMEOUT_S, REPO, TRAINPIPE, prefect_home, run_trainpipe
from jobs import job_config, make_dataset, write_config
from servers import S3Server, free_port, rclone_s3

from infra.checkpoints.store import CheckpointStore
from infra.storage import open_store

# The HF Trainer's layout without torch: a zip is what torch.save writes, and all the syncer checks of a .pth.
HF_LIKE = """
import argparse, json, os, sys, time, zipfile
parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int)
parser.add_argument("--step-s", type=float, default=0.5)
parser.add_argument("--hang-node", type=int, help="this node's ranks hang at exit")
parser.add_argument("--kill-syncer-at", type=int, help="node 1 SIGKILLs its syncer at this step")
parser.add_argument("--crash-at", type=int, help="rank 0 saves this step once told (SIGNAL_DIR/go), then fails")
args = parser.parse_args()
rank, node = int(os.environ["RANK"]), int(os.environ["TRAINPIPE_NODE_RANK"])
ckpt, sync_dir = os.environ["TRAINPIPE_CHECKPOINT_DIR"], os.environ["TRAINPIPE_SYNC_DIR"]

def save(path, step):
    with zipfile.ZipFile(path + ".tmp", "w") as archive:
        archive.writestr("data.pkl", str(step) * 1000)
    os.replace(path + ".tmp", path)

def shipped(step):
    try:
        state = json.load(open(os.path.join(sync_dir, f"sync-state-node-{node}.json")))
    except (FileNotFoundError, ValueError):
        return False
    return any(entry["step"] == step for entry in state["shipped"])

def kill_own_syncer():
    deadline = time.monotonic() + 120
    while not shipped(args.kill_syncer_at - 1):
        assert time.monotonic() < deadline, "the step before the kill never shipped"
        time.sleep(0.1)
    from infra.node.protocol import REQUEST_ENV, NodeCommand, runs_command
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\\0")
            environ = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\\0")
        except OSError:
            continue
        request = next((json.loads(e.split("=", 1)[1]) for e in environ if e.startswith(REQUEST_ENV + "=")), {})
        if runs_command(argv, NodeCommand.SYNC) and request.get("sync_dir") == sync_dir:
            os.kill(int(pid), 9)
            print(f"killed syncer {pid} at {time.time():.3f}", flush=True)
            return
    raise SystemExit("no syncer found on this node")

def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.1)

for step in range(1, args.steps + 1):
    time.sleep(args.step_s)
    if step == args.crash_at and rank == 0:
        open(os.path.join(os.environ["SIGNAL_DIR"], "ready"), "w").close()
        wait_for(os.path.join(os.environ["SIGNAL_DIR"], "go"))
    folder = os.path.join(ckpt, f"checkpoint-{step}")
    os.makedirs(folder, exist_ok=True)
    save(os.path.join(folder, f"rng_state_{rank}.pth"), step)
    if rank == 0:
        save(os.path.join(folder, "model.pth"), step)
        with open(os.path.join(folder, "trainer_state.json.tmp"), "w") as handle:
            json.dump({"global_step": step}, handle)
        os.replace(os.path.join(folder, "trainer_state.json.tmp"), os.path.join(folder, "trainer_state.json"))
        with open(os.environ["TRAINPIPE_METRICS_FILE"], "a") as metrics:
            metrics.write(json.dumps({"step": step, "loss": 1.0 / step, "total_steps": args.steps}) + "\\n")
    if step == args.crash_at:
        if rank == 0:
            print(f"rank 0: saved step {step}, now failing at {time.time():.3f}", flush=True)
            sys.exit(1)
        time.sleep(10 ** 6)  # in a collective with the rank that failed
    if node == 1 and step == args.kill_syncer_at:
        kill_own_syncer()
if node == args.hang_node:
    print(f"rank {rank}: trained, now hanging at exit", flush=True)
    time.sleep(10 ** 6)
"""


def test_a_killed_syncer_is_restarted_and_a_rank_hanging_at_exit_costs_the_grace_only(
    workspace: Path, tmp_path: Path
) -> None:
    code = tmp_path / "project"
    code.mkdir()
    (code / "hf_like.py").write_text(HF_LIKE)
    config = job_config(tmp_path, make_dataset(tmp_path / "dataset", tokens=40_000, shard_tokens=20_000))
    grace_s, steps = 5.0, 6
    config["training"] = {"code": str(code), "command": ["hf_like.py", str(steps), "--hang-node", "1",
                                                         "--kill-syncer-at", "3"],
                          "timeout_s": 900, "exit_grace_s": grace_s}
    config["checkpoints"].update(format="hf", keep=10)
    env = {**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_HOME": prefect_home(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    started = time.monotonic()
    result = run_trainpipe("run", str(write_config(tmp_path / "job.yaml", config)), "--run-id", "hangs", env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert time.monotonic() - started < 600, "the run waited for the hung rank longer than the grace"

    killed = re.search(r"killed syncer \d+ at ([\d.]+)", output)
    restarted = re.search(r"(\d\d):(\d\d):(\d\d\.\d+).*node-1: checkpoint syncer exited -9 during training", output)
    assert killed and restarted, output[-5000:]
    # Prefect stamps its log lines with the local time of day.
    kill_time = time.localtime(float(killed.group(1)))
    kill_s = kill_time.tm_hour * 3600 + kill_time.tm_min * 60 + kill_time.tm_sec + float(killed.group(1)) % 1
    hours, minutes, seconds = restarted.groups()
    detected_s = (int(hours) * 3600 + int(minutes) * 60 + float(seconds) - kill_s) % 86400
    print(f"syncer death to restart: {detected_s:.2f}s")
    assert detected_s < 10, f"the syncer's death was acted on {detected_s:.1f}s after it"

    summary = json.loads((workspace / "runs" / "hangs" / "summary.json").read_text())
    assert summary["checkpoint"].endswith("/hangs/step-00000006"), "steps after the syncer's restart were committed"
    [warning] = [w for w in summary["warnings"] if "hang" in w]
    assert "node-1 (global ranks 1-1)" in warning and "training.exit_grace_s" in warning
    checkpoints = CheckpointStore(open_store(f"{config['checkpoints']['url']}/hangs"))
    committed = [manifest.step for manifest in checkpoints.committed()]
    assert committed[0] == steps and all(step > 3 for step in committed[:3]), committed
    for step in committed:
        assert checkpoints.verify(step).step == step


def test_after_a_rank_fails_what_completed_is_committed_within_final_upload_timeout(
    workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 saves a step and fails while the store is down for longer than the script's save deadline: the syncers
    ride the outage out and commit that step within final_upload_timeout_s (they were SIGKILLed after the save
    deadline, and the checkpoint deleted at teardown)."""
    code = tmp_path / "project"
    code.mkdir()
    (code / "hf_like.py").write_text(HF_LIKE)
    signals = tmp_path / "signals"
    signals.mkdir()
    root = tmp_path / "s3" / "root"
    (root / "ckpt").mkdir(parents=True)  # the bucket, made before rclone first lists the root
    port = free_port()
    config = job_config(tmp_path, make_dataset(tmp_path / "dataset", tokens=40_000, shard_tokens=20_000))
    config["training"] = {"code": str(code), "command": ["hf_like.py", "5", "--crash-at", "3"], "timeout_s": 600,
                          "env": {"SIGNAL_DIR": str(signals)}}
    upload_s, outage_s = 120.0, 30.0
    config["checkpoints"].update(url="s3://ckpt/runs", format="hf", flush_deadline_s=5,
                                 final_upload_timeout_s=upload_s, store_outage_s=upload_s)
    for name, value in S3Server(f"http://127.0.0.1:{port}", root).env().items():
        monkeypatch.setenv(name, value)  # the run, its nodes and this test's own reads of the store
    env = {**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_HOME": prefect_home(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    path = write_config(tmp_path / "job.yaml", config)
    run = subprocess.Popen([TRAINPIPE, "run", str(path), "--run-id", "fails"], env=env, cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with rclone_s3(root, port=port):
            deadline = time.monotonic() + CLI_TIMEOUT_S / 2
            while not (signals / "ready").exists():  # rank 0 is about to save step 3
                assert run.poll() is None and time.monotonic() < deadline, "the run never reached step 3"
                time.sleep(0.2)
        # The store is down: rank 0 saves step 3 and fails; the flush starts while the store is still away.
        (signals / "go").touch()
        failed_at = time.monotonic()
        time.sleep(outage_s)  # the outage itself: its length is the point of the test
        with rclone_s3(root, port=port):
            output, _ = run.communicate(timeout=CLI_TIMEOUT_S / 2)
            finished_s = time.monotonic() - failed_at
            checkpoints = CheckpointStore(open_store("s3://ckpt/runs/fails"))
            committed = [manifest.step for manifest in checkpoints.committed()]
            verified = checkpoints.verify(3).step if 3 in committed else None
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 1, output[-5000:]
    assert "training exited 1" in output
    assert verified == 3, f"step 3 was not committed (committed: {committed}):\n{output[-5000:]}"
    assert finished_s < outage_s + upload_s, f"the run ended {finished_s:.0f}s after the failure"
    print(f"step 3 committed; the run ended {finished_s:.0f}s after rank 0 failed ({outage_s:.0f}s outage)")
