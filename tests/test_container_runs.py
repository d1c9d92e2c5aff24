"""Training in a container image (issue 37) with real engines: this session's dockerd and rootful podman
(tests/containers.py), the test image (its own Python and torch, no trainpipe), and the OCI bundle Slurm runs.

First the engines and the image themselves (what the end-to-end runs stand on), then whole runs on SSH nodes whose
own Python has neither trainpipe nor torch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import REPO, prefect_home, run_trainpipe
from containers import (
    IMAGE_PATH,
    VENV,
    DockerEngine,
    PodmanEngine,
    TrainImage,
    _run,
    docker_engine_at,
    forward_policy,
)
from sshd import SshServer, ssh_servers

from infra.compute.access.ssh.connection import close_connections

IMPORT_TORCH = "import sys, torch; print(sys.prefix, torch.__version__)"


def _nft_ruleset() -> str:
    return _run(["nft", "list", "ruleset"]).stdout


def test_dockerd_leaves_the_hosts_forwarding_alone() -> None:
    """A dockerd that makes its bridge sets the FORWARD policy to DROP (and turns ip_forward on), which cuts the
    netns clusters' traffic; the test engine runs containers on the host network and changes neither."""
    before = (forward_policy(), _nft_ruleset(), Path("/proc/sys/net/ipv4/ip_forward").read_text())
    with docker_engine_at(Path(f"/tmp/tp-dockerd-{uuid.uuid4().hex[:8]}")) as engine:
        engine.cli("info")
        during = (forward_policy(), _nft_ruleset(), Path("/proc/sys/net/ipv4/ip_forward").read_text())
    after = (forward_policy(), _nft_ruleset(), Path("/proc/sys/net/ipv4/ip_forward").read_text())
    assert during == before and after == before
    assert not engine.root.exists(), "the engine's data outlived it"


def _timed_run(engine: DockerEngine | PodmanEngine, *args: str) -> tuple[str, float]:
    started = time.monotonic()
    out = engine.cli("run", "--rm", "--network", "host", *args).stdout
    return out, time.monotonic() - started


def test_the_image_has_its_own_python_and_torch_in_docker(docker_engine: DockerEngine,
                                                          train_image: TrainImage) -> None:
    out, seconds = _timed_run(docker_engine, train_image.reference, "python", "-c", IMPORT_TORCH)
    assert out.split() == [VENV, "2.13.0+cpu"], out
    env = docker_engine.cli("image", "inspect", "--format", "{{json .Config.Env}}", train_image.reference).stdout
    assert f"PATH={IMAGE_PATH}" in json.loads(env)
    missing = docker_engine.cli("run", "--rm", "--network", "none", train_image.reference, "python", "-c",
                                "import infra.node", check=False)
    assert missing.returncode != 0 and "No module named 'infra'" in missing.stderr, "a user's image, not trainpipe's"
    origin = f"built in {train_image.build_seconds:.1f} s" if train_image.build_seconds else "from the cache"
    timings = {name: round(value, 1) for name, value in train_image.timings.items()}
    print(f"\ntest image {train_image.reference} ({train_image.id[:19]}): {origin} {timings}; "
          f"docker run python -c 'import torch': {seconds:.2f} s")


def test_the_same_image_runs_in_podman_with_its_configuration(podman_engine: PodmanEngine,
                                                              podman_train_image: TrainImage) -> None:
    out, seconds = _timed_run(podman_engine, podman_train_image.reference, "python", "-c", IMPORT_TORCH)
    assert out.split() == [VENV, "2.13.0+cpu"], out
    limits = podman_engine.cli("run", "--rm", "--network", "host", podman_train_image.reference, "bash", "-c",
                               "ulimit -n; ulimit -u").stdout.split()
    assert limits == ["20000", "32768"], "containers.conf's default_ulimits are not in force"
    print(f"\npodman load: {podman_train_image.timings['podman_load_s']:.1f} s; "
          f"podman run python -c 'import torch': {seconds:.2f} s")


def test_the_oci_bundle_runs_under_runc(oci_bundle: Path, tmp_path: Path) -> None:
    """The bundle Slurm's OCI containers get: runc runs the image's Python from it (here with our own args, in a copy
    of its config, as slurmstepd writes the step's)."""
    config = json.loads((oci_bundle / "config.json").read_text())
    config["root"]["path"] = str(oci_bundle / "rootfs")
    config["process"]["args"] = ["python", "-c", IMPORT_TORCH]
    run_bundle = tmp_path / "run"
    run_bundle.mkdir()
    (run_bundle / "config.json").write_text(json.dumps(config))
    name = f"tp-oci-{uuid.uuid4().hex[:8]}"
    try:
        out = _run(["runc", "run", "--bundle", str(run_bundle), name], timeout=120).stdout
    finally:
        _run(["runc", "delete", "--force", name], check=False)
    assert out.split() == [VENV, "2.13.0+cpu"], out


# -- whole runs on SSH nodes whose own Python has neither trainpipe nor torch ---------------------------------------

BARE_PYTHON = "/usr/bin/python3"  # Debian's; the nodes' python is a venv of it with nothing installed
OWN_SCRIPT = REPO / "examples" / "own-script"
RESUMED = re.compile(r"\[tp-[\w-]+-node-(\d)\] node (\d): resum\w* from (\S+) at step (\d+)")


@dataclass
class ContainerHosts:
    key: Path
    servers: list[SshServer]
    node_python: Path  # the hosts' own interpreter: a bare venv
    dataset: Path


@pytest.fixture(scope="module")
def container_hosts(tmp_path_factory: pytest.TempPathFactory, docker_engine: DockerEngine,
                    podman_engine: PodmanEngine) -> Iterator[ContainerHosts]:
    """Two SSH hosts (this machine behind two sshd) whose sessions reach this session's engines the way a node's
    agent finds the node's own: through the environment (DOCKER_HOST; CONTAINERS_CONF and CONTAINERS_STORAGE_CONF)."""
    root = tmp_path_factory.mktemp("container-hosts")
    venv = root / "node-python"
    _run([BARE_PYTHON, "-m", "venv", str(venv)])
    node_python = venv / "bin" / "python"
    for module in ("infra", "torch"):
        imported = _run([str(node_python), "-c", f"import {module}"], check=False, cwd=root)
        assert imported.returncode != 0, f"the node python has {module}: it must be bare for this test"
    dataset = root / "dataset"
    _run([sys.executable, str(OWN_SCRIPT / "make_data.py"), str(dataset)])
    with ssh_servers(root / "sshd", 2, session_env={**docker_engine.env(), **podman_engine.env()}) as (key, servers):
        yield ContainerHosts(key, servers, node_python, dataset)
    close_connections()


def pip_freeze(python: Path) -> str:
    return _run([str(python), "-m", "pip", "freeze", "--all"]).stdout


def digests(engine: DockerEngine | PodmanEngine, image: TrainImage) -> set[str]:
    """What names the image by its content in this engine: its id and, where the engine keeps one (podman's store
    after a load), its repository digest."""
    found = engine.cli("image", "inspect", "--format", "{{json .RepoDigests}}", image.reference).stdout
    return {image.id, *json.loads(found)}


def run_on_hosts(hosts: ContainerHosts, tmp_path: Path, workspace: Path, run_id: str, training: dict[str, object],
                 env: dict[str, str] | None = None, **extra: object) -> subprocess.CompletedProcess[str]:
    """`trainpipe run` of a job with this training section on both hosts."""
    hosts_config = [{"host": server.host, "port": server.port, "user": "root", "key_file": str(hosts.key),
                     "workdir": str(tmp_path / f"nvme-{index}"), "python": str(hosts.node_python),
                     "host_key": server.fingerprint}
                    for index, server in enumerate(hosts.servers)]
    for host in hosts_config:
        Path(host["workdir"]).mkdir()
    config = {"name": run_id,
              "cluster": {"provider": "ssh", "nodes": 2, "procs_per_node": 1, "verify": {"bench": "off"},
                          "ssh": {"hosts": hosts_config}},
              "dataset": {"url": str(hosts.dataset)},
              "checkpoints": {"url": f"file://{tmp_path}/store/ckpt", "format": "dcp", "keep": 2},
              "training": training,
              **extra}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    run_env = {**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_HOME": prefect_home(tmp_path / "prefect"),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **(env or {})}
    return run_trainpipe("run", str(tmp_path / "job.yaml"), "--run-id", run_id, env=run_env)


def run_in_image(hosts: ContainerHosts, tmp_path: Path, workspace: Path, engine: DockerEngine | PodmanEngine,
                 image: TrainImage, run_id: str, command: list[str], **extra: object) -> tuple[dict, str]:
    """`trainpipe run` of the own-script example in the image on both hosts; returns the summary and the output."""
    result = run_on_hosts(hosts, tmp_path, workspace, run_id, {"code": str(OWN_SCRIPT), "command": command,
                                                               "image": image.reference, "engine": engine.name},
                          **extra)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    summary = json.loads((workspace / "runs" / run_id / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["nodes_left"] == 0, summary.get("error")
    training_env = summary["training_env"]
    assert (training_env["kind"], training_env["image"]) == ("container", image.reference), training_env
    assert training_env["digest"] in digests(engine, image), "the summary names the image the nodes ran by content"
    assert {node["torch"] for node in training_env["nodes"].values()} == {"2.13.0+cpu"}, training_env
    print(f"\n{run_id}: {summary['finished_at'] - summary['started_at']:.0f} s, phases "
          f"{ {name: round(float(seconds), 1) for name, seconds in summary['phases'].items()} }")
    return summary, output


def test_a_preempted_run_in_the_image_on_bare_ssh_hosts_resumes_and_leaves_the_node_python_alone(
        container_hosts: ContainerHosts, docker_engine: DockerEngine, train_image: TrainImage, workspace: Path,
        tmp_path: Path) -> None:
    """The user's DDP script in the test image under docker on two SSH hosts whose python has neither trainpipe nor
    torch; node 1 is taken away once mid-run: the run resumes on both nodes from the committed step and completes,
    nothing is installed into the hosts' python, and no container outlives the run."""
    before = pip_freeze(container_hosts.node_python)
    summary, output = run_in_image(
        container_hosts, tmp_path, workspace, docker_engine, train_image, "in-docker",
        ["train.py", "--steps", "160", "--save-every", "20", "--step-delay-s", "0.05"],
        recovery={"max_recoveries": 2, "confirm_s": 2},
        chaos={"preempt": [{"node": 1, "attempt": 0, "at_step": 60}]})
    [recovery] = summary["recoveries"]
    resumed_from = recovery["resumed_from_step"]
    assert resumed_from is not None and resumed_from > 0, "node 1 went before the first commit: nothing to resume"
    # The script itself, in its container on each node, says it resumed from the committed step restored there.
    resumes = {int(node): (int(said), int(step)) for node, said, _path, step in RESUMED.findall(output)}
    assert resumes == {0: (0, resumed_from), 1: (1, resumed_from)}, output[-6000:]
    assert summary["checkpoint_step"] == 160
    assert pip_freeze(container_hosts.node_python) == before, "trainpipe installed something into the node's python"
    assert docker_engine.cli("ps", "--all", "--quiet").stdout == "", "a container outlived the run"


def test_a_run_in_the_image_under_podman_completes(container_hosts: ContainerHosts, podman_engine: PodmanEngine,
                                                   podman_train_image: TrainImage, workspace: Path,
                                                   tmp_path: Path) -> None:
    summary, _output = run_in_image(container_hosts, tmp_path, workspace, podman_engine, podman_train_image,
                                    "in-podman", ["train.py", "--steps", "40", "--save-every", "20"])
    assert summary["checkpoint_step"] == 40 and summary["recoveries"] == []
    assert podman_engine.cli("ps", "--all", "--quiet").stdout == "", "a container outlived the run"


# -- the hosts' own Python for the agent, the training in another interpreter or refused --------------------------


def test_training_python_on_bare_ssh_hosts_trains_and_the_script_cannot_import_trainpipe(
        container_hosts: ContainerHosts, torch_venv: Path, workspace: Path, tmp_path: Path) -> None:
    """training.python naming a venv with torch and no trainpipe, on hosts whose own Python has neither: the agent
    runs from its own env, the script from that venv, and sees neither trainpipe nor infra."""
    from test_training_env import SECRET, seen_by_node, user_project, user_training

    before = pip_freeze(container_hosts.node_python), pip_freeze(torch_venv)
    result = run_on_hosts(container_hosts, tmp_path, workspace, "ssh-python",
                          user_training(user_project(tmp_path), python=str(torch_venv)),
                          env={"TRAINENV_TEST_SECRET": SECRET},
                          checkpoints={"url": f"file://{tmp_path}/store/ckpt", "format": "auto", "keep": 2})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    seen = seen_by_node(output)
    assert len(seen) == 2, output[-3000:]
    for node in seen.values():
        assert node["python"] == str(torch_venv) and node["secret"], node
        assert node["importable"] == {"trainpipe": False, "infra": False, "prefect": False}, node
    summary = json.loads((workspace / "runs" / "ssh-python" / "summary.json").read_text())
    assert (summary["training_env"]["kind"], summary["training_env"]["python"]) == ("host", str(torch_venv))
    assert (pip_freeze(container_hosts.node_python), pip_freeze(torch_venv)) == before, "nothing is installed"


def test_a_node_python_without_torch_and_no_image_fails_at_verify_in_one_line(
        container_hosts: ContainerHosts, workspace: Path, tmp_path: Path) -> None:
    """Neither training.image nor training.python: the hosts' own Python trains, and this one has no torch."""
    before = pip_freeze(container_hosts.node_python)
    result = run_on_hosts(container_hosts, tmp_path, workspace, "ssh-no-torch",
                          {"code": str(OWN_SCRIPT), "command": ["train.py", "--steps", "10"]})
    assert result.returncode == 1, (result.stdout + result.stderr)[-4000:]
    lines = [line for line in result.stderr.splitlines() if "cannot import torch" in line]
    assert lines, result.stderr[-3000:]
    assert f"python {container_hosts.node_python} cannot import torch" in lines[-1], lines[-1]
    assert "set training.python to an interpreter with torch, or training.image" in lines[-1]
    summary = json.loads((workspace / "runs" / "ssh-no-torch" / "summary.json").read_text())
    assert summary["status"] == "failed" and "train" not in summary["phases"]
    assert pip_freeze(container_hosts.node_python) == before, "nothing is installed into the node's python"
