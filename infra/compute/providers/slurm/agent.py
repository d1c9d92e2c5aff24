"""The node agent's own environment on Slurm nodes (infra/compute/access/agent_env.py's pieces, placed for Slurm).

The nodes cannot be copied to one by one (no SSH to them: every node command is a job step), and they share a
filesystem with the login node. So the bundle (the agent's wheel, its dependencies for the nodes' platform, pip's
wheel) is put once, by the login node, in cluster.slurm.agent_bundle_dir, a dir the nodes see at the same path; and
each node makes the venv from it in node-local scratch (cluster.slurm.agent_dir, off NFS as SkyPilot keeps its
runtime), by a job step that runs agent_env's stdlib installer with the nodes' Python (cluster.slurm.python) under an
flock, `.ready` written last. The env is named by the bundle's content and the interpreter, so the next run on that
node finds it ready and installs nothing. Node.python is then the env's interpreter; Node.node_python stays
cluster.slurm.python, the training's default interpreter.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from infra.compute.access import agent_env
from infra.compute.access.agent_env import AgentEnv, AgentEnvError, Bundle, NodePython
from infra.compute.access.remote import Runner
from infra.compute.providers.slurm.login import Login

log = logging.getLogger(__name__)

LOGIN_TIMEOUT_S = 60.0
FIX = "set cluster.slurm.python to one on every node (e.g. /usr/bin/python3.11)"

_put_lock = threading.Lock()  # the nodes of one cluster share a bundle: it is put once


def probe(runner: Runner, python: str, agent_root: str) -> NodePython:
    """The nodes' Python as a job step on runner's node sees it, or AgentEnvError naming the node and the fix."""
    result = runner.run([python, "-c", agent_env.PROBE, agent_root], timeout=agent_env.PROBE_TIMEOUT_S, check=False)
    found = agent_env.json_line(result.output) if result.returncode == 0 else None
    if found is None:
        problem = agent_env.one_line(result.output) or f"exit {result.returncode}"
        raise AgentEnvError(f"{runner.node_name}: cluster.slurm.python '{python}' did not run there ({problem}): "
                            f"{FIX}")
    node = NodePython(**{**found, "version": tuple(found["version"])})
    if node.implementation != "cpython" or node.version[:2] < agent_env.MIN_PYTHON:
        raise AgentEnvError(f"{runner.node_name}: cluster.slurm.python '{python}' is {node.implementation} "
                            f"{'.'.join(map(str, node.version))}, the agent needs CPython >= "
                            f"{agent_env.min_python()}: {FIX}")
    if not node.venv:
        raise AgentEnvError(f"{runner.node_name}: cluster.slurm.python '{python}' cannot make venvs (no venv "
                            "module): install it on the nodes (apt install python3-venv) or " + FIX)
    if node.machine not in agent_env.ARCHITECTURES or node.glibc is None or not node.platforms():
        raise AgentEnvError(f"{runner.node_name}: {node.machine} with {node.libc or 'no glibc'} {node.libc_version}: "
                            "the agent's wheels are built for glibc >= 2.17 on "
                            f"{' or '.join(agent_env.ARCHITECTURES)}: use a partition of such nodes")
    return node


def shared_dir(login: Login, configured: str) -> str:
    """cluster.slurm.agent_bundle_dir with ~ resolved on the login node (the nodes see the same home)."""
    if not configured.startswith("~"):
        return configured
    if not login.remote:
        return os.path.expanduser(configured)
    home = login.run(["sh", "-c", 'printf %s "$HOME"'], timeout=LOGIN_TIMEOUT_S, env={}).stdout.strip()
    if not home.startswith("/"):
        raise AgentEnvError(f"{login.label}: $HOME is '{home}', not a path: set cluster.slurm.agent_bundle_dir to an "
                            "absolute path the login node and the nodes share")
    return home + configured[1:]


def put_bundle(login: Login, bundle: Bundle, directory: str) -> int:
    """The bundle's files the shared dir lacks (or holds with another size), copied there by the login node, each
    whole or not at all; the bytes copied."""
    with _put_lock:
        have = _sizes(login, directory)
        missing = {name: path for name, path in bundle.files.items() if have.get(name) != bundle.size(name)}
        if login.remote and missing:
            runner = login.runner("login")
            for name, path in missing.items():
                runner.put_file(path, f"{directory}/{name}")  # type: ignore[attr-defined]  # an SshRunner
        elif missing:
            Path(directory).mkdir(parents=True, exist_ok=True)
            for name, path in missing.items():
                partial = Path(directory) / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
                shutil.copyfile(path, partial)
                partial.replace(Path(directory) / name)
        return sum(bundle.size(name) for name in missing)


def _sizes(login: Login, directory: str) -> dict[str, int]:
    if not login.remote:
        folder = Path(directory)
        return {path.name: path.stat().st_size for path in folder.glob("*.whl")} if folder.is_dir() else {}
    listed = login.run(["sh", "-c", 'cd "$1" 2>/dev/null && stat -c "%s %n" -- *.whl 2>/dev/null; true', "sizes",
                        directory], timeout=LOGIN_TIMEOUT_S, env={})
    return {name: int(size) for size, _, name in (line.partition(" ") for line in listed.stdout.splitlines())
            if size.isdigit()}


def ensure_agent(runner: Runner, python: str, agent_root: str, login: Login, bundle_root: str) -> AgentEnv:
    """The agent's environment on runner's node, made from python in agent_root when the node lacks it."""
    started = time.monotonic()
    node = probe(runner, python, agent_root)
    bundle = agent_env.agent_bundle(node.version[:2], node.machine, tuple(node.platforms()))
    bundle_dir = f"{bundle_root}/{bundle.key}"
    copied = put_bundle(login, bundle, bundle_dir)
    key = agent_env.env_key(bundle, node)
    status = agent_env.installer(runner, python, "install", [
        node.root, key, bundle_dir, f"{agent_env.AGENT_DIST}=={bundle.agent_version}",
        str(agent_env.INSTALL_TIMEOUT_S)])
    agent = AgentEnv(python=status["python"], key=key, installed=status["installed"],
                     seconds=round(time.monotonic() - started, 3), install_seconds=status["seconds"],
                     bytes=status["bytes"], copied_bytes=copied, node_python=node.executable,
                     node_python_version=".".join(map(str, node.version)))
    log.info("%s: agent %s at %s (%.1f MB) in %.1fs", runner.node_name,
             "installed" if agent.installed else "ready", agent.python, agent.bytes / 1e6, agent.seconds)
    return agent


def ensure_agents(runners: Sequence[Runner], python: str, agent_roots: Sequence[str], login: Login,
                  bundle_dir: str) -> list[AgentEnv]:
    """Every node's agent environment, the nodes in parallel; the first failure raised once all have ended."""
    bundle_root = shared_dir(login, bundle_dir)
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(runners))), thread_name_prefix="slurm-agent") as pool:
        futures = [pool.submit(ensure_agent, runner, python, root, login, bundle_root)
                   for runner, root in zip(runners, agent_roots, strict=True)]
    return [future.result() for future in futures]
