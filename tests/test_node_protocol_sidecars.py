"""The sidecars', benches' and torchrun wrapper's request records (infra.node.protocol): they survive the trip to the
node whole, a missing or mismatched one is refused in one line, nothing of them (or of the environment they travel
with) is on a command line; the syncer keeps what the job's own registry protects and gets the job's secrets."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from registry_checks import commit_step

from infra.checkpoints.formats import FORMATS
from infra.checkpoints.store import CheckpointStore
from infra.compute.access.agent import NodeAgent
from infra.compute.access.remote import LocalRunner
from infra.compute.providers import Cluster, Node
from infra.job.spec import JobSpec
from infra.node.events import NodeEvent, parse
from infra.node.protocol import (
    REQUEST_ENV,
    REQUESTS,
    AllreduceBenchRequest,
    ChaosRequest,
    CheckpointFormatName,
    DiskbenchRequest,
    EnvironmentKind,
    NetbenchRequest,
    NodeCommand,
    NodeRequest,
    ProtocolError,
    SyncRequest,
    TorchrunRequest,
    TrainingEnvironment,
    WatchRequest,
    read_request,
    runs_command,
)
from infra.node.sync import Syncer, sync_config
from infra.registry import Registry
from infra.storage import open_store

REPO = Path(__file__).resolve().parents[1]

SYNC = SyncRequest(ckpt_dir="/w/ckpt", sync_dir="/w/sync", url="s3://b/run-1", node_rank=1, nodes=2, procs_per_node=4,
                   attempt="0-x", config_hash="h", keep=3, format="dcp", metrics_file="/w/metrics.jsonl",
                   stop_file="/w/sync/stop", lineage="/w/lineage.json", registry_url="s3://b", commit_timeout_s=900,
                   replica_dir="/w/replica", replica_share_dir="/w/share", replica_serve="10.0.0.2")
RECORDS: list[NodeRequest] = [
    SYNC,
    WatchRequest(lease="/w/lease", ttl_s=600, on_expire="shutdown", notice_source="aws", notice_url="http://md",
                 workdir="/w", stop_sync_file="/w/sync/stop"),
    ChaosRequest(trigger="/w/chaos-trigger", workdir="/w", notice_s=5),
    NetbenchRequest(mode="server", streams=8, timeout_s=90),
    NetbenchRequest(mode="client", host="10.0.0.2", port=4000, seconds=3, timeout_s=30),
    DiskbenchRequest(dir="/w/data", megabytes=64, buffered=True),
    TorchrunRequest(training_env=TrainingEnvironment(python="/opt/venv/bin/python"), nnodes=2, nproc_per_node=2,
                    node_rank=1, master_addr="10.0.0.1", master_port=29500,
                    script=("train.py", "--run", "x")),
    TorchrunRequest(training_env=TrainingEnvironment(kind=EnvironmentKind.CONTAINER, image="nvcr.io/x:1",
                                                     mounts=("/w",), node_dir="/w", gpus=True),
                    nnodes=2, nproc_per_node=1, node_rank=0, master_addr="10.0.0.1", master_port=29500,
                    worker=AllreduceBenchRequest(sizes_mb=(16,))),
]


def agent_env() -> dict[str, str]:
    """This environment with this checkout importable from anywhere (a node's runner starts in its workdir)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


def local_runner(name: str, workdir: Path) -> LocalRunner:
    return LocalRunner(name, workdir, {"PYTHONPATH": agent_env()["PYTHONPATH"]})


def node_agent(command: NodeCommand, environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra.node", command.value], env=environ, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("request_", RECORDS, ids=lambda r: f"{r.command}")
def test_a_record_reaches_the_node_whole_and_only_in_the_environment(request_: NodeRequest) -> None:
    argv = request_.command_line("/opt/python")
    assert argv == ["/opt/python", "-m", "infra.node", request_.command.value]
    assert runs_command(argv, request_.command)
    environ = request_.environment({"OTHER": "1"})
    assert read_request(request_.command, environ) == request_
    assert REQUEST_ENV not in environ and environ == {"OTHER": "1"}, "read once, then gone from the environment"


def test_every_command_of_this_scope_has_its_record() -> None:
    assert {NodeCommand.SYNC, NodeCommand.WATCH, NodeCommand.CHAOS, NodeCommand.NETBENCH, NodeCommand.DISKBENCH,
            NodeCommand.TORCHRUN, NodeCommand.EXEC, NodeCommand.PULL} <= set(REQUESTS)
    assert set(CheckpointFormatName.__args__) == set(FORMATS)  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", [NodeCommand.SYNC, NodeCommand.WATCH, NodeCommand.CHAOS, NodeCommand.NETBENCH,
                                     NodeCommand.DISKBENCH, NodeCommand.TORCHRUN, NodeCommand.EXEC,
                                     NodeCommand.PULL])
def test_a_command_without_its_request_exits_2_in_one_line(command: NodeCommand) -> None:
    result = node_agent(command, agent_env())
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert f"infra.node {command.value}: no request in {REQUEST_ENV}" in line and "started by trainpipe" in line


@pytest.mark.parametrize(("command", "fields", "field"), [
    (NodeCommand.SYNC, {**SYNC.model_dump(), "node_rank": 2}, "node_rank 2: must be in [0, nodes=2)"),
    (NodeCommand.SYNC, {**SYNC.model_dump(), "retries": 3}, "retries"),
    (NodeCommand.WATCH, {"lease": "/w/lease", "ttl_s": 1, "on_expire": "reboot"}, "on_expire"),
    (NodeCommand.NETBENCH, {"mode": "client", "host": "h", "port": 1}, "one of seconds or bytes"),
    (NodeCommand.TORCHRUN, {"nnodes": 1, "nproc_per_node": 1, "node_rank": 0, "master_addr": "a",
                            "master_port": 1, "training_env": {}}, "a script or a worker request"),
])
def test_a_request_that_does_not_match_its_record_exits_2_in_one_line(
        command: NodeCommand, fields: dict[str, Any], field: str) -> None:
    result = node_agent(command, {**agent_env(), REQUEST_ENV: json.dumps(fields)})
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert f"infra.node {command.value}: its request does not match" in line and field in line
    assert "install the orchestrator's trainpipe version on the node" in line
    with pytest.raises(ProtocolError):
        read_request(command, {REQUEST_ENV: json.dumps(fields)})


def local_node(tmp_path: Path, rank: int = 0) -> Node:
    workdir = tmp_path / f"node-{rank}"
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    return Node(name=f"node-{rank}", rank=rank, address="127.0.0.1", workdir=str(workdir),
                data_dir=str(workdir / "data"), ckpt_dir=str(workdir / "ckpt"), python=sys.executable)


def job_with_secret(checkpoints_url: str, **checkpoints: Any) -> JobSpec:
    return JobSpec.model_validate({
        "dataset": {"url": "file:///d"}, "cluster": {"nodes": 2},
        "checkpoints": {"url": checkpoints_url, **checkpoints},
        "training": {"command": ["-m", "trainer.train"], "secrets": {"STORE_TOKEN": {"env": "TP_TEST_STORE_TOKEN"}}}})


def test_the_syncer_gets_the_jobs_secrets_and_peer_keys_in_its_environment_never_on_its_command_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store credential given as a job secret reaches the syncer (before, it got only the peer keys, and an ssh node
    with no credentials of its own failed with "no AWS credentials"); neither it nor the request is in its argv."""
    from tasks.syncers import Syncers
    from tasks.train import TrainLaunch, syncer_env, syncer_request

    token = "tok-" + secrets.token_urlsafe(24)
    monkeypatch.setenv("TP_TEST_STORE_TOKEN", token)
    job = job_with_secret(f"file://{tmp_path / 'store'}")
    env = syncer_env(job)
    assert env["STORE_TOKEN"] == token and {"TRAINPIPE_PEER_USER", "TRAINPIPE_PEER_PASS"} <= set(env)
    nodes = (local_node(tmp_path, 0), local_node(tmp_path, 1))
    cluster = Cluster("c", "local", "run", nodes, 0.0)
    launch = TrainLaunch(f"file://{tmp_path / 'store' / 'run'}", "file:///d", 29500, "hash", attempt_id="0-x")
    runners = {node.name: local_runner(node.name, Path(node.workdir)) for node in nodes}
    syncers = Syncers(runners, nodes[:1], lambda node: syncer_request(job, cluster, node, launch),
                      lambda node, on_event: lambda line: None, logging.getLogger(__name__), env=env)
    syncers.start()
    process = syncers.processes["node-0"]
    try:
        pid = process.pid
        environ = wait_for_environ(pid, "STORE_TOKEN")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        assert environ["STORE_TOKEN"] == token
        assert environ["TRAINPIPE_PEER_PASS"] == env["TRAINPIPE_PEER_PASS"]
        assert SyncRequest.model_validate_json(environ[REQUEST_ENV]) == syncer_request(job, cluster, nodes[0], launch)
        for value in (token, env["TRAINPIPE_PEER_PASS"], launch.checkpoint_url, "0-x"):
            assert value not in cmdline
        assert cmdline.split("\0")[1:4] == ["-m", "infra.node", "sync"]
    finally:
        process.terminate(grace_s=5.0)


def wait_for_environ(pid: int, name: str, timeout_s: float = 30.0) -> dict[str, str]:
    """The process's environment, once it holds name."""
    deadline = time.monotonic() + timeout_s
    while True:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        environ = dict(entry.split("=", 1) for entry in raw.split("\0") if "=" in entry)
        if name in environ:
            return environ
        assert time.monotonic() < deadline, f"{name} never reached process {pid}'s environment"
        time.sleep(0.05)


def test_the_syncer_is_told_the_jobs_registry_and_its_retention_keeps_what_an_alias_there_names(
        tmp_path: Path) -> None:
    """`model promote --root R` (and the promote section) move aliases in the job's registry, checkpoints.url, and a
    promote refuses a checkpoint whose run is not directly under R (tests/test_model_cli.py). The syncer is told that
    registry in its request instead of guessing it from the run URL, and its retention spares the promoted step."""
    from tasks.train import TrainLaunch, syncer_request

    registry_root = f"file://{tmp_path / 'registry'}"
    promoted = commit_step(registry_root, "run-1", 100, tmp_path / "scratch")
    for step in (200, 300):
        commit_step(registry_root, "run-1", step, tmp_path / "scratch")
    Registry(registry_root).promote("m", "production", promoted, metrics={}, reason="first", who="t")
    job = job_with_secret(registry_root, keep=1, peer_replica=False)
    node = local_node(tmp_path)
    cluster = Cluster("c", "local", "run-1", (node,), 0.0)
    launch = TrainLaunch(f"{registry_root}/run-1", "file:///d", 29500, "hash", attempt_id="a1")
    request = syncer_request(job, cluster, node, launch)
    assert request.registry_url == registry_root
    checkpoints = CheckpointStore(open_store(launch.checkpoint_url))
    Path(request.sync_dir).mkdir(parents=True)
    syncer = Syncer(sync_config(request), checkpoints)
    assert syncer._apply_retention() == [200]
    assert [manifest.step for manifest in checkpoints.committed()] == [300, 100]


def test_the_torchrun_command_runs_the_script_and_says_when_its_ranks_exited(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(f"import os\nprint('rank', os.environ['RANK'], os.environ.get({REQUEST_ENV!r}), flush=True)\n")
    request = TorchrunRequest(training_env=TrainingEnvironment(python=sys.executable, node_dir=str(tmp_path)),
                              nnodes=1, nproc_per_node=1, node_rank=0, master_addr="127.0.0.1",
                              master_port=free_port(), script=(str(script),))
    result = subprocess.run(request.command_line(sys.executable), env=request.environment(agent_env()), cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rank 0 None" in result.stdout, "the script ran, without the wrapper's request in its environment"
    assert any(event is not None and event.kind is NodeEvent.RANKS_EXITED
               for event in map(parse, result.stdout.splitlines()))


def test_the_torchrun_command_hands_a_signal_to_torchrun_which_stops_the_ranks(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("import signal, sys, time\n"
                      "signal.signal(signal.SIGTERM, lambda *_: (print('saving', flush=True), sys.exit(143)))\n"
                      "print('ready', flush=True)\ntime.sleep(120)\n")
    request = TorchrunRequest(training_env=TrainingEnvironment(python=sys.executable, node_dir=str(tmp_path)),
                              nnodes=1, nproc_per_node=1, node_rank=0, master_addr="127.0.0.1",
                              master_port=free_port(), script=(str(script),))
    process = subprocess.Popen(request.command_line(sys.executable), env=request.environment(agent_env()), cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) != 0
        assert "saving" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_diskbench_command_measures_from_its_request(tmp_path: Path) -> None:
    request = DiskbenchRequest(dir=str(tmp_path / "disk"), megabytes=1, buffered=True)
    agent = NodeAgent(local_runner("n", tmp_path), sys.executable)
    lines: list[str] = []
    agent.run(request, timeout=60, on_line=lines.append)
    [event] = [e for e in map(parse, lines) if e and e.kind is NodeEvent.DISKBENCH]
    assert event["dir"] == request.dir and event["bytes"] > 0
