"""Network namespaces, veths, a bridge and tc shaping: the emulated hosts of the netns provider and its store.

Plain subprocess calls to iproute2 (`ip`, `tc`); everything here needs root. Every object belongs to a *group*,
named by a 6-hex id, and its name says which (interface names are at most 15 characters):

    tpn-<id>-<rank>   a node's network namespace          tps-<id>        the store's namespace
    tpb-<id>          the cluster's bridge (root ns)      tpv-<id>-<r|s>  the host end of a node's (store's) veth

The other end of every veth is `eth0` inside its namespace. All names start with `tp` and a letter, so what a
crashed run left is found by name alone (`groups`). Each group also has a state file (STATE_DIR/<id>.json) written
before its first object: who created it, and for a cluster where its record lives, so the sweeper can tell a
group whose owner is still at work from one nobody will ever remove.

Creation converges (running it again leaves the same objects); removal is idempotent and checks that nothing of
the group is left.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Interface, IPv4Network
from pathlib import Path
from typing import Any

import psutil

from infra.compute.access.remote import LineSink, LocalRunner, Process
from infra.node.processes import hard_kill

NODE_NS = "tpn"
STORE_NS = "tps"
BRIDGE = "tpb"
VETH = "tpv"
STORE_SLOT = "s"
INNER_IF = "eth0"
# A tmpfs that a reboot clears, as it clears the namespaces themselves.
STATE_DIR = Path("/run/trainpipe/netns")
NAME = re.compile(rf"^(?:{NODE_NS}|{STORE_NS}|{BRIDGE}|{VETH})-(?P<id>[0-9a-f]{{6}})(?:-(?:\d+|{STORE_SLOT}))?$")
# Subnets come from 10.200.0.0 - 10.249.255.0 (/24 each): far from the 10.0-10.199 ranges clouds, VPNs and docker
# tend to use, and a group's own id picks where it starts looking.
SUBNET_SECOND_OCTET = 200
SUBNET_CHOICES = 50 * 256
FIRST_NODE_HOST = 10  # node r is .(10 + r); the root side is .1 and the store .254
STORE_HOST = 254
MAX_NODES = STORE_HOST - FIRST_NODE_HOST
# tbf: the bucket must hold at least what arrives in one timer tick (rate/HZ, HZ ≥ 250 on common kernels) or the
# link cannot reach its rate, and at least one 64 KiB GSO packet: veth hands tbf TSO/GSO super-packets, and one
# larger than the bucket gets segmented in software on every send. With that, tbf measures within a few percent of
# the rate on veth, so no offload has to be turned off (ethtool is not needed). The queue holds 50 ms at the rate:
# enough for TCP to keep the link full, short enough that a shaped link does not look like a satellite hop.
TBF_TICKS_PER_S = 250
TBF_MIN_BURST = 64 * 1024
TBF_LATENCY = "50ms"
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
# `ip netns exec` mounts the files under /etc/netns/<namespace>/ over /etc's. A namespace gets a resolver that fails
# at once: the machine's nameserver, reached from a node through the root namespace without NAT, never answers, and
# torch's c10d asks for a reverse lookup on every connection it makes (10 s each before it gives up).
NETNS_ETC = Path("/etc/netns")
RESOLV_CONF = "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"
NEEDS = "provider netns needs root and iproute2 (ip netns): run as root or use provider local"


class NetnsError(RuntimeError):
    """An ip/tc command failed; the message names the command and what it printed."""


# -- names and groups ---------------------------------------------------------------------------------------


def group_id(key: str) -> str:
    return hashlib.sha1(key.encode()).hexdigest()[:6]


def node_namespace(gid: str, rank: int) -> str:
    return f"{NODE_NS}-{gid}-{rank}"


def store_namespace(gid: str) -> str:
    return f"{STORE_NS}-{gid}"


def bridge_name(gid: str) -> str:
    return f"{BRIDGE}-{gid}"


def veth_name(gid: str, slot: int | str) -> str:
    return f"{VETH}-{gid}-{slot}"


def _namespace_of_veth(name: str) -> str:
    gid, slot = name.split("-")[1:3]
    return store_namespace(gid) if slot == STORE_SLOT else node_namespace(gid, int(slot))


@dataclass(frozen=True)
class Group:
    gid: str
    namespaces: tuple[str, ...]
    links: tuple[str, ...]  # in the root namespace: veth host ends and the bridge
    state: dict[str, Any] | None

    @property
    def node_namespaces(self) -> tuple[str, ...]:
        return tuple(ns for ns in self.namespaces if ns.startswith(f"{NODE_NS}-"))

    @property
    def is_store(self) -> bool:
        return any(ns.startswith(f"{STORE_NS}-") for ns in self.namespaces) or (self.state or {}).get("kind") == "store"


def problem() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return f"not root: {NEEDS}"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return f"ip/tc not found: {NEEDS}"
    return None


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"'{' '.join(argv)}': {exc}") from None
    if check and done.returncode != 0:
        raise NetnsError(f"'{' '.join(argv)}' exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    return _run(["ip", *(["-n", namespace] if namespace else []), *args], check).stdout


def _gone(done: subprocess.CompletedProcess[str]) -> bool:
    """A delete that failed only because the thing was not there: what idempotent removal expects."""
    text = done.stderr
    return done.returncode == 0 or "Cannot find device" in text or "No such file" in text or "does not exist" in text


def namespaces() -> list[str]:
    # `ip netns list` prints "name (id: N)"; reading it needs no root, so status and sweep work for anyone. Without
    # iproute2 this machine cannot have made any.
    if shutil.which("ip") is None:
        return []
    return [line.split()[0] for line in ip("netns", "list", check=False).splitlines() if line.strip()]


def links() -> list[str]:
    if shutil.which("ip") is None:
        return []
    return [link["ifname"] for link in json.loads(ip("-j", "link", "show", check=False) or "[]")]


def _etc_dirs() -> list[Path]:
    return sorted(NETNS_ETC.iterdir()) if NETNS_ETC.is_dir() else []


def groups() -> dict[str, Group]:
    """Every group on this machine that has a namespace, an interface, a state file or files under /etc/netns."""
    found: dict[str, tuple[list[str], list[str]]] = {}
    for ns in namespaces():
        if match := NAME.match(ns):
            found.setdefault(match["id"], ([], []))[0].append(ns)
    for ns in _etc_dirs():
        if match := NAME.match(ns.name):
            found.setdefault(match["id"], ([], []))
    for link in links():
        if match := NAME.match(link):
            found.setdefault(match["id"], ([], []))[1].append(link)
    if STATE_DIR.is_dir():
        for path in STATE_DIR.glob("*.json"):
            if re.fullmatch(r"[0-9a-f]{6}", path.stem):
                found.setdefault(path.stem, ([], []))
    return {gid: Group(gid, tuple(sorted(nss)), tuple(sorted(lks)), read_state(gid))
            for gid, (nss, lks) in sorted(found.items())}


# -- state files --------------------------------------------------------------------------------------------


def write_state(gid: str, state: Mapping[str, Any]) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = STATE_DIR / f".{gid}.tmp"
    tmp.write_text(json.dumps(dict(state)))
    os.replace(tmp, STATE_DIR / f"{gid}.json")


def read_state(gid: str) -> dict[str, Any] | None:
    try:
        return json.loads((STATE_DIR / f"{gid}.json").read_text())
    except (OSError, ValueError):
        return None


def remove_state(gid: str) -> None:
    (STATE_DIR / f"{gid}.json").unlink(missing_ok=True)


# -- addresses ----------------------------------------------------------------------------------------------


def _used_networks() -> list[IPv4Network]:
    used = []
    for link in json.loads(ip("-j", "addr", "show") or "[]"):
        used += [IPv4Interface(f"{a['local']}/{a['prefixlen']}").network
                 for a in link.get("addr_info", []) if a.get("family") == "inet"]
    for route in json.loads(ip("-j", "-4", "route", "show", "table", "all") or "[]"):
        dst = route.get("dst", "default")
        if dst != "default":
            try:
                used.append(IPv4Network(dst, strict=False))
            except ValueError:
                continue
    return used


def pick_subnet(gid: str) -> IPv4Network:
    """A /24 that no address or route of this machine's root namespace overlaps, starting where the id points."""
    used = _used_networks()
    start = int(gid, 16) % SUBNET_CHOICES
    for step in range(SUBNET_CHOICES):
        k = (start + step) % SUBNET_CHOICES
        subnet = IPv4Network(f"10.{SUBNET_SECOND_OCTET + k // 256}.{k % 256}.0/24")
        if not any(subnet.overlaps(other) for other in used):
            return subnet
    raise NetnsError("no free /24 left in 10.200.0.0-10.249.255.0: remove stale interfaces (`trainpipe sweep`)")


def host(subnet: IPv4Network, number: int) -> IPv4Interface:
    return IPv4Interface(f"{subnet.network_address + number}/{subnet.prefixlen}")


def namespace_address(namespace: str) -> str:
    """The IPv4 address of eth0 in the namespace."""
    for link in json.loads(ip("-j", "-4", "addr", "show", "dev", INNER_IF, namespace=namespace) or "[]"):
        for entry in link.get("addr_info", []):
            return str(entry["local"])
    raise NetnsError(f"{namespace}: {INNER_IF} has no IPv4 address")


# -- creating -----------------------------------------------------------------------------------------------


def create_namespace(name: str) -> None:
    (NETNS_ETC / name).mkdir(parents=True, exist_ok=True)
    (NETNS_ETC / name / "resolv.conf").write_text(RESOLV_CONF)
    if name not in namespaces():
        ip("netns", "add", name)
    # gloo, torchrun's store and anything bound to localhost inside the namespace need its own loopback up.
    ip("link", "set", "lo", "up", namespace=name)


def create_bridge(name: str, address: IPv4Interface) -> None:
    if name not in links():
        ip("link", "add", name, "type", "bridge")
    ip("addr", "replace", str(address), "dev", name)
    ip("link", "set", name, "up")


def add_veth(host_if: str, namespace: str, address: IPv4Interface, gateway: IPv4Address, *,
             bridge: str | None = None, host_address: IPv4Interface | None = None) -> None:
    """A veth from the root namespace (host_if, on the bridge or holding host_address) to eth0 in the namespace,
    which gets address and a default route through gateway."""
    if host_if in links():
        ip("link", "del", host_if)  # a half-made pair from an interrupted launch: start it over
    # The peer is made inside the namespace, so it can be called eth0 there whatever the root namespace has.
    ip("link", "add", host_if, "type", "veth", "peer", "name", INNER_IF, "netns", namespace)
    if bridge is not None:
        ip("link", "set", host_if, "master", bridge)
    if host_address is not None:
        ip("addr", "replace", str(host_address), "dev", host_if)
    ip("link", "set", host_if, "up")
    ip("addr", "replace", str(address), "dev", INNER_IF, namespace=namespace)
    ip("link", "set", INNER_IF, "up", namespace=namespace)
    ip("route", "replace", "default", "via", str(gateway), namespace=namespace)


def create_cluster_network(gid: str, nodes: int, link_mbit: float | None) -> list[str]:
    """The bridge (root side .1) and one namespace per node (.10 + rank) with shaped links; the nodes' addresses.
    On failure the caller removes the group (remove_group): what was made so far is left for it."""
    if nodes > MAX_NODES:
        raise NetnsError(f"{nodes} nodes: one netns cluster holds at most {MAX_NODES}")
    subnet = pick_subnet(gid)
    gateway = host(subnet, 1)
    create_bridge(bridge_name(gid), gateway)
    addresses = []
    for rank in range(nodes):
        ns = node_namespace(gid, rank)
        create_namespace(ns)
        address = host(subnet, FIRST_NODE_HOST + rank)
        add_veth(veth_name(gid, rank), ns, address, gateway.ip, bridge=bridge_name(gid))
        shape_link(veth_name(gid, rank), link_mbit)
        addresses.append(str(address.ip))
    return addresses


def create_store_network(gid: str, link_mbit: float | None) -> str:
    """The store's namespace on its own veth and /24 (root side .1, store .254); the store's address."""
    subnet = pick_subnet(gid)
    ns, veth = store_namespace(gid), veth_name(gid, STORE_SLOT)
    create_namespace(ns)
    address = host(subnet, STORE_HOST)
    add_veth(veth, ns, address, host(subnet, 1).ip, host_address=host(subnet, 1))
    shape_link(veth, link_mbit)
    return str(address.ip)


# -- shaping ------------------------------------------------------------------------------------------------


def tbf_args(mbit: float) -> list[str]:
    rate_bytes = mbit * 1e6 / 8
    burst = max(int(rate_bytes / TBF_TICKS_PER_S), TBF_MIN_BURST)
    return ["tbf", "rate", f"{int(mbit * 1e6)}bit", "burst", str(burst), "latency", TBF_LATENCY]


def _set_qdisc(device: str, namespace: str | None, mbit: float | None) -> None:
    where = ["-n", namespace] if namespace else []
    if mbit is not None:
        _run(["tc", *where, "qdisc", "replace", "dev", device, "root", *tbf_args(mbit)])
        return
    done = _run(["tc", *where, "qdisc", "del", "dev", device, "root"], check=False)
    # Deleting the default qdisc (nothing was shaped) is refused with this: already as asked.
    if not _gone(done) and "Cannot delete qdisc with handle of zero" not in done.stderr:
        raise NetnsError(f"tc qdisc del dev {device}: {done.stderr.strip()}")


def shape_link(host_if: str, mbit: float | None) -> None:
    """Shape both directions of a veth to mbit (None: unshaped): each end's egress, so the host end limits what
    reaches the namespace and eth0 inside limits what leaves it."""
    _set_qdisc(host_if, None, mbit)
    _set_qdisc(INNER_IF, _namespace_of_veth(host_if), mbit)


def shape_group(gid: str, mbit: float | None) -> int:
    """Reshape every link of the group (a running cluster's nodes, or a store); how many links."""
    veths = [link for link in links() if NAME.match(link) and link.startswith(f"{VETH}-{gid}-")]
    if not veths:
        raise NetnsError(f"no links of netns group {gid}: is it running?")
    for veth in veths:
        shape_link(veth, mbit)
    return len(veths)


# -- running inside ------------------------------------------------------------------------------------------


def exec_argv(namespace: str, argv: Sequence[str]) -> list[str]:
    # `ip netns exec` execs the command in place: same pid, same environment, same session and process group.
    return ["ip", "netns", "exec", namespace, *argv]


class NetnsRunner(LocalRunner):
    """A LocalRunner whose commands run inside a network namespace; the tags still reach them through the
    environment, and terminate still signals their process group (ip execs the command, it does not fork)."""

    def __init__(self, node_name: str, workdir: Path, tags: Mapping[str, str], namespace: str) -> None:
        super().__init__(node_name, workdir, tags)
        self.namespace = namespace

    def start(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, on_line: LineSink | None = None,
              log_path: str | None = None, cwd: str | None = None) -> Process:
        return super().start(exec_argv(self.namespace, argv), env=env, on_line=on_line, log_path=log_path, cwd=cwd)


def namespace_pids(namespace: str) -> list[int]:
    return [int(pid) for pid in ip("netns", "pids", namespace, check=False).split()]


def group_pids(group: Group) -> list[int]:
    return [pid for ns in group.namespaces for pid in namespace_pids(ns)]


def set_ip_forward(on: bool) -> bool:
    """Turn IPv4 forwarding in the root namespace on or off; whether it was on before."""
    was = IP_FORWARD.read_text().strip() == "1"
    if was != on:
        IP_FORWARD.write_text("1\n" if on else "0\n")
    return was


# -- removing -----------------------------------------------------------------------------------------------


def remove_group(gid: str) -> bool:
    """Kill what still runs in the group's namespaces, delete its veths, bridge, namespaces and state file.
    Idempotent; True when something was there. Raises NetnsError naming what could not be removed."""
    group = groups().get(gid)
    if group is None:
        return False
    processes = []
    for pid in group_pids(group):
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    # Whoever started them had their chance (the provider SIGTERMs its tagged processes first): a process left
    # inside would keep its namespace, and with it the node's address, alive after the name is gone.
    hard_kill(processes)
    # Veths before the bridge; deleting the host end deletes eth0 inside with it.
    for link in sorted(group.links, key=lambda name: name.startswith(f"{BRIDGE}-")):
        done = _run(["ip", "link", "del", link], check=False)
        if not _gone(done):
            raise NetnsError(f"ip link del {link}: {done.stderr.strip()}")
    for ns in group.namespaces:
        done = _run(["ip", "netns", "del", ns], check=False)
        if not _gone(done):
            raise NetnsError(f"ip netns del {ns}: {done.stderr.strip()}")
    for etc in _etc_dirs():
        if (match := NAME.match(etc.name)) and match["id"] == gid:
            shutil.rmtree(etc)
    remove_state(gid)
    left = groups().get(gid)
    if left is not None and (left.namespaces or left.links):
        raise NetnsError(f"netns group {gid}: still there after removal: {', '.join(left.namespaces + left.links)}")
    return True

