"""The data commands' request records (stage, restore, code, peer-serve, unshare, verify-ckpt, rejoin): each round-trips
through the environment into the same record, a missing or mismatched request is one line naming the command and the
fix (exit 2), what the parsers checked the records check, and neither a request nor the command's environment is
ever on its command line."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from conftest import REPO
from pydantic import ValidationError
from test_node_protocol_sidecars import wait_for_environ

from infra.node.protocol import (
    AGENT_MODULE,
    REQUEST_ENV,
    REQUESTS,
    CodeRequest,
    NodeCommand,
    NodeRequest,
    PeerExchange,
    PeerServeRequest,
    ProtocolError,
    RejoinRequest,
    RestoreRequest,
    StageRequest,
    UnshareRequest,
    VerifyCkptRequest,
    read_request,
)
from infra.storage.http import PASS_ENV, USER_ENV

PEERS = PeerExchange(urls=("http://10.0.0.1:7001", "http://10.0.0.2:7002"), share_dir="/w/fanout", wait_s=5.0,
                     connect_grace_s=1.5)
# One request of each data command, every field away from its default where it has one.
EXAMPLES: list[NodeRequest] = [
    StageRequest(rank=1, nodes=2, workdir="/w", cache="/cache", snapshot="s3://b/ckpt/run/dataset.json",
                 dest="/w/data", inputs={"tok": "s3://b/ckpt/run/inputs/tok.json"}, inputs_dir="/w/inputs",
                 shard="split", run="run-7", workers=3, progress_interval=0.5, peers=PEERS, holders=(0,)),
    RestoreRequest(url="s3://b/ckpt/run", dest="/w/ckpt", step=40, sync_dir="/w/sync", format="dcp", rank=1,
                   prune=True, peers=PEERS, holders=(0, 1), replica_dir="/w/replica"),
    CodeRequest(url="s3://b/ckpt/run/code-ab.tar.gz", dest="/w/code", sha256="ab" * 32, rank=1, peers=PEERS),
    PeerServeRequest(dir="/w/fanout", addr="10.0.0.2:0"),
    VerifyCkptRequest(url="s3://b/ckpt/run", step=40),
    RejoinRequest(clear=("/w/sync", "/w/ckpt"), remove=("/w/notice",), set_aside=("/w/metrics.jsonl",),
                  suffix="attempt-1"),
    UnshareRequest(dir="/w/fanout", keep=("sha256-ab",)),
]
DATA_COMMANDS = [request.command for request in EXAMPLES]


def test_every_data_command_has_its_record() -> None:
    assert set(DATA_COMMANDS) <= set(REQUESTS)
    assert {REQUESTS[command] for command in DATA_COMMANDS} == {type(request) for request in EXAMPLES}


@pytest.mark.parametrize("request_", EXAMPLES, ids=lambda request: request.command.value)
def test_a_request_round_trips_through_the_environment(request_: NodeRequest) -> None:
    assert request_.command_line("/opt/py") == ["/opt/py", "-m", AGENT_MODULE, request_.command.value]
    env = request_.environment({"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    assert read_request(request_.command, env) == request_
    assert REQUEST_ENV not in env, "read once, then gone: nothing the command starts inherits it"


@pytest.mark.parametrize("bad", [
    lambda: StageRequest(rank=0, nodes=1, workdir="/w", cache="/c", snapshot="s3://b/s.json"),
    lambda: StageRequest(rank=0, nodes=1, workdir="/w", cache="/c", inputs={"tok": "s3://b/t.json"}),
    lambda: StageRequest(rank=0, nodes=1, workdir="/w", cache="/c", inputs={"": "s3://b/t.json"}, inputs_dir="/i"),
    lambda: StageRequest(rank=0, nodes=2, workdir="/w", cache="/c", holders=(2,)),
    lambda: StageRequest(rank=0, nodes=3, workdir="/w", cache="/c", peers=PEERS),
    lambda: StageRequest(rank=0, nodes=1, workdir="/w", cache="/c", shard="stripe"),
    lambda: RestoreRequest(url="s3://b/r", dest="/d", format="pickle"),
    lambda: RestoreRequest(url="s3://b/r", dest="/d", rank=2, peers=PEERS),
    lambda: RestoreRequest(url="s3://b/r", dest="/d", holders=(0,)),
    lambda: CodeRequest(url="s3://b/c.tar.gz", dest="/d", peers=PEERS),
], ids=["snapshot-without-dest", "inputs-without-dir", "unnamed-input", "holder-beyond-nodes",
        "peers-not-one-per-node", "unknown-shard", "unknown-format", "rank-beyond-peers", "holders-without-peers",
        "code-peers-without-sha256"])
def test_what_the_parsers_refused_the_records_refuse(bad: Callable[[], NodeRequest]) -> None:
    with pytest.raises(ValidationError):
        bad()


def node(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", AGENT_MODULE, command], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("command", DATA_COMMANDS, ids=str)
def test_a_command_without_a_request_exits_2_naming_itself_and_the_fix(command: NodeCommand) -> None:
    result = node(command.value, {k: v for k, v in os.environ.items() if k != REQUEST_ENV})
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: python -m {AGENT_MODULE} {command}: no request in {REQUEST_ENV}")
    assert "started by trainpipe" in line


def test_a_request_of_another_version_exits_2_naming_the_field_and_the_fix() -> None:
    request = json.loads(StageRequest(rank=0, nodes=1, workdir="/w", cache="/c").model_dump_json())
    request["fanout"] = True  # a field this agent does not know: an orchestrator of another version
    result = node("stage", {**os.environ, REQUEST_ENV: json.dumps(request)})
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert f"python -m {AGENT_MODULE} stage: its request does not match this node agent's (fanout:" in line
    assert "install the orchestrator's trainpipe version on the node" in line

    with pytest.raises(ProtocolError, match="restore: its request does not match"):
        read_request(NodeCommand.RESTORE, {REQUEST_ENV: json.dumps({"url": "s3://b/r"})})


def test_neither_the_request_nor_the_environment_is_on_the_command_line(tmp_path: Path) -> None:
    """A peer server, started as the orchestrator starts it: its credentials and its request are in its environment,
    never in its argv (readable by every user of the node), from its start to rclone's exec."""
    user, password = f"run-{secrets.token_hex(4)}", secrets.token_urlsafe(24)
    request = PeerServeRequest(dir=str(tmp_path / "share"), addr="127.0.0.1:0")
    process = subprocess.Popen(request.command_line(sys.executable), cwd=REPO,
                               env=request.environment({**os.environ, USER_ENV: user, PASS_ENV: password}),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[list[str]] = []
    serving = threading.Event()

    def follow() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if '"peer-serving"' in line:
                serving.set()

    threading.Thread(target=follow, daemon=True).start()
    try:
        seen.append(psutil.Process(process.pid).cmdline())  # the agent itself, as it starts
        assert serving.wait(60), "peer-serve named no address"
        after = psutil.Process(process.pid)
        seen.append(after.cmdline())  # the agent, or rclone once it exec'd
        # Read once the variable is there: a process read mid-exec shows a partial environment.
        environ = wait_for_environ(process.pid, PASS_ENV)
        assert environ[PASS_ENV] == password, "the credentials travel in the environment"
    finally:
        process.terminate()
        process.wait(30)
    argv = "\0".join("\0".join(cmdline) for cmdline in seen)
    for needle in (password, user, request.model_dump_json()):
        assert needle not in argv
    assert seen[0] == request.command_line(sys.executable)


def test_every_command_has_its_record_and_its_module() -> None:
    """The agent runs every command through its record: none left that parses argv of its own."""
    from infra.node.__main__ import COMMANDS
    from infra.node.protocol import REQUESTS, NodeCommand

    assert set(COMMANDS) == set(NodeCommand) == set(REQUESTS)
