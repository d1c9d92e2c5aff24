"""The training runs in the user's environment, beside the node agent and never inside it (issue 37, item 2).

- training.python naming a venv that has torch and not trainpipe: a user-style DDP script trains to a commit on 2
  local nodes, sees neither trainpipe nor infra, and the summary and the lineage name that environment;
- an interpreter without torch: the run fails at verify in one line naming the node, the interpreter and the fix,
  and nothing is installed into it (its pip freeze is unchanged);
- the command lines trainenv builds (docker, podman, host), with no secret value on any of them;
- a killed agent (SIGKILL of the `torchrun` node command) leaves no rank running: the launcher's lifeline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml
from cloud_env import wait_for
from conftest import REPO, prefect_home, run_trainpipe
from containers import VENV, DockerEngine, TrainImage, base_python, engine_env
from jobs import make_dataset

from infra.checkpoints.store import CheckpointStore
from infra.node.events import NodeEvent, event_line
from infra.node.protocol import (
    LAUNCHER_STOP_GRACE_S,
    REQUEST_ENV,
    EnvironmentKind,
    ExecRequest,
    TorchrunRequest,
    TrainingEnvironment,
)
from infra.node.trainenv import container_argv, invocation, write_env_file
from infra.storage import open_store
from infra.workload.launcher import LINE_ENV

WHEELS = Path(os.environ.get("TRAINPIPE_TEST_WHEELS", "/opt/wheels"))
REQUIREMENTS = ("torch==2.13.0", "numpy")
BUILD_TIMEOUT_S = 900.0
SECRET = "s3cr3t-value-never-on-argv"

# A user's DDP script: it imports only torch and the (vendored) trainpipe_sdk, reports what it could import, trains a
# few steps of a tiny model over gloo, and rank 0 saves a checkpoint and marks it complete.
USER_SCRIPT = """
import importlib.util, json, os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from trainpipe_sdk import log_metrics, mark_complete

seen = {"python": sys.executable, "torch": torch.__version__, "pythonpath": os.environ.get("PYTHONPATH"),
        "importable": {name: importlib.util.find_spec(name) is not None for name in ("trainpipe", "infra", "prefect")},
        "secret": os.environ.get("PROBE_SECRET") == os.environ.get("PROBE_SECRET_EXPECTED")}
print("SEEN " + json.dumps(seen), flush=True)  # read back from the run's output: a container sees no test dir
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 4), torch.randn(64, 1)
for step in range(1, 6):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    log_metrics(step, float(loss), total_steps=5)
if dist.get_rank() == 0:
    path = os.path.join(os.environ["TRAINPIPE_CHECKPOINT_DIR"], "model.pt")
    torch.save(model.module.state_dict(), path)
    mark_complete(path)
# Every rank at teardown together (rank 0 saves first), and DDP's reducer, which holds the process group, freed
# before it: a rank tearing down alone aborted its exit in a gloo thread ("terminate called without an active
# exception") twice in CI.
dist.barrier()
del model, optimizer
dist.destroy_process_group()
"""


@pytest.fixture
def bare_venv(tmp_path: Path) -> Path:
    """A venv with pip and nothing else: no torch."""
    venv = tmp_path / "bare"
    subprocess.run([base_python(), "-m", "venv", str(venv)], check=True, timeout=300)
    return venv / "bin" / "python"


def pip_freeze(python: Path) -> str:
    return subprocess.run([str(python), "-m", "pip", "freeze", "--all"], capture_output=True, text=True, check=True,
                          timeout=120).stdout


SEEN = re.compile(r"\[(tp-[\w-]+-node-\d)\] SEEN (\{.*\})$", re.MULTILINE)


def user_project(tmp_path: Path) -> Path:
    """The user's code dir: the script and the vendored stdlib-only SDK."""
    code = tmp_path / "project"
    code.mkdir()
    (code / "train.py").write_text(USER_SCRIPT)
    shutil.copytree(REPO / "trainpipe_sdk", code / "trainpipe_sdk", ignore=shutil.ignore_patterns("__pycache__"))
    return code


def seen_by_node(output: str) -> dict[str, dict[str, object]]:
    """What the script on each node said it saw."""
    return {node: json.loads(text) for node, text in SEEN.findall(output)}


def check_user_run(result: subprocess.CompletedProcess[str], workspace: Path, tmp_path: Path, run_id: str,
                   python: str, kind: str) -> dict[str, object]:
    """The run completed, the script on both nodes ran in the environment without trainpipe and got its secret,
    and the summary and the committed lineage name the environment; returns the summary's training_env."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    seen = seen_by_node(result.stdout + result.stderr)
    assert len(seen) == 2, result.stdout[-3000:]
    for node in seen.values():
        assert node["python"] == python and str(node["torch"]).startswith("2.13.0"), node
        assert node["importable"] == {"trainpipe": False, "infra": False, "prefect": False}, node
        assert node["pythonpath"] is None and node["secret"], "the job's secret reached the script, PYTHONPATH not"
    summary = json.loads((workspace / "runs" / run_id / "summary.json").read_text())
    assert summary["steps"] == 5
    env = summary["training_env"]
    assert env["kind"] == kind and len(env["nodes"]) == 2
    torch_version = next(iter(seen.values()))["torch"]
    assert {node["torch"] for node in env["nodes"].values()} == {torch_version}
    manifest = CheckpointStore(open_store(f"file://{tmp_path}/store/ckpt/{run_id}")).latest()
    assert manifest is not None and manifest.lineage is not None and manifest.lineage.environment is not None
    assert manifest.lineage.environment.torch == torch_version and manifest.lineage.environment.kind == kind
    return env


def user_training(code: Path, **choice: str) -> dict[str, object]:
    return {"code": str(code), "command": ["train.py"], "env": {"PROBE_SECRET_EXPECTED": SECRET},
            "secrets": {"PROBE_SECRET": {"env": "TRAINENV_TEST_SECRET"}}, **choice}


def run_job(tmp_path: Path, workspace: Path, training: dict[str, object], run_id: str,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    dataset = make_dataset(tmp_path / "dataset", tokens=20_000, shard_tokens=10_000)
    config = {"name": "userenv", "cluster": {"provider": "local", "nodes": 2, "procs_per_node": 1,
                                             "verify": {"bench": "off"}},
              "dataset": {"url": dataset}, "checkpoints": {"url": f"file://{tmp_path}/store/ckpt", "keep": 2},
              "training": training}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_HOME": prefect_home(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **(extra_env or {})}
    return run_trainpipe("run", str(path), "--run-id", run_id, env=env)


def test_a_venv_with_torch_and_no_trainpipe_trains_a_user_script_on_two_nodes(
        torch_venv: Path, workspace: Path, tmp_path: Path) -> None:
    before = pip_freeze(torch_venv)
    result = run_job(tmp_path, workspace, user_training(user_project(tmp_path), python=str(torch_venv)), "userenv",
                     {"TRAINENV_TEST_SECRET": SECRET})
    env = check_user_run(result, workspace, tmp_path, "userenv", str(torch_venv), "host")
    assert (env["python"], env["image"]) == (str(torch_venv), None)
    assert pip_freeze(torch_venv) == before, "trainpipe installed something into the user's venv"


def test_a_local_run_in_the_test_image_under_docker(docker_engine: DockerEngine, train_image: TrainImage,
                                                    workspace: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """On local nodes (trying an image before paying for a cluster): the same script in the test image, whose own
    Python has torch and no trainpipe; its digest in the summary, no container or env file left behind."""
    engine_env(docker_engine, monkeypatch)
    result = run_job(tmp_path, workspace, user_training(user_project(tmp_path), image=train_image.reference,
                                                        engine="docker"), "indocker",
                     {"TRAINENV_TEST_SECRET": SECRET})
    env = check_user_run(result, workspace, tmp_path, "indocker", f"{VENV}/bin/python3", "container")
    assert (env["image"], env["digest"]) == (train_image.reference, train_image.id)
    assert docker_engine.cli("ps", "--all", "--quiet").stdout == "", "a container outlived the run"
    assert not list(workspace.rglob(".env-*")), "an env file (the secrets) outlived its container"


def test_an_interpreter_without_torch_fails_at_verify_in_one_line_and_gets_nothing_installed(
        bare_venv: Path, workspace: Path, tmp_path: Path) -> None:
    code = user_project(tmp_path)
    before = pip_freeze(bare_venv)
    result = run_job(tmp_path, workspace, {"code": str(code), "command": ["train.py"], "python": str(bare_venv)},
                     "notorch")
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if "cannot import torch" in line]
    assert lines, result.stderr[-3000:]
    line = lines[-1]
    assert f"python {bare_venv} cannot import torch" in line and "No module named 'torch'" in line
    assert "set training.python to an interpreter with torch, or training.image" in line and "node-" in line
    summary = json.loads((workspace / "runs" / "notorch" / "summary.json").read_text())
    assert summary["status"] == "failed" and "train" not in summary["phases"] and "stage" not in summary["phases"]
    assert pip_freeze(bare_venv) == before, "nothing is installed into the training interpreter"


# -- the command lines -------------------------------------------------------------------------------------------


def _container(tmp_path: Path, gpus: bool = False, engine: str = "docker") -> TrainingEnvironment:
    node = tmp_path / "node"
    return TrainingEnvironment(kind=EnvironmentKind.CONTAINER, image="nvcr.io/nvidia/pytorch:24.12-py3",
                               engine=engine, mounts=(str(node), str(tmp_path / "scratch")), gpus=gpus,
                               node_dir=str(node), name="trainpipe-c-n0")


ENVIRON = {"PATH": "/usr/bin", "HOME": "/root", "PYTHONPATH": "/agent/src", "TRAINPIPE_DATA_DIR": "/w/data",
           "HF_TOKEN": SECRET, "MULTILINE_KEY": f"-----BEGIN-----\n{SECRET}\n-----END-----", "AGENT_ONLY_THING": "x"}
NAMES = ("TRAINPIPE_DATA_DIR", "HF_TOKEN", "MULTILINE_KEY")


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_a_container_command_line_has_the_host_network_gpus_mounts_and_no_secret(tmp_path: Path,
                                                                                  engine: str) -> None:
    environment = _container(tmp_path, gpus=True, engine=engine)
    inv = invocation(environment, ["/launcher.py", "torchrun", "--nnodes", "2"], command="torchrun",
                     cwd=str(tmp_path / "node" / "code"), environ=ENVIRON, env_names=NAMES,
                     extra={LINE_ENV: event_line(NodeEvent.RANKS_EXITED)})
    argv = inv.argv
    assert argv[:5] == [engine, "run", "--rm", "-i", "--sig-proxy=true"]
    assert argv[argv.index("--name") + 1] == inv.container and inv.container.startswith("trainpipe-c-n0-torchrun-")
    for pair in (["--network", "host"], ["--ipc", "host"], ["--ulimit", "memlock=-1:-1"],
                 ["-w", str(tmp_path / "node" / "code")], ["--env-file", str(inv.env_file)],
                 ["-v", f"{tmp_path / 'node'}:{tmp_path / 'node'}"], ["--env", "MULTILINE_KEY"]):
        assert any(argv[i:i + 2] == pair for i in range(len(argv))), (pair, argv)
    gpus = ["--gpus", "all"] if engine == "docker" else ["--device", "nvidia.com/gpu=all"]
    assert any(argv[i:i + 2] == gpus for i in range(len(argv)))
    assert any(argv[i:i + 2] == ["--user", f"{os.getuid()}:{os.getgid()}"] for i in range(len(argv))) or (
        engine == "podman" and os.getuid() != 0 and "keep-id" in argv)
    image_at = argv.index(environment.image or "")
    assert argv[image_at:] == [environment.image, "python3", "/launcher.py", "torchrun", "--nnodes", "2"]
    assert all(SECRET not in part for part in argv), "a secret value on the command line"
    assert inv.env_file is not None and stat.S_IMODE(inv.env_file.stat().st_mode) == 0o600
    lines = inv.env_file.read_text().splitlines()
    assert f"HF_TOKEN={SECRET}" in lines and "TRAINPIPE_DATA_DIR=/w/data" in lines
    assert f"{LINE_ENV}={event_line(NodeEvent.RANKS_EXITED)}" in lines
    assert not any(line.startswith(("PYTHONPATH=", "AGENT_ONLY_THING=", "MULTILINE_KEY=")) for line in lines)
    assert inv.env["MULTILINE_KEY"] == ENVIRON["MULTILINE_KEY"], "a multi-line value goes by name, from the client"
    assert inv.cleanup == [[engine, "rm", "-f", inv.container]]


def test_a_container_without_gpus_gets_none_and_infiniband_only_with_them(tmp_path: Path) -> None:
    environment = _container(tmp_path)
    env_file, inline = write_env_file(tmp_path / "node", {"A": "1"})
    argv = container_argv("docker", environment, "n", env_file, inline, "/w", ["x"], "node-0", 1000, 1000,
                          infiniband=True)
    assert "--gpus" not in argv and "/dev/infiniband" not in argv and "--ulimit" not in argv, "gloo needs no memlock"
    assert argv[argv.index("--label") + 1] == "trainpipe.node=node-0"
    with_gpus = container_argv("docker", _container(tmp_path, gpus=True), "n", env_file, inline, "/w", ["x"], None,
                               1000, 1000, infiniband=True)
    assert with_gpus[with_gpus.index("/dev/infiniband") - 1] == "--device" and "--label" not in with_gpus


def test_a_host_command_line_is_the_interpreter_without_the_agents_import_path(tmp_path: Path) -> None:
    environment = TrainingEnvironment(python="/opt/conda/envs/train/bin/python", node_dir=str(tmp_path))
    inv = invocation(environment, ["/launcher.py", "exec", "bash", "-c", "pip list"], command="exec", cwd=None,
                     environ={**ENVIRON, "PATH": f"{Path(sys.prefix) / 'bin'}:/usr/bin"})
    assert inv.argv == ["/opt/conda/envs/train/bin/python", "/launcher.py", "exec", "bash", "-c", "pip list"]
    assert inv.env_file is None and inv.container is None and inv.cleanup == []
    assert "PYTHONPATH" not in inv.env and inv.env["HF_TOKEN"] == SECRET, "secrets in the environment, not argv"
    assert inv.env["PATH"] == "/opt/conda/envs/train/bin:/usr/bin", "its own bin first, the agent's venv gone"
    assert all(SECRET not in part for part in inv.argv)


def test_the_job_chooses_one_environment_in_one_line() -> None:
    from infra.job.spec import ConfigError, parse_job

    base = {"name": "x", "dataset": {"url": "/tmp/x"}, "checkpoints": {"url": "/tmp/c"}}
    with pytest.raises(ConfigError, match="name one training environment"):
        parse_job({**base, "training": {"command": ["t.py"], "image": "img:1", "python": "/usr/bin/python3"}})
    with pytest.raises(ConfigError, match="engine podman without image"):
        parse_job({**base, "training": {"command": ["t.py"], "engine": "podman"}})


# -- the lifeline ------------------------------------------------------------------------------------------------


SLEEPER = """
import os, signal, sys, time
if sys.argv[2:] == ["deaf"]:  # a rank hung at exit: deaf to the stop torchrun hands on
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1] + ".tmp", "w") as handle:
    handle.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""
DEAF_GRACE_S = 2.0
TORCHRUN_OWN_GRACE_S = 30.0  # torchrun's agent SIGKILLs its ranks this long after passing a stop on


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def free_port() -> Iterator[int]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    yield port


@contextlib.contextmanager
def sleeper_under_an_agent(torch_venv: Path, tmp_path: Path, port: int, *script_args: str,
                           stop_grace_s: float = LAUNCHER_STOP_GRACE_S
                           ) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`python -m infra.node torchrun` (what a trainer is) of one rank that sleeps: the agent and the rank's pid."""
    script, pid_file = tmp_path / "sleeper.py", tmp_path / "rank.pid"
    script.write_text(SLEEPER)
    request = TorchrunRequest(training_env=TrainingEnvironment(python=str(torch_venv), node_dir=str(tmp_path)),
                              nnodes=1, nproc_per_node=1, node_rank=0, master_addr="127.0.0.1", master_port=port,
                              stop_grace_s=stop_grace_s, script=(str(script), str(pid_file), *script_args))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    agent = subprocess.Popen(request.command_line(sys.executable), env=request.environment(env), cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(pid_file.exists, 120, "the rank started")
        yield agent, int(pid_file.read_text())
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_a_killed_agent_leaves_no_rank_running(torch_venv: Path, tmp_path: Path, free_port: int) -> None:
    with sleeper_under_an_agent(torch_venv, tmp_path, free_port) as (agent, rank):
        launcher = [p for p in psutil.Process(agent.pid).children()]
        assert launcher and "torchrun" in launcher[0].cmdline(), "the agent started the launcher in torchrun mode"
        assert REQUEST_ENV not in psutil.Process(rank).environ(), "the agent's request stays the agent's"
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        wait_for(lambda: _gone(rank), 60, "the rank stopped after its agent was killed")
        wait_for(lambda: _gone(launcher[0].pid), 60, "the launcher exited")


def test_a_rank_deaf_to_a_stop_is_killed_after_the_requests_grace_not_torchruns(
        torch_venv: Path, tmp_path: Path, free_port: int) -> None:
    """SIGTERM to a trainer: torchrun hands it to its ranks (each in a session of its own) and would wait 30 s for
    one that ignores it; the launcher kills it after the request's grace, so the trainer ends within the bound the
    orchestrator gives it and leaves no rank behind (before: 4 trainers took 40 s against a 35 s bound)."""
    with sleeper_under_an_agent(torch_venv, tmp_path, free_port, "deaf", stop_grace_s=DEAF_GRACE_S) as (agent, rank):
        agent.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        wait_for(lambda: _gone(rank), TORCHRUN_OWN_GRACE_S / 2, "the deaf rank killed after the request's grace")
        agent.wait(TORCHRUN_OWN_GRACE_S / 2)
        print(f"figures: a rank deaf to SIGTERM gone {time.monotonic() - stopped:.1f}s after the stop "
              f"(grace {DEAF_GRACE_S:g}s; torchrun's own: {TORCHRUN_OWN_GRACE_S:g}s)")
        assert agent.returncode == 128 + signal.SIGTERM


def test_a_killed_agent_leaves_no_container_running(docker_engine: DockerEngine, train_image: TrainImage,
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same lifeline through the engine: the client's stdin closes with the agent, the launcher (PID 1 of the
    container) stops its command and exits, and --rm removes the container."""
    engine_env(docker_engine, monkeypatch)
    node = tmp_path / "node"
    node.mkdir()
    pid_file = node / "cmd.pid"
    environment = TrainingEnvironment(kind=EnvironmentKind.CONTAINER, image=train_image.reference, engine="docker",
                                      mounts=(str(node),), node_dir=str(node), name="lifeline")
    request = ExecRequest(argv=("python3", "-c", SLEEPER, str(pid_file)), training_env=environment, cwd=str(node))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = tmp_path / "agent.log"
    with log.open("w") as out:
        agent = subprocess.Popen(request.command_line(sys.executable), env=request.environment(env), cwd=tmp_path,
                                 stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: pid_file.exists() or agent.poll() is not None, 180, "the command started in its container")
        assert agent.poll() is None, log.read_text()[-2000:]
        assert docker_engine.cli("ps", "--quiet").stdout.strip(), "no container running"
        assert not list(node.glob(".env-*")), "the env file goes once the container started"
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        wait_for(lambda: docker_engine.cli("ps", "--all", "--quiet").stdout.strip() == "", 90,
                 "the container gone after its agent was killed")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
