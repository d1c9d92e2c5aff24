"""A node's disk: the budget plan holds it to (infra/job/disk_budget.py; the CLI's refusal is in test_cli.py), the
share dir pruned after each exchange (infra/node/unshare.py; the 4-node run with its recoveries measured in
test_replace_nodes.py), and a disk that fills mid-training named by its syncer (infra/node/diskfull.py) as the run's
failure, on a real full file system (a tmpfs: the tests run as root)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from jobs import job_config, make_dataset
from polling import Polling

from infra.checkpoints.store import CheckpointStore
from infra.job.disk_budget import CheckpointSize, node_budget
from infra.job.plan import cluster_name_for
from infra.job.spec import parse_job
from infra.node.diskfull import DISK_FULL_BYTES
from infra.node.events import Event, NodeEvent, parse
from infra.node.fanout import HEARTBEAT
from infra.node.protocol import AGENT_MODULE, ProbeRequest, UnshareRequest
from infra.node.replica import REPLICA_DIR
from infra.storage import open_store
from infra.workspace import run_dir


def test_the_budget_counts_a_warm_start_keep_local_checkpoints_and_the_replicas_past_them() -> None:
    budget = node_budget(1, 700, 50, CheckpointSize(400, "training.init_from's manifest"), nodes=4, keep_local=1,
                         warm_start=True, peer_replica=True)
    assert {term.name: term.bytes for term in budget.terms} == {
        "dataset": 700, "inputs": 50, "warm start (training.init_from)": 400, "local checkpoints": 400,
        # 2 replicas of the buddy's part, and this node's own part served for 2 steps: 1 beyond keep_local 1.
        "peer replicas": 3 * 100, "share dir": 0}
    assert budget.total == 700 + 50 + 400 + 400 + 300
    assert budget.held == "dataset, inputs, warm start (training.init_from), local checkpoints and peer replicas"

    unknown = node_budget(0, 700, 0, CheckpointSize(None, "no size known: set checkpoints.size_bytes"), nodes=4,
                          keep_local=2, warm_start=False, peer_replica=True)
    assert [term.name for term in unknown.terms] == ["dataset", "inputs", "share dir"]
    assert unknown.render().endswith("; checkpoints not counted: no size known: set checkpoints.size_bytes")


def test_the_verify_probe_holds_a_node_to_its_budget_naming_the_terms(tmp_path: Path) -> None:
    """Disks plan cannot see (ssh hosts, Slurm nodes) are held to the budget when the node is probed."""
    budget = node_budget(0, 10**17, 0, CheckpointSize(10**17, "checkpoints.size_bytes"), nodes=2, keep_local=2,
                         warm_start=False, peer_replica=False)
    request = ProbeRequest(dirs=(str(tmp_path),), need_bytes=budget.total, budget=budget.render())
    probe = subprocess.run(request.command_line(sys.executable), cwd=REPO, capture_output=True, text=True,
                           timeout=60, env=request.environment(os.environ))
    assert probe.returncode == 1, probe.stderr
    [problem] = next(e for e in map(parse, probe.stdout.splitlines()) if e is not None and e.kind is NodeEvent.PROBE)[
        "problems"]
    assert ("GB free, this node's disk budget (dataset 100,000,000.00 GB + inputs 0.0 MB + local checkpoints "
            "200,000,000.00 GB (checkpoints.keep_local 2 × 100,000,000.00 GB) + share dir 0.0 MB") in problem, problem
    assert f") needs {budget.total / 1e9:.2f} GB: free space" in problem, problem


def test_unshare_unlinks_the_exchanged_pieces_and_keeps_the_replicas_and_the_code(tmp_path: Path) -> None:
    share = tmp_path / "fanout"
    (share / REPLICA_DIR).mkdir(parents=True)
    cached = tmp_path / "cache" / "obj"
    cached.parent.mkdir()
    cached.write_bytes(b"d" * 300)  # a stage cache object: its bytes stay, only the share's link goes
    os.link(cached, share / "sha256-dataset")
    deleted = tmp_path / "ckpt" / "step-1" / "part"
    deleted.parent.mkdir(parents=True)
    deleted.write_bytes(b"c" * 500)
    os.link(deleted, share / "crc64nvme-restored")
    deleted.unlink()  # the script rotated its restored checkpoint out: the share's link held the last 500 bytes
    (share / REPLICA_DIR / "crc64nvme-mine").write_bytes(b"r" * 70)
    (share / "sha256-code").write_bytes(b"t" * 90)
    (share / HEARTBEAT).write_text("0 1 2\n")

    request = UnshareRequest(dir=str(share), keep=("sha256-code",))
    result = subprocess.run(request.command_line(sys.executable), cwd=REPO, env=request.environment(os.environ),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert request.command_line(sys.executable)[1:3] == ["-m", AGENT_MODULE]
    [event] = [e for e in map(parse, result.stdout.splitlines()) if e is not None and e.kind is NodeEvent.UNSHARED]
    assert (event["removed"], event["freed_bytes"]) == (3, 500 + len("0 1 2\n"))  # the heartbeat too
    assert sorted(p.name for p in share.iterdir()) == [REPLICA_DIR, "sha256-code"]
    assert (share / REPLICA_DIR / "crc64nvme-mine").is_file() and cached.read_bytes() == b"d" * 300


class FillOnFirstCommit(Polling):
    """Once the run's first checkpoint is committed, fills the nodes' disk (a tmpfs) but for `left` bytes, then waits
    for a node's syncer to say so in its log: when each happened."""

    interval_s = 0.1

    def __init__(self, checkpoint_url: str, disk: Path, nodes: list[Path], left: int) -> None:
        self.checkpoints = CheckpointStore(open_store(checkpoint_url))
        self.disk, self.nodes, self.left = disk, nodes, left
        self.committed: int | None = None
        self.filled_at: float | None = None
        self.said_at: float | None = None
        self.said: Event | None = None

    def poll(self) -> bool:
        if self.filled_at is None:
            latest = self.checkpoints.latest()
            if latest is None:
                return False
            self.committed = latest.step
            with (self.disk / "filler").open("wb") as filler:
                filler.write(bytes(max(0, shutil.disk_usage(self.disk).free - self.left)))
            self.filled_at = time.monotonic()
        for log in (node / "logs" / "sync.log" for node in self.nodes):
            lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
            said = next((e for e in map(parse, lines) if e is not None and e.kind is NodeEvent.DISK_FULL), None)
            if said is not None:
                self.said, self.said_at = said, time.monotonic()
                return True
        return False


def test_a_node_whose_disk_fills_mid_training_is_named_and_the_run_fails_with_its_commits_intact(
        prefect_server: None, workspace: Path, tmp_path: Path) -> None:
    from flows.retrain import retrain

    dataset = make_dataset(tmp_path / "dataset")
    # Long enough to be cut short: the fill comes at the first commit (step 40).
    config = job_config(tmp_path, dataset, steps=100_000, timeout_s=600)
    config["cluster"]["nodes"] = 1  # one node's syncer is the path under test: a second adds only seconds
    run_id = "disk-full"
    cluster = cluster_name_for(run_id)
    # The nodes' disk: a 64 MiB tmpfs under the local clusters (the stage cache stays beside it, on this disk).
    disk = workspace / "clusters"
    disk.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], check=True)
    try:
        nodes = [disk / cluster / "node-0"]
        filler = FillOnFirstCommit(f"{config['checkpoints']['url']}/{run_id}", disk, nodes, left=512 * 1024)
        started = time.monotonic()
        with filler, pytest.raises(Exception) as raised:
            retrain(parse_job(config), run_id)
        ended = time.monotonic()
    finally:
        subprocess.run(["umount", str(disk)], check=True)

    assert filler.filled_at is not None and filler.committed is not None, "no checkpoint was ever committed"
    summary = json.loads((run_dir(run_id) / "summary.json").read_text())
    error = summary["error"]
    assert summary["status"] == "failed" and summary["nodes_left"] == 0, summary
    # The reason names the node, the path and the bytes free (below the floor: what the fill left, about).
    match = re.search(rf"{cluster}-node-(\d): disk full: (\S+) has ([\d,]+) bytes free", error)
    assert match is not None, error
    node, path, free = int(match[1]), match[2], int(match[3].replace(",", ""))
    assert path == str(nodes[node] / "ckpt") and free < DISK_FULL_BYTES, error
    assert "trainpipe plan" in error and str(raised.value).count("disk full") >= 1
    # Said within a syncer's round or so of the fill, well inside 30 s; the run ended failed soon after.
    assert filler.said is not None and filler.said_at is not None, "no node's syncer said its disk is full"
    report_s = filler.said_at - filler.filled_at
    assert report_s < 30, report_s
    # What was committed before the disk filled is intact in the store: every file checked against its manifest.
    store = CheckpointStore(open_store(f"{config['checkpoints']['url']}/{run_id}"))
    latest = store.latest()
    assert latest is not None and latest.step >= filler.committed
    store.verify(latest.step, deep=True)
    print(f"disk-full run: {ended - started:.1f}s; the fill at step {filler.committed}'s commit; disk-full said "
          f"{report_s:.2f}s after it, the run ended {ended - filler.filled_at:.1f}s after it: {error[:200]}")
