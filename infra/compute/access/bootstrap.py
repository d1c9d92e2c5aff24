"""Node bootstrap over SSH: the node agent's environment made (or found) on the node, and a report of what the
node has.

The node needs only a CPython (>= 3.11) to start with: the agent's environment is a venv of its own made from it
(infra.compute.access.agent_env), and every check here is a stdlib-only snippet run by it. Nothing is installed into
the node's Python itself: it stays the user's, the default training environment. The report (the agent's environment,
the mount of the workdir, GPUs, network interfaces) goes into the cluster record and from there into the run summary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from infra.compute.access.agent_env import (
    AGENT_LINK,
    DEFAULT_AGENT_DIR,
    AgentEnv,
    BundleSource,
    ensure_agent,
    json_line,
)
from infra.compute.access.remote import RemoteError
from infra.compute.access.ssh.runner import SshRunner

log = logging.getLogger(__name__)

FACTS_TIMEOUT_S = 300.0

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
    """Inspecting the node failed; the message says what went wrong there."""


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
    python: str  # the node's own interpreter (the agent's env was made from it; the default training environment)
    python_version: str
    mount: Mount
    gpus: tuple[Gpu, ...]
    gpu_error: str | None  # nvidia-smi is there but failed (driver not loaded, ...)
    interfaces: tuple[Interface, ...]
    cpus: int
    agent_python: str = ""  # what runs `python -m infra.node` on the node: <workdir>/agent-env/bin/python
    agent_installed: bool = False  # made by this bootstrap; False when the node had it (an earlier run, a neighbour)
    agent_seconds: float = 0.0  # from the node answering to the agent ready
    agent_bytes: int = 0  # the agent's environment on disk (du)
    agent_copied_bytes: int = 0  # of the agent's wheels, copied by this bootstrap from the orchestrator
    agent_peer_bytes: int = 0  # of the agent's wheels, fetched by this bootstrap from the cluster's head
    agent_store_bytes: int = 0  # of the agent's wheels, fetched by this bootstrap from the run's store prefix

    def to_dict(self) -> dict[str, Any]:
        """JSON-shaped (lists, not tuples), so it equals itself after a round trip through the cluster record."""
        data = asdict(self)
        return {**data, "gpus": list(data["gpus"]), "interfaces": list(data["interfaces"])}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeReport:
        known = {f.name for f in fields(cls)}  # a record of an older trainpipe may carry fields no longer kept
        data = {key: value for key, value in data.items() if key in known}
        return cls(**{**data, "mount": Mount(**data["mount"]), "gpus": tuple(Gpu(**g) for g in data["gpus"]),
                      "interfaces": tuple(Interface(**i) for i in data["interfaces"])})

    def max_link_gbps(self) -> float:
        speeds = [i.speed_mbps for i in self.interfaces if i.speed_mbps]
        return max(speeds, default=0) / 1000


def _result(output: str, what: str, runner: SshRunner) -> dict[str, Any]:
    found = json_line(output)
    if found is not None:
        return found
    raise BootstrapError(f"{runner.node_name}: {what} printed no result: {output.strip()[-300:] or '(no output)'}")


def node_facts(runner: SshRunner, python: str, workdir: str) -> dict[str, Any]:
    result = runner.run([python, "-c", NODE_FACTS, workdir], timeout=FACTS_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise BootstrapError(f"{runner.node_name}: inspecting the node failed: {result.output.strip()[-400:]}")
    return _result(result.output, "the node inspection", runner)


def bootstrap_node(runner: SshRunner, python: str, agent_dir: str = DEFAULT_AGENT_DIR, workdir: str | None = None,
                   sources: Sequence[BundleSource] = ()) -> NodeReport:
    """Connect (the runner waits for SSH and verifies the host key), make sure the node has the agent's environment
    (made from `python`, the node's own interpreter, under agent_dir, and linked from <workdir>/agent-env: see
    agent_env.agent_python; the wheels it lacks fetched from sources, in order, what is left copied from here), and
    report it with the mount of workdir (default: the runner's), the GPUs and the network interfaces. Nothing is
    installed into `python`."""
    workdir = workdir or runner.workdir
    if not workdir:
        raise ValueError("bootstrap_node needs the node's workdir (or a runner that has one)")
    started = time.monotonic()
    runner.connect()
    agent: AgentEnv = ensure_agent(runner, python, agent_dir, link=f"{workdir.rstrip('/')}/{AGENT_LINK}",
                                   sources=sources)
    seconds = round(time.monotonic() - started, 3)
    facts = node_facts(runner, agent.python, workdir)
    report = NodeReport(
        node=runner.node_name, python=agent.node_python, python_version=agent.node_python_version,
        mount=Mount(**facts["mount"]), gpus=tuple(Gpu(**g) for g in facts["gpus"]), gpu_error=facts["gpu_error"],
        interfaces=tuple(Interface(**i) for i in facts["interfaces"]), cpus=facts["cpus"],
        agent_python=agent.python, agent_installed=agent.installed, agent_seconds=seconds, agent_bytes=agent.bytes,
        agent_copied_bytes=agent.copied_bytes, agent_peer_bytes=agent.peer_bytes, agent_store_bytes=agent.store_bytes,
    )
    log.info("%s: agent %s (%s, %.0f MB, %.1fs); %s on %s (%s%s); %s; interfaces %s", report.node,
             report.agent_python, "installed" if report.agent_installed else "ready", report.agent_bytes / 1e6,
             report.agent_seconds, workdir, report.mount.source, report.mount.fstype,
             ", NVMe" if report.mount.nvme else "", _gpus_text(report), ", ".join(i.name for i in report.interfaces))
    return report


def _gpus_text(report: NodeReport) -> str:
    if not report.gpus:
        return f"no GPUs ({report.gpu_error})" if report.gpu_error else "no GPUs"
    return f"{len(report.gpus)} GPUs ({report.gpus[0].name}, {report.gpus[0].memory_mib} MiB)"
