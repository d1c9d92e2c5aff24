"""The embedded default: a cluster of N nodes on this machine.

A node is a directory (its "local NVMe") plus the processes started in it. Every process carries the
cluster and node names in its environment, so terminate finds them even after the orchestrator that
started them was killed, and list_clusters lets the sweeper tear down what a dead run left.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import psutil

from infra.compute.access.remote import LocalRunner, Runner
from infra.compute.providers.base import (
    Attempt,
    Cluster,
    ClusterRecord,
    InvalidRequestError,
    Node,
    PreemptionNotice,
    Provider,
    ReplacementUnavailable,
    count_replaced,
    lost_nodes,
)
from infra.compute.providers.owner import launcher, launcher_alive
from infra.compute.spec import ClusterSpec
from infra.dataset.stagecache import node_cache_dir
from infra.node.preemption_notice import NOTICE_FILE, read_notice
from infra.node.processes import CLUSTER_TAG, NODE_TAG, kill_processes, tagged_processes
from infra.workspace import local_clusters_dir

log = logging.getLogger(__name__)

RECORD = "cluster.json"
LOCAL_TYPE = "local-process"
NODE_MARKER = ".node"  # written at launch; a node whose marker is gone was taken away


def owner_alive(owner: dict[str, object]) -> bool:
    """A local cluster's launcher ran on this machine: a record naming another host has no live launcher here."""
    return launcher_alive(owner, elsewhere=False)


def cluster_processes(cluster_dir: Path) -> list[psutil.Process]:
    """The cluster's processes. The tag is the cluster's directory, not its name, so two workspaces that reuse
    a run id never touch each other's processes."""
    return tagged_processes(CLUSTER_TAG, str(cluster_dir))


class LocalProvider(Provider):
    name = "local"
    notice_source = "file"
    instance_type = LOCAL_TYPE  # what the run summary says the nodes ran on

    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or local_clusters_dir()).resolve()

    def _dir(self, cluster_name: str) -> Path:
        return self.root / cluster_name

    def launch(self, cluster_name: str, spec: ClusterSpec, run_id: str) -> Cluster:
        if spec.accelerator:
            raise InvalidRequestError(f"cluster.accelerator: the {self.name} provider has no {spec.accelerator} GPUs: "
                                      "remove cluster.accelerator or use a cloud provider")
        started = time.monotonic()
        base = self._dir(cluster_name)
        # One address per node, on this machine's loopback or the netns bridge: trainpipe and the peers both use it.
        addresses = [self._node_address(cluster_name, rank) for rank in range(spec.nodes)]
        nodes = tuple(Node(name=f"{cluster_name}-node-{rank}", rank=rank,
                           address=address, cluster_address=address, workdir=str(base / f"node-{rank}"),
                           data_dir=str(base / f"node-{rank}" / "data"), ckpt_dir=str(base / f"node-{rank}" / "ckpt"),
                           python=sys.executable)
                      for rank, address in enumerate(addresses))
        # This machine is the only candidate and costs nothing extra; the record keeps the summary's shape.
        attempt = Attempt(candidate=self.name, instance_type=self.instance_type, region=socket.gethostname(), zone=None,
                          market="on-demand", outcome="launched", error=None,
                          seconds=round(time.monotonic() - started, 3))
        cluster = Cluster(name=cluster_name, provider=self.name, run_id=run_id, nodes=nodes, created_at=time.time(),
                          owner=launcher(), instance_type=self.instance_type, attempts=(attempt.to_dict(),))
        # The record first, so a launch killed half way leaves nothing the sweeper cannot find by it: a new cluster
        # dir appears only with its record in it (made aside, then renamed into place); a kept one (a recovery's,
        # with the nodes' staged data) gets its record before anything else.
        if base.exists():
            _write_atomically(base / RECORD, cluster.to_json())
        else:
            staging = self._staging(cluster_name)
            shutil.rmtree(staging, ignore_errors=True)  # what an earlier launch of this very cluster left
            staging.mkdir(parents=True)
            (staging / RECORD).write_text(cluster.to_json())
            os.rename(staging, base)
        for node in nodes:
            _make_node_dir(node, cluster_name)
        return cluster

    def replace_nodes(self, cluster: Cluster, lost: Sequence[str]) -> Cluster:
        """The same node again in the same dir, empty: what is left of it (processes, files, its dataset cache) goes
        first. The record
        is rewritten (atomically) last, counting the replacements; until then teardown finds the node by the record
        it already had, since name and dir do not change."""
        base = self._dir(cluster.name)
        gone = lost_nodes(cluster, lost)
        if not (base / RECORD).is_file():
            raise ReplacementUnavailable(f"{cluster.name}: its record {base / RECORD} is gone: the cluster was torn "
                                         "down")
        for node in gone:
            self._check_replaceable(cluster, node)
        for node in gone:
            left = [p for p in cluster_processes(base) if _node_of(p) == node.name]
            kill_processes(left)
            shutil.rmtree(node.workdir, ignore_errors=True)
            # The node's dataset cache outlives its dir (across runs, as a machine's disk would): a new machine has
            # none, so the replacement is filled from its peers or the store, not from what the lost node fetched.
            shutil.rmtree(node_cache_dir(self.name, node.workdir), ignore_errors=True)
            _make_node_dir(node, cluster.name)
            log.info("%s: replaced in %s (%d processes of the lost node ended)", node.name, node.workdir, len(left))
        updated = replace(cluster, owner=count_replaced(cluster, gone))
        _write_atomically(base / RECORD, updated.to_json())
        return updated

    def _check_replaceable(self, cluster: Cluster, node: Node) -> None:
        """Raise ReplacementUnavailable when the node's place cannot take a new node now (a provider built on this
        one checks its own resources: netns, the node's namespace)."""

    def _node_address(self, cluster_name: str, rank: int) -> str:
        """Where the other nodes reach node `rank`: a provider built on this one (netns) gives each node its own."""
        return "127.0.0.1"

    def describe(self, cluster_name: str) -> Cluster | None:
        record = self._dir(cluster_name) / RECORD
        return Cluster.from_json(record.read_text()) if record.is_file() else None

    def terminate(self, cluster_name: str) -> bool:
        return self._terminate(cluster_name, keep_data=False)

    def terminate_keeping_data(self, cluster_name: str) -> bool:
        """Everything goes but each node's data dir: the relaunch reuses the shards its verified cache vouches for."""
        return self._terminate(cluster_name, keep_data=True)

    def _staging(self, cluster_name: str) -> Path:
        """Where launch writes a new cluster's record before renaming the dir into place (list_clusters finds what a
        launch killed before the rename left there too: pathlib's glob matches hidden names)."""
        return self.root / f".{cluster_name}.launching"

    def _terminate(self, cluster_name: str, keep_data: bool) -> bool:
        base = self._dir(cluster_name)
        staged = self._staging(cluster_name)
        half_launched = staged.exists()
        if half_launched:
            shutil.rmtree(staged)
            log.info("removed %s, left by a launch that did not finish", staged)
        existed = base.exists()
        ended = _end_processes_and_remove(base, keep_data)
        if ended or existed:
            log.info("terminated local cluster %s (%d processes, dirs %s%s)", cluster_name, ended,
                     "removed" if existed else "already gone", ", nodes' data kept" if keep_data else "")
        return bool(ended) or existed or half_launched

    def list_clusters(self) -> list[ClusterRecord]:
        if not self.root.is_dir():
            return []
        records = []
        for record in sorted(self.root.glob(f"*/{RECORD}")):
            cluster = Cluster.from_json(record.read_text())
            records.append(ClusterRecord(
                name=cluster.name, provider=self.name, run_id=cluster.run_id, created_at=cluster.created_at,
                nodes=len(cluster.nodes), owner_alive=owner_alive(cluster.owner),
                processes=len(cluster_processes(record.parent)),
            ))
        return records

    def runner(self, cluster: Cluster, node: Node) -> Runner:
        return LocalRunner(node.name, Path(node.workdir), self._tags(cluster, node))

    def _tags(self, cluster: Cluster, node: Node) -> dict[str, str]:
        """What every process of the node carries in its environment (terminate and the sweeper find it by them)."""
        return {CLUSTER_TAG: str(self._dir(cluster.name)), NODE_TAG: node.name}

    def preemption_notices(self, cluster: Cluster) -> list[PreemptionNotice]:
        # Local nodes are never reclaimed by anyone but us: the chaos injector raises notices on purpose.
        notices = []
        for node in cluster.nodes:
            notice = read_notice(Path(node.workdir) / NOTICE_FILE)
            if notice is not None:
                notices.append(PreemptionNotice(node=node.name, deadline=notice.deadline, reason=notice.reason))
        return notices

    def nodes_alive(self, cluster: Cluster) -> dict[str, bool]:
        # The marker, not the directory: a lease renewal racing a reclaimed node would recreate the directory.
        return {node.name: (Path(node.workdir) / NODE_MARKER).is_file() for node in cluster.nodes}


def _make_node_dir(node: Node, cluster_name: str) -> None:
    for sub in ("data", "ckpt", "logs"):
        Path(node.workdir, sub).mkdir(parents=True, exist_ok=True)
    Path(node.workdir, NODE_MARKER).write_text(f"{cluster_name}\n")


def _node_of(process: psutil.Process) -> str | None:
    try:
        return process.environ().get(NODE_TAG)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


# A process the listing missed (started by one being killed, after the listing) can still write into the dir while
# it is removed (the removal then fails with ENOTEMPTY), or outlive the removal: the cluster's processes are listed
# and ended again until a listing after the removal finds none.
REMOVAL_ROUNDS = 5


def _end_processes_and_remove(base: Path, keep_data: bool) -> int:
    """End every process of the cluster in base and remove base (but its nodes' data dirs when keep_data); the
    number of processes ended."""
    ended = 0
    for round_ in range(1, REMOVAL_ROUNDS + 1):
        processes = cluster_processes(base)
        kill_processes(processes)
        ended += len(processes)
        try:
            if base.exists():
                _remove_all_but(base, {path for path in base.glob("node-*/data")} if keep_data else set())
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.ENOENT) or round_ == REMOVAL_ROUNDS:
                raise
            log.warning("%s changed while it was removed (%s): ending the cluster's processes again (round %d of "
                        "%d)", base, exc.strerror, round_ + 1, REMOVAL_ROUNDS)
            continue
        if not cluster_processes(base):
            return ended
    left = cluster_processes(base)
    if left:
        raise RuntimeError(f"{base}: processes of the cluster kept starting while it was torn down (pids "
                           f"{', '.join(str(p.pid) for p in left)}): end them and run `trainpipe down` again")
    return ended


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _remove_all_but(root: Path, kept: set[Path]) -> None:
    """Delete root with everything under it except the kept paths (and the directories leading to them)."""
    if root in kept:
        return
    if root.is_dir() and not root.is_symlink() and any(k.is_relative_to(root) for k in kept):
        for child in root.iterdir():
            _remove_all_but(child, kept)
    elif root.is_dir() and not root.is_symlink():
        shutil.rmtree(root)
    else:
        root.unlink()
