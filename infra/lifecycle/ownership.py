"""One live run per cluster: a run owns its cluster, and a second orchestrator that finds a live owner touches nothing.

Ownership is what the nodes keep: every node holds an owner record (the orchestrator's run id, user, host, pid and
the process's start time, since when, the lease TTL) beside the lease its owner renews. An owner is alive while its
process runs, where that can be checked (the same host: pid and start time), and otherwise while the lease it renews
is younger than its TTL. Where a node cannot be read, the provider's own word decides (list_clusters' owner_alive:
the launcher's pid, the cloud heartbeat tag). Only a cluster whose owner is gone (or this very process: a retried
provision) is torn down or adopted.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass

import psutil

from infra.compute.access.remote import RemoteError
from infra.compute.providers.base import Cluster, Node, Provider
from infra.compute.providers.owner import START_TIME_SLACK_S
from infra.node.watchdog import LEASE_FILE

log = logging.getLogger(__name__)

OWNER_FILE = "owner.json"


class ClusterInUse(RuntimeError):
    """Another run's orchestrator owns the cluster and is alive: nothing was touched."""


@dataclass(frozen=True)
class Owner:
    run_id: str
    user: str
    host: str
    pid: int
    create_time: float  # the process's start: a pid alone is reused
    since: float  # unix time the run took the cluster
    lease_ttl_s: float

    @classmethod
    def me(cls, run_id: str, lease_ttl_s: float) -> Owner:
        process = psutil.Process()
        return cls(run_id=run_id, user=getpass.getuser(), host=socket.gethostname(), pid=process.pid,
                   create_time=process.create_time(), since=time.time(), lease_ttl_s=lease_ttl_s)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Owner:
        return cls(**json.loads(text))

    def is_this_process(self) -> bool:
        return (self.host == socket.gethostname() and self.pid == os.getpid()
                and abs(self.create_time - psutil.Process().create_time()) < START_TIME_SLACK_S)

    def alive(self, lease_age_s: float | None) -> bool:
        """On this host the process itself says; elsewhere the lease it renews (None: no lease read)."""
        if self.host == socket.gethostname():
            try:
                return abs(psutil.Process(self.pid).create_time() - self.create_time) < START_TIME_SLACK_S
            except psutil.NoSuchProcess:
                return False
        return lease_age_s is not None and lease_age_s < self.lease_ttl_s

    def describe(self, cluster_name: str, lease_age_s: float | None) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.since))
        lease = f", lease renewed {lease_age_s:.0f}s ago" if lease_age_s is not None else ""
        return (f"cluster {cluster_name} is in use by run {self.run_id}: its orchestrator (pid {self.pid} on "
                f"{self.host}, user {self.user}) owns it since {since}{lease}: let that run end, or stop it (Ctrl-C "
                f"it, or `kill {self.pid}` on {self.host}) and start this one again once it is gone")


def claim(provider: Provider, cluster: Cluster, nodes: list[Node] | tuple[Node, ...], owner: Owner) -> None:
    """Write the owner record on each node (beside the lease this process renews)."""
    text = owner.to_json() + "\n"
    for node in nodes:
        provider.runner(cluster, node).write_text(node.path(OWNER_FILE), text)


def _lease_age(text: str | None) -> float | None:
    try:
        return time.time() - float((text or "").strip())
    except ValueError:
        return None


def refuse_live_owner(provider: Provider, cluster_name: str) -> None:
    """ClusterInUse (one line: the owner, since when, how to stop it) when another live orchestrator owns the
    cluster; nothing otherwise: no cluster, this process's own, or an owner that is gone."""
    cluster = provider.describe(cluster_name)
    if cluster is None:
        return
    for node in cluster.nodes:
        try:
            runner = provider.runner(cluster, node)
            owner_text, lease_text = runner.read_text(node.path(OWNER_FILE)), runner.read_text(node.path(LEASE_FILE))
        except (RemoteError, OSError) as exc:
            log.warning("%s: cannot read %s's owner (%s: %s): trying the next node", cluster_name, node.name,
                        type(exc).__name__, exc)
            continue
        if owner_text is None:
            continue  # a node replaced before its claim, or a cluster launched by an older trainpipe
        owner, age = Owner.from_json(owner_text), _lease_age(lease_text)
        if owner.is_this_process() or not owner.alive(age):
            return
        raise ClusterInUse(owner.describe(cluster_name, age))
    # No node said who owns it: the provider's own record of its launcher decides.
    record = next((r for r in provider.list_clusters() if r.name == cluster_name), None)
    if record is not None and record.owner_alive:
        raise ClusterInUse(f"cluster {cluster_name} is in use by run {record.run_id}: {provider.name} reports its "
                           "launcher alive (its nodes' owner records could not be read): let that run end or stop "
                           f"it; `trainpipe down {cluster_name}` tears the cluster down once it is gone")
