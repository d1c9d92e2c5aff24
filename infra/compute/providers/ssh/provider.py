"""A cluster of machines the user already has, reached over SSH (cluster.ssh.hosts in the job config).

launch takes the first `nodes` hosts: it verifies each host key (pinned or in known_hosts, never accepted blindly),
reserves the host with a lock file in its workdir, creates <workdir>/<cluster>/{data,ckpt,logs} and bootstraps the
node (the agent's environment made from the host's python, mount, GPUs and interfaces reported): a node's python is
the agent's (through <workdir>/<cluster>/agent-env), its node_python the host's. Any failure rolls back every host.
The cluster record lives in the workspace (ssh-clusters/<name>.json), with what runners need to reach each host, so
describe, terminate and the sweeper work from any process on this machine.

Every process started through the cluster's runners carries TRAINPIPE_CLUSTER (the cluster's dir on that host) and
TRAINPIPE_NODE in its environment; terminate finds them through /proc on each host with a stdlib-only snippet, so it
works even when trainpipe itself is broken on the host, then removes the cluster's dir and its reservation.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from infra.compute.access.agent_env import BundleSource, agent_python
from infra.compute.access.agent_store import StoreSource
from infra.compute.access.bootstrap import NodeReport, bootstrap_node
from infra.compute.access.remote import RemoteError, Runner
from infra.compute.access.ssh.runner import SshRunner
from infra.compute.providers.base import (
    Attempt,
    Cluster,
    ClusterRecord,
    InvalidRequestError,
    LaunchError,
    Node,
    PreemptionNotice,
    Provider,
    ReplacementUnavailable,
    count_replaced,
    lost_nodes,
)
from infra.compute.providers.hosts import in_parallel, launch_error
from infra.compute.providers.node_notices import read_node_notices
from infra.compute.providers.owner import launcher, launcher_alive
from infra.compute.providers.ssh.config import SshHostSpec
from infra.compute.spec import ClusterSpec
from infra.node.processes import CLUSTER_TAG, NODE_TAG
from infra.workspace import workspace_dir

log = logging.getLogger(__name__)

SSH_TYPE = "ssh-host"
RESERVATION = ".trainpipe-reservation.json"
ADMIN_TIMEOUT_S = 120.0
TEARDOWN_GRACE_S = 5.0
LAUNCH_CONNECT_S = 60.0  # a machine that is rebooting gets this long to answer
TEARDOWN_CONNECT_S = 20.0  # terminate (and nodes_alive, which teardown asks) gives up on a host after this long

# Runs with the host's python, stdlib only: argv = mode, cluster tag, [grace, cluster dir, [reservation, cluster name,
# record]]. "count" prints how many processes carry the tag; "teardown" ends them (SIGTERM, SIGKILL after grace),
# removes the dir and releases the reservation when it is this cluster's, and prints what it did; "empty" does the
# same but keeps the reservation (a node replaced on its own host).
HOST_ADMIN = r"""
import json, os, shutil, signal, sys, time

mode, tag = sys.argv[1], sys.argv[2]
needle = b"TRAINPIPE_CLUSTER=" + tag.encode()

def tagged():
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue  # gone, or not ours to read
    return found

def signal_until_gone(sig, wait_s):
    sent = set()
    deadline = time.monotonic() + wait_s
    while True:
        alive = tagged()
        if not alive or time.monotonic() > deadline:
            return alive, sent
        for pid in alive:
            if pid not in sent:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
                sent.add(pid)
        time.sleep(0.2)

if mode == "count":
    print(json.dumps({"processes": len(tagged())}))
    sys.exit(0)

grace, directory = float(sys.argv[3]), sys.argv[4]
left, termed = signal_until_gone(signal.SIGTERM, grace)
killed = set()
if left:
    left, killed = signal_until_gone(signal.SIGKILL, 10.0)
existed = os.path.isdir(directory)
shutil.rmtree(directory, ignore_errors=True)
released = False
if mode == "teardown":
    reservation, cluster, record = sys.argv[5], sys.argv[6], sys.argv[7]
    try:
        with open(reservation) as handle:
            holder = json.load(handle)
        if holder.get("cluster") == cluster and holder.get("record") == record:
            os.remove(reservation)
            released = True
    except (OSError, ValueError):
        pass
print(json.dumps({"processes": len(termed | killed), "killed": len(killed), "left": len(left),
                  "dir_removed": existed and not os.path.exists(directory), "released": released}))
"""


class HostReservedError(LaunchError):
    """Another live cluster holds the host: wait for it, or tear it down."""


@dataclass(frozen=True)
class _Host:
    """One node of a cluster: its place in the cluster and how to reach its machine."""

    node: Node
    host: SshHostSpec
    known_hosts: str | None

    def runner(self, connect_timeout_s: float, tags: dict[str, str] | None = None) -> SshRunner:
        """Tagged runners (the cluster's commands) run in the node's dir; untagged ones are for administration."""
        return SshRunner(node_name=self.node.name, host=self.host.host, port=self.host.port, user=self.host.user,
                         key_file=self.host.key_file, host_key=self.host.host_key, known_hosts=self.known_hosts,
                         workdir=self.node.workdir if tags else None, tags=tags, connect_timeout_s=connect_timeout_s)

    @property
    def reservation(self) -> str:
        return f"{self.host.workdir}/{RESERVATION}"


class SshProvider(Provider):
    name = "ssh"
    notice_source = "file"

    def __init__(self, root: Path | None = None, teardown_connect_s: float | None = None) -> None:
        """root: where cluster records live (default <workspace>/ssh-clusters)."""
        self.root = (root or workspace_dir() / "ssh-clusters").resolve()
        self.teardown_connect_s = TEARDOWN_CONNECT_S if teardown_connect_s is None else teardown_connect_s
        self.last_reports: dict[str, NodeReport] = {}
        self.last_teardown: dict[str, dict[str, Any]] = {}

    # -- records ----------------------------------------------------------------------------------------------------

    def _record(self, cluster_name: str) -> Path:
        return self.root / f"{cluster_name}.json"

    def _write_record(self, cluster: Cluster) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        target = self._record(cluster.name)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(cluster.to_json())
        os.replace(tmp, target)

    def describe(self, cluster_name: str) -> Cluster | None:
        record = self._record(cluster_name)
        return Cluster.from_json(record.read_text()) if record.is_file() else None

    def _hosts(self, cluster: Cluster) -> list[_Host]:
        ssh = cluster.owner["ssh"]
        # Not validated again: the config was checked at launch, and teardown must work even if the key file has
        # since moved (the connection then fails with a clear error instead).
        return [_Host(node=node, host=SshHostSpec.model_construct(**ssh["hosts"][node.name]),
                      known_hosts=ssh.get("known_hosts")) for node in cluster.nodes]

    # -- launch -----------------------------------------------------------------------------------------------------

    def launch(self, cluster_name: str, spec: ClusterSpec, run_id: str) -> Cluster:
        if spec.ssh is None or len(spec.ssh.hosts) < spec.nodes:
            raise InvalidRequestError("cluster.ssh.hosts: provider ssh needs at least cluster.nodes hosts")
        started = time.monotonic()
        cluster = self._new_cluster(cluster_name, spec, run_id)
        self._write_record(cluster)  # first: a launch that dies half way is still found and torn down
        hosts = self._hosts(cluster)
        reserved: set[str] = set()
        sources = self._agent_sources()
        outcomes = in_parallel(hosts, lambda host: self._prepare(host, cluster, spec, reserved, sources))
        failures = [(host, error) for host, _, error in outcomes if error is not None]
        if failures:
            self._roll_back(cluster, [host for host in hosts if host.node.name in reserved])
            unexpected = [error for _, error in failures if not isinstance(error, LaunchError | RemoteError | OSError)]
            if unexpected:
                raise unexpected[0]  # a bug, not a host problem: keep its type and traceback
            errors = [launch_error(error) for _, error in failures]
            raise type(errors[0])("; ".join(str(e) for e in errors)) from failures[0][1]
        self.last_reports = {host.node.name: report for host, report, _ in outcomes}
        attempt = Attempt(candidate="ssh", instance_type=SSH_TYPE, region=socket.gethostname(), zone=None,
                          market="on-demand", outcome="launched", error=None,
                          seconds=round(time.monotonic() - started, 3))
        cluster = replace(cluster, bootstrap={name: r.to_dict() for name, r in self.last_reports.items()},
                          attempts=(attempt.to_dict(),))
        self._write_record(cluster)
        return cluster

    def _new_cluster(self, cluster_name: str, spec: ClusterSpec, run_id: str) -> Cluster:
        assert spec.ssh is not None
        chosen = spec.ssh.hosts[: spec.nodes]
        nodes = []
        for rank, host in enumerate(chosen):
            workdir = f"{host.workdir.rstrip('/')}/{cluster_name}"
            nodes.append(Node(name=f"{cluster_name}-node-{rank}", rank=rank, address=host.host,
                              cluster_address=host.peer_address, workdir=workdir, data_dir=f"{workdir}/data",
                              ckpt_dir=f"{workdir}/ckpt", python=agent_python(workdir), node_python=host.python))
        ssh = {"hosts": {node.name: host.model_dump() for node, host in zip(nodes, chosen, strict=True)},
               "known_hosts": spec.ssh.known_hosts}
        # User machines are already paid for: the cluster costs nothing extra while it runs.
        return Cluster(name=cluster_name, provider=self.name, run_id=run_id, nodes=tuple(nodes),
                       created_at=time.time(), owner={**launcher(), "ssh": ssh}, instance_type=SSH_TYPE)

    def _agent_sources(self) -> list[BundleSource]:
        """Where each host fetches the agent's wheels it lacks: the run's store prefix, when there is one (each host
        from the store, not one copy per host over the orchestrator's uplink), else nowhere (copied from here)."""
        return [StoreSource(self.agent_store)] if self.agent_store else []

    def _prepare(self, host: _Host, cluster: Cluster, spec: ClusterSpec, reserved: set[str],
                 sources: list[BundleSource]) -> NodeReport:
        runner = host.runner(LAUNCH_CONNECT_S)
        runner.connect()
        self._reserve(runner, host, cluster)
        reserved.add(host.node.name)  # from here on, a failed launch has something to roll back on this host
        for sub in ("data", "ckpt", "logs"):
            runner.makedirs(f"{host.node.workdir}/{sub}")
        report = bootstrap_node(runner, host.host.python, host.host.agent_dir, workdir=host.node.workdir,
                                sources=sources)
        _check_fit(report, host, spec)
        return report

    def _reserve(self, runner: SshRunner, host: _Host, cluster: Cluster) -> None:
        """Hold the host for this cluster; a reservation of a cluster that is gone (or of a dead run) is taken
        over after its leftovers on the host are cleaned up."""
        runner.makedirs(host.host.workdir)
        mine = {"cluster": cluster.name, "run_id": cluster.run_id, "record": str(self._record(cluster.name)),
                "owner": {k: cluster.owner[k] for k in ("pid", "create_time", "host")}, "created_at": time.time()}
        for _ in range(3):
            if runner.create_exclusive(host.reservation, json.dumps(mine, indent=2)):
                return
            text = runner.read_text(host.reservation)
            if text is None:
                continue  # released between our create and our read: try again
            holder = _parse_reservation(text)
            if holder.get("cluster") == cluster.name and holder.get("record") == mine["record"]:
                runner.remove(host.reservation)  # ours, from an earlier attempt of this same launch
                continue
            if self._holder_live(runner, host, holder):
                raise HostReservedError(
                    f"{host.node.name}: {host.host.host}:{host.host.port} is reserved by cluster "
                    f"{holder.get('cluster')} (run {holder.get('run_id')}, launched from "
                    f"{holder.get('owner', {}).get('host')}): wait for that run to end, or tear it down "
                    f"(trainpipe down {holder.get('cluster')}) if it is no longer wanted")
            log.warning("%s: taking over %s from cluster %s, whose run is gone: cleaning up what it left",
                        host.node.name, host.reservation, holder.get("cluster"))
            self._clean_stale(runner, host, holder)
        raise HostReservedError(f"{host.node.name}: {host.reservation} keeps changing hands: another launch is "
                                "using this host right now")

    def _holder_live(self, runner: SshRunner, host: _Host, holder: dict[str, Any]) -> bool:
        owner = holder.get("owner") or {}
        record = holder.get("record")
        if owner.get("host") == socket.gethostname():
            return bool(record) and Path(record).is_file() and launcher_alive(owner, elsewhere=True)
        # Launched from another machine: live while any of its processes runs on this host (its lease watchdog
        # runs as long as the cluster does, and ends everything once its orchestrator stops renewing the lease).
        return _count(runner, host.host.python, _cluster_dir(host.host.workdir, holder.get("cluster", ""))) > 0

    def _clean_stale(self, runner: SshRunner, host: _Host, holder: dict[str, Any]) -> None:
        stale = str(holder.get("cluster", ""))
        directory = _cluster_dir(host.host.workdir, stale) if stale else ""
        if directory:
            _teardown(runner, host.host.python, directory, host.reservation, stale, str(holder.get("record")))
        runner.remove(host.reservation)

    def _roll_back(self, cluster: Cluster, hosts: list[_Host]) -> None:
        """Undo the reservations and dirs of a failed launch on the hosts it reached."""
        self._clean(cluster, hosts, LAUNCH_CONNECT_S)

    # -- replacing lost nodes ---------------------------------------------------------------------------------------

    def replace_nodes(self, cluster: Cluster, lost: Sequence[str]) -> Cluster:
        """The user's machines are the placement: a lost node's replacement is its own host again, emptied and
        bootstrapped, when it answers within teardown_connect_s and is still this cluster's (else
        ReplacementUnavailable, and the caller relaunches the whole cluster)."""
        gone = lost_nodes(cluster, lost)
        names = {node.name for node in gone}
        if self.describe(cluster.name) is None:
            raise ReplacementUnavailable(f"{cluster.name}: its record is gone: the cluster was torn down")
        hosts = [host for host in self._hosts(cluster) if host.node.name in names]
        sources = self._agent_sources()
        outcomes = in_parallel(hosts, lambda host: self._renew(host, cluster, sources))
        failures = [(host, error) for host, _, error in outcomes if error is not None]
        unexpected = [error for _, error in failures if not isinstance(error, LaunchError | RemoteError | OSError)]
        if unexpected:
            raise unexpected[0]  # a bug, not a host problem: keep its type and traceback
        if failures:
            raise ReplacementUnavailable("; ".join(f"{host.node.name} ({host.host.host}:{host.host.port}): {error}"
                                                   for host, error in failures)) from failures[0][1]
        reports = {host.node.name: report.to_dict() for host, report, _ in outcomes}
        updated = replace(cluster, bootstrap={**cluster.bootstrap, **reports}, owner=count_replaced(cluster, gone))
        self._write_record(updated)
        return updated

    def _renew(self, host: _Host, cluster: Cluster, sources: list[BundleSource]) -> NodeReport:
        """The lost node's host again: still reserved for this cluster, what the node left ended and removed, its
        dirs made and the host bootstrapped as at launch."""
        runner = host.runner(self.teardown_connect_s)
        runner.connect()
        self._reserve(runner, host, cluster)
        result = _admin(runner, host.host.python, ["empty", host.node.workdir, str(TEARDOWN_GRACE_S),
                                                   host.node.workdir])
        for sub in ("data", "ckpt", "logs"):
            runner.makedirs(f"{host.node.workdir}/{sub}")
        report = bootstrap_node(runner, host.host.python, host.host.agent_dir, workdir=host.node.workdir,
                                sources=sources)
        log.info("%s: replaced on %s (%d processes of the lost node ended)", host.node.name, host.host.host,
                 result["processes"])
        return report

    # -- teardown ---------------------------------------------------------------------------------------------------

    def terminate(self, cluster_name: str) -> bool:
        """Every host of the cluster: its processes ended, its dir and reservation removed. Hosts that cannot be
        reached are logged, listed in last_teardown, and stay on record (see _clean)."""
        cluster = self.describe(cluster_name)
        if cluster is None:
            return False
        self._clean(cluster, self._hosts(cluster), self.teardown_connect_s)
        return True  # the record existed: it is gone now, or it lists the hosts still to clean

    def _clean(self, cluster: Cluster, hosts: list[_Host], connect_s: float) -> None:
        record = str(self._record(cluster.name))

        def clean(host: _Host) -> dict[str, Any]:
            return _teardown(host.runner(connect_s), host.host.python, host.node.workdir, host.reservation,
                             cluster.name, record)

        results = in_parallel(hosts, clean)
        done = {host.node.name: result for host, result, error in results if error is None}
        failed = {host.node.name: error for host, _, error in results if error is not None}
        self.last_teardown[cluster.name] = {**done, **{name: {"error": str(e)} for name, e in failed.items()}}
        for name, result in done.items():
            log.info("teardown of %s on %s: %d processes ended (%d killed), dir %s, reservation %s", cluster.name,
                     name, result["processes"], result["killed"], "removed" if result["dir_removed"] else "gone",
                     "released" if result["released"] else "not held")
        for name, error in failed.items():
            log.error("teardown of %s: %s was not cleaned up (%s): its processes may still run; `trainpipe down %s` "
                      "once it answers", cluster.name, name, error, cluster.name)
        if not failed:
            self._record(cluster.name).unlink(missing_ok=True)
            return
        # What is left stays on record, so `trainpipe status` shows it and the sweeper tries again later.
        left = tuple(n for n in cluster.nodes if n.name in failed)
        owner = {**cluster.owner, "teardown_unreachable": sorted(failed)}
        self._write_record(replace(cluster, nodes=left, owner=owner))

    def list_clusters(self) -> list[ClusterRecord]:
        if not self.root.is_dir():
            return []
        records = []
        for path in sorted(self.root.glob("*.json")):
            cluster = Cluster.from_json(path.read_text())
            # Counting processes would take an SSH round trip to every host of every cluster, and status and the
            # sweeper call this often; whether the owner is alive is what the sweeper decides on.
            records.append(ClusterRecord(name=cluster.name, provider=self.name, run_id=cluster.run_id,
                                         created_at=cluster.created_at, nodes=len(cluster.nodes),
                                         # A launch from another machine cannot be checked from here: alive.
                                         owner_alive=launcher_alive(cluster.owner, elsewhere=True), processes=0))
        return records

    # -- running ----------------------------------------------------------------------------------------------------

    def runner(self, cluster: Cluster, node: Node) -> Runner:
        host = next(h for h in self._hosts(cluster) if h.node.name == node.name)
        return host.runner(LAUNCH_CONNECT_S, tags={CLUSTER_TAG: node.workdir, NODE_TAG: node.name})

    def preemption_notices(self, cluster: Cluster) -> list[PreemptionNotice]:
        """The notice files the nodes' watchers act on: nobody reclaims the user's own machines but the chaos
        injector, which raises a node's notice the way a cloud would."""
        return read_node_notices(cluster.nodes, lambda node: self.runner(cluster, node))

    def nodes_alive(self, cluster: Cluster) -> dict[str, bool]:
        """Reachable with its cluster dir present. A host teardown could not reach counts as alive: what it still
        runs is unknown, and `nodes left` must not claim it clean."""
        unreached = set(cluster.owner.get("teardown_unreachable", ()))

        def alive(host: _Host) -> bool:
            return host.runner(self.teardown_connect_s).exists(host.node.workdir)

        return {host.node.name: (error is None and bool(result)) or (error is not None and host.node.name in unreached)
                for host, result, error in in_parallel(self._hosts(cluster), alive)}


def _cluster_dir(workdir: str, cluster_name: str) -> str:
    return f"{workdir.rstrip('/')}/{cluster_name}"


def _parse_reservation(text: str) -> dict[str, Any]:
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return {}  # a torn or foreign file holds nothing we can honour
    return holder if isinstance(holder, dict) else {}


def _admin(runner: SshRunner, python: str, args: list[str]) -> dict[str, Any]:
    result = runner.run([python, "-c", HOST_ADMIN, *args], timeout=ADMIN_TIMEOUT_S, check=False)
    lines = [line for line in result.output.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RemoteError(f"{runner.node_name}: cleaning up with {python} failed (exit {result.returncode}): "
                          f"{result.output.strip()[-300:] or '(no output)'}")
    return json.loads(lines[-1])


def _count(runner: SshRunner, python: str, cluster_dir: str) -> int:
    return int(_admin(runner, python, ["count", cluster_dir])["processes"])


def _teardown(runner: SshRunner, python: str, cluster_dir: str, reservation: str, cluster_name: str,
              record: str) -> dict[str, Any]:
    return _admin(runner, python, ["teardown", cluster_dir, str(TEARDOWN_GRACE_S), cluster_dir, reservation,
                                   cluster_name, record])


def _check_fit(report: NodeReport, host: _Host, spec: ClusterSpec) -> None:
    """The machine has what the job asked for (the cloud optimizer checks this for cloud instances)."""
    where = f"{host.node.name} ({host.host.host})"
    if spec.accelerator:
        matching = [g for g in report.gpus if spec.accelerator.lower() in g.name.lower()]
        if len(matching) < spec.procs_per_node:
            found = ", ".join(g.name for g in report.gpus) or "none"
            raise InvalidRequestError(f"{where}: needs {spec.procs_per_node} {spec.accelerator} GPUs, has {found}"
                                      f"{f' ({report.gpu_error})' if report.gpu_error else ''}: use other hosts or "
                                      "change cluster.accelerator / procs_per_node")
    if spec.local_nvme and not report.mount.nvme:
        raise InvalidRequestError(f"{where}: workdir {host.host.workdir} is on {report.mount.source} "
                                  f"({report.mount.fstype}), not local NVMe: point workdir at the NVMe mount or set "
                                  "cluster.local_nvme: false")
    if spec.min_network_gbps and report.max_link_gbps() < spec.min_network_gbps:
        raise InvalidRequestError(f"{where}: fastest link {report.max_link_gbps():g} Gbit/s is below "
                                  f"cluster.min_network_gbps {spec.min_network_gbps:g}: use other hosts or lower it")
