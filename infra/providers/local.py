"""The embedded default: a cluster of N nodes on this machine.

A node is a directory (its "local NVMe") plus the processes started in it. Every process carries the
cluster and node names in its environment, so terminate finds them even after the orchestrator that
started them was killed, and list_clusters lets the sweeper tear down what a dead run left.
"""

from __future__ import annotations

import logging
import shutil
import socket
import sys
import time
from pathlib import Path

import psutil

from infra.preemption import NOTICE_FILE, read_notice
from infra.processes import kill_processes, tagged_processes
from infra.providers.base import Attempt, Cluster, ClusterRecord, InvalidRequestError, Node, PreemptionNotice, Provider
from infra.remote import LocalRunner, Runner
from infra.spec import ClusterSpec
from infra.workspace import local_clusters_dir

log = logging.getLogger(__name__)

CLUSTER_TAG = "TRAINPIPE_CLUSTER"
NODE_TAG = "TRAINPIPE_NODE"
RECORD = "cluster.json"
LOCAL_TYPE = "local-process"
NODE_MARKER = ".node"  # written at launch; a node whose marker is gone was taken away


def _owner() -> dict[str, object]:
    me = psutil.Process()
    return {"pid": me.pid, "create_time": me.create_time(), "host": socket.gethostname()}


def _owner_alive(owner: dict[str, object]) -> bool:
    try:
        process = psutil.Process(int(owner["pid"]))  # type: ignore[call-overload]
        return abs(process.create_time() - float(owner["create_time"])) < 1.0  # type: ignore[arg-type]
    except (psutil.NoSuchProcess, KeyError, ValueError):
        return False


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
        nodes = []
        for rank in range(spec.nodes):
            workdir = base / f"node-{rank}"
            for sub in ("data", "ckpt", "logs"):
                (workdir / sub).mkdir(parents=True, exist_ok=True)
            (workdir / NODE_MARKER).write_text(f"{cluster_name}\n")
            nodes.append(Node(name=f"{cluster_name}-node-{rank}", rank=rank,
                              address=self._node_address(cluster_name, rank),
                              workdir=str(workdir), data_dir=str(workdir / "data"), ckpt_dir=str(workdir / "ckpt"),
                              python=sys.executable))
        # This machine is the only candidate and costs nothing extra; the record keeps the summary's shape.
        attempt = Attempt(candidate=self.name, instance_type=self.instance_type, region=socket.gethostname(), zone=None,
                          market="on-demand", outcome="launched", error=None,
                          seconds=round(time.monotonic() - started, 3))
        cluster = Cluster(name=cluster_name, provider=self.name, run_id=run_id, nodes=tuple(nodes),
                          created_at=time.time(), owner=_owner(), instance_type=self.instance_type,
                          attempts=(attempt.to_dict(),))
        (base / RECORD).write_text(cluster.to_json())
        return cluster

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

    def _terminate(self, cluster_name: str, keep_data: bool) -> bool:
        base = self._dir(cluster_name)
        processes = cluster_processes(base)
        kill_processes(processes)
        existed = base.exists()
        if existed:
            kept = {path for path in base.glob("node-*/data")} if keep_data else set()
            _remove_all_but(base, kept)
        if processes or existed:
            log.info("terminated local cluster %s (%d processes, dirs %s%s)", cluster_name, len(processes),
                     "removed" if existed else "already gone", ", nodes' data kept" if keep_data else "")
        return bool(processes) or existed

    def list_clusters(self) -> list[ClusterRecord]:
        if not self.root.is_dir():
            return []
        records = []
        for record in sorted(self.root.glob(f"*/{RECORD}")):
            cluster = Cluster.from_json(record.read_text())
            records.append(ClusterRecord(
                name=cluster.name, provider=self.name, run_id=cluster.run_id, created_at=cluster.created_at,
                nodes=len(cluster.nodes), owner_alive=_owner_alive(cluster.owner),
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
