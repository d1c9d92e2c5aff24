"""Node bootstrap over SSH: make sure the node runs the orchestrator's trainpipe, and report what the node has.

The node needs only a Python interpreter to start with: every check here is a stdlib-only snippet run by it. When
the node lacks trainpipe (or has another version), the project's own wheel is copied over SFTP and installed with
the node's pip; its dependencies come from the node's package index. The report (mount of the workdir, GPUs,
network interfaces) goes into the cluster record and from there into the run summary.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import infra
from infra.compute.access.remote import RemoteError
from infra.compute.access.ssh.runner import SshRunner

log = logging.getLogger(__name__)

PROJECT = "trainpipe"
PROJECT_PACKAGES = ("flows", "tasks", "infra", "trainer", "trainpipe", "bench")
CHECK_TIMEOUT_S = 300.0  # importing torch on a cold node takes a while
INSTALL_TIMEOUT_S = 1800.0  # pip may download torch and its CUDA libraries
WHEEL_BUILD_TIMEOUT_S = 600.0

WheelSource = Path | Callable[[], Path] | None

# Prints what the node's python has of the project; never fails, so the answer is always one JSON line.
PROJECT_CHECK = f"""
import json, sys
found = {{"python": sys.version.split()[0], "executable": sys.executable}}
try:
    import importlib.metadata as md
    import infra, trainer, torch
    found.update(ok=True, version=md.version({PROJECT!r}), torch=torch.__version__)
except Exception as exc:
    found.update(ok=False, error=f"{{type(exc).__name__}}: {{exc}}")
print(json.dumps(found))
"""

# What the node has: the mount holding the workdir (from /proc/self/mountinfo), GPUs (nvidia-smi) and interfaces
# (/sys/class/net). Stdlib only, argv[1] is the workdir.
NODE_FACTS = r"""
import json, os, re, shutil, subprocess, sys

def unescape(field):  # mountinfo writes space, tab, newline and backslash as \ooo
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)

def mount_of(path):
    path = os.path.realpath(path)
    best = None
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            left, right = line.split(" - ", 1)
            target = unescape(left.split()[4])
            fstype, source = right.split()[:2]
            inside = path == target or path.startswith(target.rstrip("/") + "/")
            if inside and (best is None or len(target) >= len(best[0])):
                best = (target, unescape(source), fstype)
    target, source, fstype = best
    usage = shutil.disk_usage(path)
    return {"path": path, "target": target, "source": source, "fstype": fstype, "nvme": is_nvme(source),
            "size_bytes": usage.total, "free_bytes": usage.free}

def is_nvme(source):
    name = os.path.basename(os.path.realpath(source)) if source.startswith("/dev/") else ""
    if not name:
        return False
    if name.startswith("nvme"):
        return True
    block = os.path.realpath(f"/sys/class/block/{name}")
    slaves = os.path.join(block, "slaves")  # a RAID or LVM device: NVMe when all its members are
    members = os.listdir(slaves) if os.path.isdir(slaves) else []
    return bool(members) and all(member.startswith("nvme") for member in members)

def read(path):
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None

def interfaces():
    found = []
    for name in sorted(os.listdir("/sys/class/net")):
        base = f"/sys/class/net/{name}"
        speed = read(f"{base}/speed")  # unreadable or -1 when the link is down or virtual
        mtu = read(f"{base}/mtu")
        found.append({"name": name, "state": read(f"{base}/operstate"), "mac": read(f"{base}/address"),
                      "mtu": int(mtu) if mtu else None,
                      "speed_mbps": int(speed) if speed and speed.lstrip("-").isdigit() and int(speed) > 0 else None})
    return found

def gpus():
    if shutil.which("nvidia-smi") is None:
        return [], None
    result = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                            capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        return [], (result.stderr or result.stdout).strip() or f"nvidia-smi exited {result.returncode}"
    found = []
    for line in result.stdout.strip().splitlines():
        name, memory = [part.strip() for part in line.rsplit(",", 1)]
        found.append({"name": name, "memory_mib": int(float(memory))})
    return found, None

found_gpus, gpu_error = gpus()
print(json.dumps({"mount": mount_of(sys.argv[1]), "gpus": found_gpus, "gpu_error": gpu_error,
                  "interfaces": interfaces(), "cpus": os.cpu_count()}))
"""


class BootstrapError(RemoteError):
    """The node cannot run the project and trainpipe could not fix that; the message says what to do."""


@dataclass(frozen=True)
class Mount:
    path: str  # the workdir, symlinks resolved
    target: str  # where the filesystem holding it is mounted
    source: str  # its device (e.g. /dev/nvme0n1p1, /dev/md0, overlay)
    fstype: str
    nvme: bool
    size_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_mib: int


@dataclass(frozen=True)
class Interface:
    name: str
    state: str | None
    mac: str | None
    mtu: int | None
    speed_mbps: int | None  # None for virtual links (lo) and links that are down


@dataclass(frozen=True)
class NodeReport:
    node: str
    python: str
    python_version: str
    trainpipe_version: str
    torch_version: str
    installed: bool  # True when bootstrap installed the wheel; False when the node already had the project
    mount: Mount
    gpus: tuple[Gpu, ...]
    gpu_error: str | None  # nvidia-smi is there but failed (driver not loaded, ...)
    interfaces: tuple[Interface, ...]
    cpus: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-shaped (lists, not tuples), so it equals itself after a round trip through the cluster record."""
        data = asdict(self)
        return {**data, "gpus": list(data["gpus"]), "interfaces": list(data["interfaces"])}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeReport:
        return cls(**{**data, "mount": Mount(**data["mount"]), "gpus": tuple(Gpu(**g) for g in data["gpus"]),
                      "interfaces": tuple(Interface(**i) for i in data["interfaces"])})

    def max_link_gbps(self) -> float:
        speeds = [i.speed_mbps for i in self.interfaces if i.speed_mbps]
        return max(speeds, default=0) / 1000


def orchestrator_version() -> str:
    return importlib.metadata.version(PROJECT)


def _json_line(output: str, what: str, runner: SshRunner) -> dict[str, Any]:
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise BootstrapError(f"{runner.node_name}: {what} printed no result: {output.strip()[-300:] or '(no output)'}")


def check_project(runner: SshRunner, python: str) -> dict[str, Any]:
    """What the node's python has: ok (infra, trainer and torch import), version, torch, or the import error."""
    result = runner.run([python, "-c", PROJECT_CHECK], timeout=CHECK_TIMEOUT_S, check=False)
    if result.returncode == 127:
        raise BootstrapError(f"{runner.node_name}: python '{python}' not found: set the host's python to an "
                             "interpreter that exists there (e.g. /opt/venv/bin/python)")
    if result.returncode != 0:
        raise BootstrapError(f"{runner.node_name}: '{python}' failed to run ({result.output.strip()[-300:]}): set the "
                             "host's python to a working interpreter")
    return _json_line(result.output, "the project check", runner)


def install_wheel(runner: SshRunner, python: str, wheel: Path, directory: str) -> None:
    """Copy the wheel to the node and pip install it there (dependencies from the node's index)."""
    remote = f"{directory.rstrip('/')}/.bootstrap/{wheel.name}"
    log.info("%s: installing %s with %s", runner.node_name, wheel.name, python)
    runner.put_file(wheel, remote)
    result = runner.run([python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", remote],
                        timeout=INSTALL_TIMEOUT_S, check=False)
    if result.returncode != 0:
        hint = ("the interpreter is externally managed: point the host's python at a virtualenv"
                if "externally-managed" in result.output else "check the node's pip and package index")
        raise BootstrapError(f"{runner.node_name}: pip install {wheel.name} failed ({result.output.strip()[-400:]}): "
                             f"{hint}")


def ensure_project(runner: SshRunner, python: str, wheel: WheelSource, directory: str) -> tuple[dict[str, Any], bool]:
    """The node's project check after installing the wheel if needed; and whether it was installed."""
    want = orchestrator_version()
    found = check_project(runner, python)
    if found["ok"] and found["version"] == want:
        return found, False
    problem = found.get("error") or f"{PROJECT} {found['version']} is installed, the orchestrator runs {want}"
    if wheel is None:
        raise BootstrapError(f"{runner.node_name}: {python} cannot run the job ({problem}): install {PROJECT}=={want} "
                             "and torch there, or run from a source checkout so trainpipe can install its wheel")
    log.info("%s: %s cannot run the job yet (%s)", runner.node_name, python, problem)
    install_wheel(runner, python, wheel if isinstance(wheel, Path) else wheel(), directory)
    found = check_project(runner, python)
    if not (found["ok"] and found["version"] == want):
        raise BootstrapError(f"{runner.node_name}: after installing the wheel, {python} still cannot run the job "
                             f"({found.get('error') or found['version']}): check the node's python environment")
    return found, True


def node_facts(runner: SshRunner, python: str, workdir: str) -> dict[str, Any]:
    result = runner.run([python, "-c", NODE_FACTS, workdir], timeout=CHECK_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise BootstrapError(f"{runner.node_name}: inspecting the node failed: {result.output.strip()[-400:]}")
    return _json_line(result.output, "the node inspection", runner)


def bootstrap_node(runner: SshRunner, python: str, wheel: WheelSource = None, workdir: str | None = None
                   ) -> NodeReport:
    """Connect (the runner waits for SSH and verifies the host key), make the node run this trainpipe, and report
    the mount of workdir (default: the runner's), the GPUs and the network interfaces.

    wheel: the project's wheel, or a function that builds it (called only when a node needs it), or None to
    require the node to have the project already (a prebuilt image)."""
    workdir = workdir or runner.workdir
    if not workdir:
        raise ValueError("bootstrap_node needs the node's workdir (or a runner that has one)")
    runner.connect()
    project, installed = ensure_project(runner, python, wheel, workdir)
    facts = node_facts(runner, python, workdir)
    report = NodeReport(
        node=runner.node_name, python=project["executable"], python_version=project["python"],
        trainpipe_version=project["version"], torch_version=project["torch"], installed=installed,
        mount=Mount(**facts["mount"]), gpus=tuple(Gpu(**g) for g in facts["gpus"]), gpu_error=facts["gpu_error"],
        interfaces=tuple(Interface(**i) for i in facts["interfaces"]), cpus=facts["cpus"],
    )
    log.info("%s: trainpipe %s, torch %s; %s on %s (%s%s); %s; interfaces %s", report.node,
             report.trainpipe_version, report.torch_version, workdir, report.mount.source, report.mount.fstype,
             ", NVMe" if report.mount.nvme else "", _gpus_text(report), ", ".join(i.name for i in report.interfaces))
    return report


def _gpus_text(report: NodeReport) -> str:
    if not report.gpus:
        return f"no GPUs ({report.gpu_error})" if report.gpu_error else "no GPUs"
    return f"{len(report.gpus)} GPUs ({report.gpus[0].name}, {report.gpus[0].memory_mib} MiB)"


# -- the project's wheel --------------------------------------------------------------------------------------------


def project_root() -> Path | None:
    """The source checkout this trainpipe runs from, or None when it was installed from a wheel."""
    # From the infra package itself, not this file: the checkout root stays put wherever this module moves in it.
    root = Path(infra.__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "trainer").is_dir() else None


def build_wheel(dest: Path, root: Path | None = None) -> Path:
    """Build the project's wheel (no dependencies) into dest from a copy of the source, so the build leaves
    nothing (build/, *.egg-info) in the checkout."""
    root = root or project_root()
    if root is None:
        raise BootstrapError(f"{PROJECT} is not running from a source checkout, so it cannot build its wheel for "
                             "the nodes: install it on the nodes, or pass a wheel (TRAINPIPE_WHEEL)")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trainpipe-wheel-") as tmp:
        source = Path(tmp) / "src"
        source.mkdir()
        for name in ("pyproject.toml", "README.md"):
            if (root / name).is_file():
                shutil.copy2(root / name, source / name)
        for package in PROJECT_PACKAGES:
            if (root / package).is_dir():
                shutil.copytree(root / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
        # Offline orchestrators cannot fetch a build backend into an isolated env: use ours when we have it.
        isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
        out = Path(tmp) / "out"
        result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(out),
                                 str(source)], capture_output=True, text=True, timeout=WHEEL_BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise BootstrapError(f"building the {PROJECT} wheel failed: {(result.stderr or result.stdout)[-400:]}")
        built = sorted(out.glob(f"{PROJECT}-*.whl"))
        if not built:
            raise BootstrapError(f"building the {PROJECT} wheel produced no {PROJECT}-*.whl in {out}")
        target = dest / built[-1].name
        shutil.copy2(built[-1], target)
    log.info("built %s", target)
    return target


class WheelBuilder:
    """Builds the wheel once, on first need, for every node that needs it (nodes bootstrap in parallel)."""

    def __init__(self, dest: Path) -> None:
        self._dest = dest
        self._lock = threading.Lock()
        self._wheel: Path | None = None

    def __call__(self) -> Path:
        with self._lock:
            if self._wheel is None:
                self._wheel = build_wheel(self._dest)
            return self._wheel
