"""The node agent's own environment on a node: a venv made from the node's Python, holding only what
`python -m infra.node COMMAND` imports, so nothing of trainpipe ever lands in the interpreter that trains.

On the orchestrator: the agent's wheel (`trainpipe-agent`, the `infra` package with the `agent` extra of
pyproject.toml as its dependencies) is written from the source this process runs (a checkout or an installed
trainpipe), and the bundle for a node's platform (that wheel, its dependencies as binary wheels for the node's
CPython, architecture and glibc, and pip's own wheel) is downloaded once and kept under
~/.cache/trainpipe/agent-wheels/<key> by content, so the next run downloads nothing. An orchestrator that cannot reach
a package index names a dir of pre-downloaded wheels in TRAINPIPE_AGENT_WHEELS.

On the node (stdlib snippets run by its Python): the bundle's files the node lacks go to
<agent_root>/bundles/<bundle key>/, fetched from the BundleSources ensure_agent is given, in order (a cloud cluster's
head over the cluster network: infra.compute.access.agent_fanout; the run's store prefix by presigned URLs:
infra.compute.access.agent_store), each checked against the bundle's sha256 (Bundle.hashes); what no source delivers
(a node of another bundle, a fetch that failed: logged with its reason) is copied from the orchestrator over SFTP.
AgentEnv.copied_bytes counts what the orchestrator sent, peer_bytes what came from a head, store_bytes what came from
the store. The env is made at
<agent_root>/<env key> under an flock: `python -m venv --without-pip`, then pip run from its bundled wheel, `--no-index
--find-links <bundle>`, asking no package index. `.ready` is written last; an env without it is the leftover of an
installer that died and is made again. The env key covers the bundle's files and the node's interpreter, so the next run
on that node (or another node on the same machine) finds it ready and installs nothing.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import uuid
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import infra
from infra.compute.access.remote import RemoteError

if TYPE_CHECKING:  # paramiko stays out of the job spec's import (the ssh config reads DEFAULT_AGENT_DIR)
    from infra.compute.access.ssh.runner import SshRunner

log = logging.getLogger(__name__)

PROJECT = "trainpipe"
AGENT_DIST = "trainpipe-agent"
AGENT_EXTRA = "agent"  # the optional extra of pyproject.toml that lists what the agent imports
DEFAULT_AGENT_DIR = "~/.trainpipe/agent"  # on the node, like SkyPilot's ~/skypilot-runtime: off the job's workdir
AGENT_LINK = "agent-env"  # in a node's workdir: the link to its agent's env, so Node.python is known before bootstrap
AGENT_WHEELS_ENV = "TRAINPIPE_AGENT_WHEELS"
# The agent's modules use 3.11's StrEnum (infra/node/protocol.py, events.py), datetime.UTC and hashlib.file_digest.
MIN_PYTHON = (3, 11)
# Since glibc 2.17 (manylinux2014) every wheel of the agent's dependencies is built; newer tags where the node has them.
MANYLINUX_TAGS = ((2, 17, ("manylinux2014", "manylinux_2_17")), (2, 28, ("manylinux_2_28",)))
ARCHITECTURES = ("x86_64", "aarch64")
PROBE_TIMEOUT_S = 120.0
DOWNLOAD_TIMEOUT_S = 900.0
INSTALL_TIMEOUT_S = 900.0  # an flock waiter waits for the installer ahead of it, within this bound
WHEEL_DATE = (2020, 1, 1, 0, 0, 0)  # fixed timestamps: the same source always makes the same wheel bytes


class AgentEnvError(RemoteError):
    """The agent's environment cannot be made on a node (or its wheels cannot be had); the message says the fix."""


# -- the node's side (stdlib only, run by the node's Python) ----------------------------------------------------------

# argv[1]: the agent root as configured (may start with ~). Always prints one JSON line.
PROBE = r"""
import json, os, platform, sys
try:
    import venv
    has_venv = True
except Exception:
    has_venv = False
libc, libc_version = platform.libc_ver()
print(json.dumps({"version": list(sys.version_info[:3]), "implementation": sys.implementation.name,
                  "machine": platform.machine(), "libc": libc, "libc_version": libc_version,
                  "executable": sys.executable,
                  "base": os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable),
                  "root": os.path.abspath(os.path.expanduser(sys.argv[1])), "venv": has_venv}))
"""

# argv: mode (status | install), agent root, env key, bundle dir, requirement, lock wait s, [link]. status prints the
# bundle files the node has (have: {name: size}), with the env's record when it is ready (a head whose env is ready
# still tells which files it could serve); install makes the env under the lock.
# link: a symlink made (atomically replaced) to the ready env, whose bin/python is then the record's python.
INSTALLER = r"""
import fcntl, json, os, shutil, subprocess, sys, time

mode, root, key, bundle, requirement, wait_s = sys.argv[1:7]
link = sys.argv[7] if len(sys.argv) > 7 else ""
env = os.path.join(root, key)
ready = os.path.join(env, ".ready")

def answer(record, code=0):
    print(json.dumps(record))
    sys.exit(code)

def bundle_files():
    if not os.path.isdir(bundle):
        return {}
    return {n: os.path.getsize(os.path.join(bundle, n)) for n in os.listdir(bundle) if n.endswith(".whl")}

def made(installed):
    with open(ready) as handle:
        record = {**json.load(handle), "ready": True, "installed": installed}
    if mode == "status":
        record["have"] = bundle_files()
    if link:
        os.makedirs(os.path.dirname(link), exist_ok=True)
        tmp = f"{link}.{os.getpid()}.tmp"
        os.symlink(env, tmp)
        os.replace(tmp, link)
        record["python"] = os.path.join(link, "bin", "python")
    answer(record)

def usage(path):
    total = 0
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
            except OSError:
                pass
    return total

if os.path.exists(ready):
    made(False)
if mode == "status":
    answer({"ready": False, "have": bundle_files()})

started = time.monotonic()
os.makedirs(root, exist_ok=True)
lock = open(os.path.join(root, key + ".lock"), "a")
deadline = started + float(wait_s)
while True:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        break
    except BlockingIOError:
        if time.monotonic() > deadline:
            answer({"error": f"another installer held {lock.name} for {float(wait_s):.0f}s"}, 3)
        time.sleep(0.2)
if os.path.exists(ready):  # made by the installer this one waited for
    made(False)
# Made in place, not renamed into place: pip writes the env's own path into what it installs.
shutil.rmtree(env, ignore_errors=True)
step = subprocess.run([sys.executable, "-m", "venv", "--without-pip", env], capture_output=True, text=True)
if step.returncode != 0:
    answer({"error": "venv: " + (step.stderr or step.stdout).strip()[-400:]}, 4)
pip = sorted(n for n in os.listdir(bundle) if n.startswith("pip-") and n.endswith(".whl"))[-1]
# The node's own pip configuration and Python paths stay out: only the bundle is asked.
clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
clean["PIP_CONFIG_FILE"] = os.devnull
python = os.path.join(env, "bin", "python")
step = subprocess.run([python, os.path.join(bundle, pip, "pip"), "install", "--no-index", "--find-links", bundle,
                       "--no-cache-dir", "--disable-pip-version-check", "--no-input", "--no-warn-script-location",
                       "-q", requirement], capture_output=True, text=True, env=clean)
if step.returncode != 0:
    answer({"error": "pip install: " + (step.stderr or step.stdout).strip()[-400:]}, 5)
record = {"python": python, "seconds": round(time.monotonic() - started, 3), "bytes": usage(env)}
with open(ready + ".tmp", "w") as handle:
    json.dump(record, handle)
os.replace(ready + ".tmp", ready)
made(True)
"""


@dataclass(frozen=True)
class NodePython:
    """What the node's interpreter is, from PROBE."""

    version: tuple[int, int, int]
    implementation: str
    machine: str
    libc: str
    libc_version: str
    executable: str
    base: str  # the real interpreter behind it (a venv's base): the agent's env is made from it
    root: str  # the agent root, ~ expanded on the node
    venv: bool

    @property
    def glibc(self) -> tuple[int, int] | None:
        found = re.match(r"(\d+)\.(\d+)", self.libc_version) if self.libc == "glibc" else None
        return (int(found.group(1)), int(found.group(2))) if found else None

    def platforms(self) -> list[str]:
        glibc = self.glibc or (0, 0)
        return [f"{tag}_{self.machine}" for major, minor, tags in MANYLINUX_TAGS if glibc >= (major, minor)
                for tag in tags]


@dataclass(frozen=True)
class AgentEnv:
    """The agent's environment on one node."""

    python: str  # what runs `python -m infra.node`: <link>/bin/python, or <agent_root>/<key>/bin/python
    key: str
    installed: bool  # made by this call; False when it was ready already (made by an earlier run or another node)
    seconds: float  # this call's, from probing the node to the agent ready
    install_seconds: float  # what making the env took, when it was made
    bytes: int  # the env's disk usage (du)
    copied_bytes: int  # bundle bytes this call copied to the node from the orchestrator
    node_python: str  # the interpreter it was made from, as the node names it (sys.executable)
    node_python_version: str
    peer_bytes: int = 0  # bundle bytes the node fetched from its cluster's head (a BundleSource), not from here
    store_bytes: int = 0  # bundle bytes the node fetched from the run's store prefix


@dataclass(frozen=True)
class Fetched:
    """What a node took from a BundleSource: the bytes verified and in place, and why it stopped short, if it did."""

    bytes: int
    seconds: float
    error: str | None = None


class BundleSource(Protocol):
    """Where a node fetches the bundle files it lacks instead of from the orchestrator: its cluster's head
    (infra.compute.access.agent_fanout) or the run's store prefix (infra.compute.access.agent_store)."""

    node_name: str  # what serves, for the log
    from_store: bool  # the bytes it delivers count as the store's (AgentEnv.store_bytes), else as a peer's

    def serves(self, bundle: Bundle) -> bool:
        """Whether it can deliver this bundle's files (a head serves only the bundle it holds)."""
        ...

    def fetch(self, runner: SshRunner, node_python: str, bundle: Bundle, bundle_dir: str, names: list[str]
              ) -> Fetched:
        """The named files of bundle into bundle_dir on runner's node, each verified before it is renamed into
        place; a failure is told in Fetched.error, never raised, so that the caller can get what is left elsewhere."""
        ...


@dataclass(frozen=True)
class NodeBundle:
    """A node's bundle as the orchestrator sees it: the node's interpreter, the bundle it needs, where the node keeps
    it and what the installer's status said (the files it has, the env's record when ready)."""

    node: NodePython
    bundle: Bundle
    env_key: str
    dir: str
    args: list[str]  # the installer's, after its mode
    status: dict

    def missing(self) -> list[str]:
        """The bundle's files the node lacks, or holds with another size."""
        have = self.status.get("have", {})
        return [name for name in self.bundle.files if have.get(name) != self.bundle.size(name)]


def probe(runner: SshRunner, node_python: str, agent_root: str) -> NodePython:
    """The node's interpreter, or AgentEnvError naming the host, the interpreter and the fix."""
    where = f"{runner.node_name} ({runner.endpoint.host})"
    result = runner.run([node_python, "-c", PROBE, agent_root], timeout=PROBE_TIMEOUT_S, check=False)
    if result.returncode == 127:
        raise AgentEnvError(f"{where}: python '{node_python}' not found: set the host's python to a CPython >= "
                            f"{min_python()} that exists there (e.g. /usr/bin/python3)")
    found = json_line(result.output) if result.returncode == 0 else None
    if found is None:
        raise AgentEnvError(f"{where}: '{node_python}' failed to run ({one_line(result.output) or 'no output'}): "
                            f"set the host's python to a working CPython >= {min_python()}")
    node = NodePython(**{**found, "version": tuple(found["version"])})
    if node.implementation != "cpython" or node.version[:2] < MIN_PYTHON:
        raise AgentEnvError(f"{where}: '{node_python}' is {node.implementation} "
                            f"{'.'.join(map(str, node.version))}, the agent needs CPython >= {min_python()}: set "
                            "the host's python to one (e.g. /usr/bin/python3.11)")
    if not node.venv:
        raise AgentEnvError(f"{where}: '{node_python}' cannot make venvs (no venv module): install it there "
                            "(apt install python3-venv) or set the host's python to an interpreter that has it")
    if node.machine not in ARCHITECTURES or node.glibc is None or not node.platforms():
        raise AgentEnvError(f"{where}: {node.machine} with {node.libc or 'no glibc'} {node.libc_version}: the agent's "
                            f"wheels are built for glibc >= 2.17 on {' or '.join(ARCHITECTURES)}: use such a node")
    return node


def home_or_absolute(value: str, field: str, example: str) -> str:
    """A node path setting of the agent's (its dir, its bundles' dir): absolute, or under the node user's ~."""
    if not (value.startswith("/") or value == "~" or value.startswith("~/")):
        raise ValueError(f"{field} '{value}' is neither absolute nor under ~/: give e.g. {example}")
    return value.rstrip("/") or "/"


def agent_python(workdir: str) -> str:
    """The agent's interpreter of a node whose workdir this is, through the link bootstrap makes there: what a
    provider puts in Node.python when it builds the node, before (or without) bootstrapping it."""
    return f"{workdir.rstrip('/')}/{AGENT_LINK}/bin/python"


def ensure_agent(runner: SshRunner, node_python: str, agent_root: str = DEFAULT_AGENT_DIR,
                 link: str | None = None, sources: Sequence[BundleSource] = ()) -> AgentEnv:
    """The agent's environment on the node behind runner, made from node_python when the node lacks it; link: a
    path on the node made a symlink to it (its python is then link/bin/python). sources: where the bundle files the
    node lacks are fetched from, in order (its cluster's head, the run's store prefix); what none delivers is copied
    from here, as without them."""
    started = time.monotonic()
    found = node_bundle(runner, node_python, agent_root, link)
    status = found.status
    copied = 0
    fetched = Counted()
    if not status["ready"]:
        found, fetched = fetch_missing(runner, node_python, found, sources)
        copied = copy_files(runner, found.bundle, found.dir, found.missing())
        status = installer(runner, node_python, "install", found.args)
    node = found.node
    agent = AgentEnv(python=status["python"], key=found.env_key, installed=status["installed"],
                     seconds=round(time.monotonic() - started, 3), install_seconds=status["seconds"],
                     bytes=status["bytes"], copied_bytes=copied, node_python=node.executable,
                     node_python_version=".".join(map(str, node.version)), peer_bytes=fetched.peer,
                     store_bytes=fetched.store)
    log.info("%s: agent %s at %s (%.1f MB) in %.1fs%s%s%s", runner.node_name,
             "installed" if agent.installed else "ready", agent.python, agent.bytes / 1e6, agent.seconds,
             f", {copied / 1e6:.1f} MB of wheels copied" if copied else "",
             f", {fetched.peer / 1e6:.1f} MB fetched from its head" if fetched.peer else "",
             f", {fetched.store / 1e6:.1f} MB fetched from the store" if fetched.store else "")
    return agent


@dataclass(frozen=True)
class Counted:
    """Bundle bytes a node fetched, by where from."""

    peer: int = 0
    store: int = 0

    def plus(self, source: BundleSource, nbytes: int) -> Counted:
        return Counted(self.peer, self.store + nbytes) if source.from_store else Counted(self.peer + nbytes, self.store)


def fetch_missing(runner: SshRunner, node_python: str, found: NodeBundle, sources: Sequence[BundleSource]
                  ) -> tuple[NodeBundle, Counted]:
    """The files the node lacks fetched from each source in turn, for what the ones before did not deliver: the node's
    bundle as it is now (its status read again when a source stopped short), and the bytes fetched."""
    counted = Counted()
    for source in sources:
        missing = found.missing()
        if not missing:
            break
        if not source.serves(found.bundle):
            if not source.from_store:  # a store that serves nothing said so itself, once
                log.info("%s: its agent bundle (%s) is not the one %s serves", runner.node_name, found.bundle.key,
                         source.node_name)
            continue
        fetched = source.fetch(runner, node_python, found.bundle, found.dir, missing)
        counted = counted.plus(source, fetched.bytes)
        if fetched.error is None:
            found = replace(found, status={**found.status, "have": {**found.status.get("have", {}), **{
                name: found.bundle.size(name) for name in missing}}})
            continue
        later = sources[sources.index(source) + 1:]
        log.warning("%s: fetching the agent's wheels from %s failed (%s): %s", runner.node_name, source.node_name,
                    fetched.error, f"fetching what is missing from {later[0].node_name}" if later
                    else "copying what is missing from here instead")
        found = replace(found, status=installer(runner, node_python, "status", found.args))
    return found, counted


def node_bundle(runner: SshRunner, node_python: str, agent_root: str, link: str | None = None) -> NodeBundle:
    """The node's interpreter, its bundle and the installer's status of it there (link: as ensure_agent's)."""
    node = probe(runner, node_python, agent_root)
    bundle = agent_bundle(node.version[:2], node.machine, tuple(node.platforms()))
    key = env_key(bundle, node)
    bundle_dir = f"{node.root}/bundles/{bundle.key}"
    args = [node.root, key, bundle_dir, f"{AGENT_DIST}=={bundle.agent_version}", str(INSTALL_TIMEOUT_S), link or ""]
    return NodeBundle(node, bundle, key, bundle_dir, args, installer(runner, node_python, "status", args))


def copy_files(runner: SshRunner, bundle: Bundle, bundle_dir: str, names: list[str]) -> int:
    """The named files of the bundle copied over SFTP from here; the bytes copied."""
    for name in names:
        runner.put_file(bundle.files[name], f"{bundle_dir}/{name}")
    return sum(bundle.size(name) for name in names)


def env_key(bundle: Bundle, node: NodePython) -> str:
    """The env's name on the node: its bundle's content and the interpreter it is made from."""
    seed = json.dumps([bundle.content, node.version, node.base])
    return hashlib.sha256(seed.encode()).hexdigest()[:16]


def installer(runner: SshRunner, node_python: str, mode: str, args: list[str]) -> dict:
    result = runner.run([node_python, "-c", INSTALLER, mode, *args], timeout=INSTALL_TIMEOUT_S + 60, check=False)
    found = json_line(result.output)
    if result.returncode != 0 or found is None or "error" in found:
        problem = one_line((found or {}).get("error") or result.output) or f"exit {result.returncode}"
        raise AgentEnvError(f"{runner.node_name}: making the agent's environment in {args[0]} with {node_python} "
                            f"failed ({problem}): check the node's disk and that python")
    return found


def json_line(output: str) -> dict | None:
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def one_line(text: str, keep: int = 300) -> str:
    """Output for a one-line error: its whitespace (newlines included) collapsed, its end kept."""
    return " ".join(text.split())[-keep:]


def min_python() -> str:
    return ".".join(map(str, MIN_PYTHON))


# -- the orchestrator's side: the agent's wheel and a node's bundle ---------------------------------------------------


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainpipe" / "agent-wheels"


def project_root() -> Path | None:
    """The source checkout this trainpipe runs from, or None when it was installed from a wheel."""
    root = Path(infra.__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "infra").is_dir() else None


def agent_requirements() -> list[str]:
    """The agent's dependency list: the `agent` extra, from the checkout's pyproject.toml or, for an installed
    trainpipe, its metadata."""
    root = project_root()
    if root is not None:
        project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
        return list(project["optional-dependencies"][AGENT_EXTRA])
    marker = re.compile(rf"""\s*;\s*extra\s*==\s*["']{AGENT_EXTRA}["']\s*$""")
    requires = importlib.metadata.requires(PROJECT) or []
    return [marker.sub("", r) for r in requires if marker.search(r)]


def _project_version() -> str:
    root = project_root()
    if root is not None:
        return str(tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"])
    return importlib.metadata.version(PROJECT)


def _source_files() -> list[tuple[str, Path]]:
    """The `infra` package's files (archive name, path) in a stable order, caches left out."""
    package = Path(infra.__file__).resolve().parent
    found = []
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo"):
            found.append(((Path("infra") / path.relative_to(package)).as_posix(), path))
    return found


_wheel_lock = threading.Lock()
_wheel: Path | None = None


def agent_wheel() -> Path:
    """The agent's wheel of this process's source: made once per process (every node of every cluster it launches
    gets the same one), and once per source content (kept in the cache dir, where another process finds it)."""
    global _wheel
    with _wheel_lock:
        if _wheel is None or not _wheel.is_file():
            _wheel = _make_agent_wheel()
        return _wheel


def _make_agent_wheel() -> Path:
    files = _source_files()
    requirements = agent_requirements()
    digest = hashlib.sha256(json.dumps([_project_version(), requirements]).encode())
    for name, path in files:
        digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    version = f"{_project_version()}+{digest.hexdigest()[:12]}"  # trainpipe's; the local label tells sources apart
    target = cache_root() / "agent" / f"{AGENT_DIST.replace('-', '_')}-{version}-py3-none-any.whl"
    if not target.is_file():
        _write_wheel(target, version, requirements, files)
        log.info("wrote the agent's wheel %s", target)
    return target


def _write_wheel(target: Path, version: str, requirements: list[str], files: list[tuple[str, Path]]) -> None:
    """A pure-Python wheel written directly (no build backend needed, nothing written in the source tree)."""
    dist_info = f"{AGENT_DIST.replace('-', '_')}-{version}.dist-info"
    metadata = "".join([
        "Metadata-Version: 2.1\n", f"Name: {AGENT_DIST}\n", f"Version: {version}\n",
        "Summary: trainpipe's node agent (python -m infra.node), for a node's environment of its own\n",
        f"Requires-Python: >={min_python()}\n", *(f"Requires-Dist: {r}\n" for r in requirements)])
    wheel = f"Wheel-Version: 1.0\nGenerator: {PROJECT}\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    records = []
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as archive:
        entries = [(name, path.read_bytes()) for name, path in files]
        entries += [(f"{dist_info}/METADATA", metadata.encode()), (f"{dist_info}/WHEEL", wheel.encode())]
        for name, data in entries:
            info = zipfile.ZipInfo(name, WHEEL_DATE)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
            records.append(f"{name},sha256={_urlsafe_digest(data)},{len(data)}")
        record = "\n".join([*records, f"{dist_info}/RECORD,,"]) + "\n"
        info = zipfile.ZipInfo(f"{dist_info}/RECORD", WHEEL_DATE)
        info.external_attr = 0o644 << 16
        archive.writestr(info, record)
    os.replace(tmp, target)


def _urlsafe_digest(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@dataclass(frozen=True)
class Bundle:
    """The wheels one kind of node installs the agent from. key: the dependencies' content (the bundle's dir on the
    node, where agent wheels of successive sources gather beside them); content: every file's, the agent's included."""

    key: str
    content: str
    agent_version: str
    files: dict[str, Path]
    hashes: dict[str, str]  # name -> sha256 (hex) of every file: what a node fetching them from a peer checks

    def size(self, name: str) -> int:
        return self.files[name].stat().st_size


_bundle_lock = threading.Lock()
_bundles: dict[tuple[object, ...], Path] = {}


def agent_bundle(python: tuple[int, int], machine: str, platforms: tuple[str, ...]) -> Bundle:
    """The agent's wheel, its dependencies for CPython `python` on `machine` with these platform tags, and pip's own
    wheel: the dependencies from the cache, or downloaded into it once (from TRAINPIPE_AGENT_WHEELS alone when set)."""
    wheel = agent_wheel()
    requirements = agent_requirements()
    offline = os.environ.get(AGENT_WHEELS_ENV, "").strip()
    request = (tuple(requirements), python, machine, platforms, offline)
    with _bundle_lock:
        if request not in _bundles:
            _bundles[request] = _dependencies(requirements, python, machine, platforms, offline)
        directory = _bundles[request]
    hashes = json.loads((directory / "manifest.json").read_text())
    files = {name: directory / name for name in hashes}
    key = hashlib.sha256(json.dumps(sorted(hashes.items())).encode()).hexdigest()[:16]
    files[wheel.name] = wheel
    hashes = {**hashes, wheel.name: hashlib.sha256(wheel.read_bytes()).hexdigest()}
    content = hashlib.sha256(json.dumps([key, wheel.name, hashes[wheel.name]]).encode())
    return Bundle(key=key, content=content.hexdigest()[:16], agent_version=wheel.name.split("-")[1], files=files,
                  hashes=hashes)


def _dependencies(requirements: list[str], python: tuple[int, int], machine: str, platforms: tuple[str, ...],
                  offline: str) -> Path:
    """The dir of the dependencies' wheels (and pip's) with their manifest (name -> sha256), downloaded when the
    cache lacks it."""
    seed = json.dumps([requirements, python, machine, platforms])
    directory = cache_root() / f"cp{python[0]}{python[1]}-{machine}-{hashlib.sha256(seed.encode()).hexdigest()[:16]}"
    if not (directory / "manifest.json").is_file():
        _download(requirements, python, machine, platforms, offline, directory)
    return directory


def _download(requirements: list[str], python: tuple[int, int], machine: str, platforms: tuple[str, ...],
              offline: str, directory: Path) -> None:
    """pip download into a temp dir beside the cache entry, renamed into place with its manifest written: a
    download that dies half way leaves nothing a later run would trust."""
    version = f"{python[0]}.{python[1]}"
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-input", "-q",
                "--only-binary=:all:", *(f"--platform={p}" for p in platforms), f"--python-version={version}",
                "--implementation=cp", "-d", str(tmp), *(["--no-index", "--find-links", offline] if offline else []),
                *requirements, "pip"]
        log.info("downloading the agent's wheels for CPython %s on %s into %s", version, machine, directory)
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            result = subprocess.CompletedProcess(argv, 1, "", f"no answer within {DOWNLOAD_TIMEOUT_S:.0f}s")
        if result.returncode != 0:
            lines = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
            problem = lines[-1].strip() if lines else f"exit {result.returncode}"
            where = f"from {AGENT_WHEELS_ENV}={offline}" if offline else "from the package index"
            raise AgentEnvError(
                f"the agent's wheels for CPython {version} on {machine} could not be had {where} ({problem}): on a "
                f"machine that reaches an index run `pip download --only-binary=:all: --platform {platforms[0]} "
                f"--python-version {version} --implementation cp -d DIR {' '.join(repr(r) for r in requirements)} "
                f"pip` and set {AGENT_WHEELS_ENV}=DIR")
        hashes = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp.glob("*.whl"))}
        (tmp / "manifest.json").write_text(json.dumps(hashes, indent=1))
        try:
            os.rename(tmp, directory)
        except OSError:
            if not (directory / "manifest.json").is_file():  # not another process that got there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
