"""The command line that runs a program in the training environment (infra.node.protocol.TrainingEnvironment).

The agent runs on the host, in its own venv; the program (the launcher, infra/workload/launcher.py, and what it
starts) runs in the user's environment:

- HOST: [python, launcher, ...] with the agent's environment minus what makes it the agent's (its venv on PATH,
  PYTHONPATH): the user's interpreter never sees trainpipe.
- CONTAINER: `<engine> run --rm -i --name N --network host --ipc host [--ulimit memlock=-1, GPUs, InfiniBand]
  -v DIR:DIR... --env-file F -w CWD --user UID:GID IMAGE python launcher ...`. The variables travel in the env file
  (0600, in the node dir, removed by the caller once the container started), never in argv; a value a file cannot
  hold (a newline) goes as `--env NAME`, its value taken from the engine client's own environment.
- PYXIS, OCI (Slurm): srun around the launcher (infra/node/slurm_container.py); srun carries the environment
  (--export=ALL), as for HOST.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from infra.node.processes import CLUSTER_TAG, NODE_TAG
from infra.node.protocol import EnvironmentKind, TrainingEnvironment
from infra.workload import launcher

LAUNCHER_SOURCE = Path(launcher.__file__)
ENGINES = ("docker", "podman")
NODE_LABEL = "trainpipe.node"  # on every container: the node's name, for whoever lists a node's containers
CONTAINERS_DIR = "trainenv/containers"  # under the node dir: one record per container started and not yet removed
# Variables that make an environment the agent's: the training environment never gets them from the agent.
AGENT_ONLY = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTHONNOUSERSITE")
INFINIBAND = "/dev/infiniband"


class TrainEnvError(RuntimeError):
    """The training environment cannot be entered on this node (no engine, no Slurm container support)."""


@dataclass(frozen=True)
class Invocation:
    """How to start a program in the training environment: argv, the process's own environment, and what to clean
    up (the env file once the container started, the container at the end)."""

    argv: list[str]
    env: dict[str, str]
    env_file: Path | None = None
    container: str | None = None
    engine: str | None = None
    cleanup: list[list[str]] = field(default_factory=list)  # commands that remove what the program left


def resolve_engine(environment: TrainingEnvironment) -> str:
    """The node's container engine: the one named, or (auto) docker if installed, else podman."""
    if environment.engine != "auto":
        return environment.engine
    for engine in ENGINES:
        if shutil.which(engine):
            return engine
    raise TrainEnvError("no container engine on this node (docker or podman): install one, or train without "
                            "training.image")


def node_dir(environment: TrainingEnvironment) -> Path:
    return Path(environment.node_dir or tempfile.gettempdir())


def install_launcher(environment: TrainingEnvironment) -> str:
    """The launcher's source in the node dir (named by its content: a second command reuses it), its path."""
    source = LAUNCHER_SOURCE.read_bytes()
    return install_script(environment, "rank_launcher", source)


def install_script(environment: TrainingEnvironment, stem: str, source: bytes) -> str:
    import hashlib

    folder = node_dir(environment) / "trainenv"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}-{hashlib.sha256(source).hexdigest()[:12]}.py"
    if not path.is_file() or path.read_bytes() != source:
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        scratch.write_bytes(source)
        scratch.chmod(0o644)  # read by the container's user too
        os.replace(scratch, path)
    return str(path)


def host_environment(environ: Mapping[str, str], environment: TrainingEnvironment,
                     own_bin_first: bool = True) -> dict[str, str]:
    """The agent's environment as the user's interpreter should see it: without the agent's venv and import path,
    and with the training interpreter's own bin dir first on PATH (so `python` and `pip` in a setup mean it)."""
    env = {k: v for k, v in environ.items() if k not in AGENT_ONLY}
    agent_bin = str(Path(sys.prefix) / "bin")
    path = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p != agent_bin]
    if own_bin_first and os.sep in environment.python:
        path.insert(0, str(Path(environment.python).parent))
    env["PATH"] = os.pathsep.join(dict.fromkeys(path))
    return env


def container_name(environment: TrainingEnvironment, command: str) -> str:
    raw = f"{environment.name}-{command}-{secrets.token_hex(4)}"
    return re.sub(r"[^A-Za-z0-9_.-]", "-", raw).lstrip("-_.") or f"trainpipe-{secrets.token_hex(4)}"


def container_variables(environ: Mapping[str, str], env_names: tuple[str, ...],
                        extra: Mapping[str, str]) -> dict[str, str]:
    """What a container gets: the named variables, the node's tags (the watchdog finds its processes by them) and
    the launcher's own; HOME set for a user the image does not know."""
    wanted = {name: environ[name] for name in (*env_names, CLUSTER_TAG, NODE_TAG) if name in environ}
    return {"HOME": "/tmp", **wanted, **extra}


def write_env_file(folder: Path, variables: Mapping[str, str]) -> tuple[Path, list[str]]:
    """The variables in an engine env file (NAME=VALUE lines, mode 0600 from its creation); returns the file and
    the names a line cannot hold (a newline in the value), which go as `--env NAME` from the client's environment."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".env-", dir=folder)  # mkstemp creates it 0600
    inline = []
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        for key, value in variables.items():
            if "\n" in value or "\r" in value:
                inline.append(key)
            else:
                handle.write(f"{key}={value}\n")
    return Path(name), inline


def container_argv(engine: str, environment: TrainingEnvironment, name: str, env_file: Path, inline: list[str],
                   cwd: str, program: list[str], node_tag: str | None, uid: int, gid: int,
                   infiniband: bool) -> list[str]:
    assert environment.image is not None
    argv = [engine, "run", "--rm", "-i", "--sig-proxy=true", "--name", name, "--network", "host", "--ipc", "host"]
    if node_tag:
        argv += ["--label", f"{NODE_LABEL}={node_tag}"]
    if environment.gpus:
        # Unlimited locked memory is what NCCL over RDMA needs; only then: raising the hard limit takes
        # CAP_SYS_RESOURCE, which a CPU node's (or a sandbox's) root may lack, and gloo does not use it.
        argv += ["--ulimit", "memlock=-1:-1"]
        argv += ["--gpus", "all"] if engine == "docker" else ["--device", "nvidia.com/gpu=all"]
        if infiniband:
            argv += ["--device", INFINIBAND]
    for mount in environment.mounts:
        argv += ["-v", f"{mount}:{mount}"]
    argv += ["--env-file", str(env_file)]
    for key in inline:
        argv += ["--env", key]
    # As the agent's user, so what the training writes in the node's dir stays the agent's to delete; rootless
    # podman maps that user with keep-id instead (a plain --user there would be one of its subordinate ids).
    argv += ["--userns", "keep-id"] if engine == "podman" and uid != 0 else ["--user", f"{uid}:{gid}"]
    argv += ["-w", cwd, environment.image, environment.python, *program]
    return argv


def invocation(environment: TrainingEnvironment, program: list[str], *, command: str, cwd: str | None,
               environ: Mapping[str, str], env_names: tuple[str, ...] = (),
               extra: Mapping[str, str] | None = None) -> Invocation:
    """How to run `python <program>` in the environment (program: the launcher and its arguments); environ: the
    agent's environment (the job's variables and secrets among it), extra: the launcher's own variables."""
    extra = dict(extra or {})
    if environment.kind is EnvironmentKind.HOST:
        return Invocation([environment.python, *program], {**host_environment(environ, environment), **extra})
    if environment.kind is EnvironmentKind.CONTAINER:
        engine = resolve_engine(environment)
        name = container_name(environment, command)
        env_file, inline = write_env_file(node_dir(environment), container_variables(environ, env_names, extra))
        record = container_record(environment, name)
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(engine + "\n")
        argv = container_argv(engine, environment, name, env_file, inline, cwd or environment.node_dir, program,
                              environ.get(NODE_TAG), os.getuid(), os.getgid(), Path(INFINIBAND).exists())
        return Invocation(argv, {**environ, **{k: v for k, v in extra.items() if k in inline}}, env_file, name,
                          engine, [[engine, "rm", "-f", name]])
    from infra.node.slurm_container import SlurmContainerError, container_prefix

    # The agent is a step of the allocation on its node: the training is one more step on that same node.
    node = environ.get("SLURMD_NODENAME") or environ.get(NODE_TAG) or os.uname().nodename
    try:
        prefix = container_prefix(environment, node, cwd)
    except SlurmContainerError as exc:
        raise TrainEnvError(str(exc)) from None
    env = host_environment(environ, environment, own_bin_first=False)
    return Invocation([*prefix, environment.python, *program], {**env, **extra})



def container_record(environment: TrainingEnvironment, name: str) -> Path:
    """Where the agent notes a container it started (its engine, in the file named after it), until it removed it."""
    return node_dir(environment) / CONTAINERS_DIR / name


def remove_node_containers(workdir: Path, timeout_s: float = 60.0) -> int:
    """Remove every container the node's agents started and have not removed (their records under workdir): what a
    lease expiry leaves once the node's processes are gone, since an engine's containers are not its client's
    children. Returns how many."""
    records = sorted((workdir / CONTAINERS_DIR).glob("*")) if (workdir / CONTAINERS_DIR).is_dir() else []
    for record in records:
        try:
            subprocess.run([record.read_text().strip(), "rm", "-f", record.name], capture_output=True,
                           timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        record.unlink(missing_ok=True)
    return len(records)
