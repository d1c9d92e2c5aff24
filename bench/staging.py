"""The staging benchmark: fan-out off against on, on a netns cluster (2 and 4 nodes by default) whose store sits
behind a link slower than the nodes' (NetnsStore: `rclone serve s3` in a namespace of its own, tc tbf shaping).

For each node count one cluster is launched (provider netns) and the same replicated dataset is staged twice with
the node agent's own `stage` command on every node at once, as the stage task runs it: fan-out off, then (after the
nodes' data dirs, object caches and share dirs are emptied, so both fetch everything) fan-out on, with every node's
peer server up (tasks.fanout.peer_servers). Per run:

- store bytes: what the store sent, counted at the store: the tx counter of the store namespace's own interface
  (every byte it put on its link, HTTP and TCP/IP headers included), not what the clients say they read;
- wall time: from the first peer server (fan-out) or stager started to the last stager ended and every peer server
  stopped: what the flow's stage phase waits for, process starts included;
- verify: every node's data dir holds every snapshot file, each matching the snapshot's checksum.

Needs root (namespaces, tc). The store is unshaped while the dataset is uploaded and snapshotted, then shaped.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest.mock import patch

from infra.analysis.predict import Hardware, staging_time
from infra.compute.access.agent import NodeAgent
from infra.compute.providers import Cluster, Node
from infra.compute.providers.netns import emulation as netns
from infra.compute.providers.netns.provider import NetnsProvider
from infra.compute.providers.netns.store import NetnsStore
from infra.compute.spec import ClusterSpec
from infra.dataset.checksums import file_matches
from infra.dataset.snapshot import DatasetSnapshot, save_snapshot, take_snapshot
from infra.dataset.stagecache import node_cache_dir
from infra.node.events import Event, NodeEvent, parse
from infra.node.fanout import SHARE_DIR
from infra.node.protocol import PeerExchange, StageRequest
from infra.node.stage import FILES_LIST
from infra.storage import open_store
from infra.storage.transfer import DEFAULT_CONFIG, upload
from tasks.fanout import peer_servers

MB = 1 << 20
FILES = 8  # the dataset's files: enough for every node of the largest cluster to own a share
STAGE_TIMEOUT_S = 600.0
WORKSPACE_ENV = "TRAINPIPE_HOME"


class StagingBenchError(RuntimeError):
    """The bench could not run, or a run staged something other than the snapshot."""


@dataclass(frozen=True)
class StagingBenchConfig:
    nodes: tuple[int, ...] = (2, 4)
    size_mb: int = 1024  # fixed costs (process starts, the exchange's last piece) amortize as on a real night
    store_mbit: float = 400.0
    node_mbit: float = 2000.0
    # Each stager's parallel transfers. Fewer than the stage command's 8: 2 nodes × 8 flows through the store's
    # 400 Mbit/s link on 2 loaded cores once stalled a connection past the CRT's socket timeout and failed the stage.
    workers: int = 4
    workdir: Path | None = None

    def problem(self) -> str | None:
        """What is wrong with the config, before anything is started (None: nothing)."""
        if not self.nodes or min(self.nodes) < 2:
            return f"nodes {list(self.nodes)}: fan-out needs clusters of 2 nodes or more (e.g. --nodes 2,4)"
        if max(self.nodes) > FILES:
            return f"nodes {max(self.nodes)}: the bench's dataset has {FILES} files, at most {FILES} nodes"
        if self.size_mb < 1:
            return f"size_mb {self.size_mb}: give at least 1 MB"
        if self.store_mbit <= 0 or self.node_mbit <= 0:
            return f"store_mbit {self.store_mbit}, node_mbit {self.node_mbit}: both must be > 0"
        return netns.problem()


@dataclass(frozen=True)
class StagingRun:
    nodes: int
    fanout: bool
    store_bytes: int  # sent by the store's interface during the run
    wall_s: float
    stage_s: float  # the slowest node's own staging time (its `staged` event): the wall time less process starts
    node_store_bytes: int  # what the stagers say they read from the store (their own count, for comparison)
    node_peer_bytes: int
    fallback_files: int
    fallbacks: tuple[str, ...] = ()  # each `fanout-fallback`: the peer given up on and why


@dataclass
class StagingBenchReport:
    config: StagingBenchConfig
    dataset_bytes: int = 0
    runs: list[StagingRun] = field(default_factory=list)

    def run(self, nodes: int, fanout: bool) -> StagingRun:
        return next(r for r in self.runs if r.nodes == nodes and r.fanout is fanout)

    def ratios(self, nodes: int) -> dict[str, float]:
        """Fan-out on against off: store bytes over the dataset's (each), and wall time on / off."""
        off, on = self.run(nodes, False), self.run(nodes, True)
        return {"store_x_off": off.store_bytes / self.dataset_bytes, "store_x_on": on.store_bytes / self.dataset_bytes,
                "wall_on_off": on.wall_s / off.wall_s, "stage_on_off": on.stage_s / off.stage_s}

    def model_s(self, nodes: int, fanout: bool) -> float:
        """What `trainpipe predict` gives for this staging: the store's link shared by the nodes, the node links."""
        c = self.config
        hardware = Hardware(network_gbps=c.node_mbit / 1000, store_gbps=c.node_mbit / 1000,
                            store_egress_gbps=c.store_mbit / 1000)
        return staging_time(self.dataset_bytes, nodes, hardware, fanout)

    def table(self) -> str:
        c = self.config
        lines = [f"staging {self.dataset_bytes / 1e6:,.0f} MB replicated ({FILES} files); store link "
                 f"{c.store_mbit:g} Mbit/s, node links {c.node_mbit:g} Mbit/s; store bytes counted at the store's "
                 "interface",
                 f"{'nodes':>5} {'fan-out':>7} {'store MB':>9} {'× dataset':>9} {'wall s':>7} {'on/off':>6} "
                 f"{'stage s':>7} {'on/off':>6} {'model s':>7} {'peer MB':>8} {'fallbacks':>9}"]
        for run in sorted(self.runs, key=lambda r: (r.nodes, r.fanout)):
            ratios = self.ratios(run.nodes)
            wall, stage = ((f"{ratios['wall_on_off']:.2f}×", f"{ratios['stage_on_off']:.2f}×") if run.fanout
                           else ("", ""))
            lines.append(f"{run.nodes:>5} {'on' if run.fanout else 'off':>7} {run.store_bytes / 1e6:>9,.1f} "
                         f"{run.store_bytes / self.dataset_bytes:>8.2f}× {run.wall_s:>7.1f} {wall:>6} "
                         f"{run.stage_s:>7.1f} {stage:>6} {self.model_s(run.nodes, run.fanout):>7.1f} "
                         f"{run.node_peer_bytes / 1e6:>8,.1f} {run.fallback_files:>9}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return report_json(self.config, self.dataset_bytes,
                           [{**asdict(run), "model_s": self.model_s(run.nodes, run.fanout)} for run in self.runs],
                           ratios={str(n): self.ratios(n) for n in sorted({r.nodes for r in self.runs})})


def report_json(config: Any, dataset_bytes: int, runs: list[dict[str, Any]], **figures: Any) -> str:
    """A bench's report as --json writes it: its config (the workdir, a Path, as text), the dataset's bytes, each
    run's figures, and the figures across runs."""
    fields = {**asdict(config), "workdir": str(config.workdir) if config.workdir else None}
    return json.dumps({"config": fields, "dataset_bytes": dataset_bytes, "runs": runs, **figures}, indent=2)


def store_tx_bytes(store: NetnsStore) -> int:
    """Bytes the store has sent on its link: its namespace's interface counter."""
    links = json.loads(netns.ip("-j", "-s", "link", "show", "dev", netns.INNER_IF, namespace=store.namespace))
    return int(links[0]["stats64"]["tx"]["bytes"])


def _dataset(scratch: Path, size_mb: int) -> dict[str, int]:
    """FILES random files of size_mb in all under scratch; key -> size."""
    size = max(1, size_mb * MB // FILES)
    files = {}
    for i in range(FILES):
        key = f"shard-{i:02d}.bin"
        with open(scratch / key, "wb") as out:
            for left in range(size, 0, -4 * MB):
                out.write(os.urandom(min(left, 4 * MB)))
        files[key] = size
    return files


def _clean(cluster: Cluster) -> None:
    """Empty every node's data dir, object cache, share dir and files list: the next run fetches everything."""
    for node in cluster.nodes:
        for path in (Path(node.data_dir), Path(node_cache_dir(cluster.provider, node.workdir)),
                     Path(node.path(SHARE_DIR))):
            shutil.rmtree(path, ignore_errors=True)
        Path(node.path(FILES_LIST)).unlink(missing_ok=True)
        Path(node.data_dir).mkdir(parents=True)


def _verify(snapshot: DatasetSnapshot, node: Node) -> None:
    for file in snapshot.files:
        path = Path(node.data_dir) / file.key
        if not path.is_file() or not file_matches(path, file.checksum):
            raise StagingBenchError(f"{node.name}: {path} is missing or does not match {file.checksum}")


def _stage_node(provider: NetnsProvider, cluster: Cluster, node: Node, snapshot_url: str, workers: int,
                peers: list[str] | None, env: dict[str, str] | None) -> tuple[Event, list[str]]:
    """The node agent's stage on one node, as tasks.stage runs it; its `staged` event and its fallbacks."""
    request = StageRequest(snapshot=snapshot_url, dest=node.data_dir, rank=node.rank, nodes=len(cluster.nodes),
                           shard="replicate", workdir=node.workdir,
                           cache=node_cache_dir(cluster.provider, node.workdir), run=cluster.run_id, workers=workers,
                           peers=PeerExchange(urls=tuple(peers), share_dir=node.path(SHARE_DIR)) if peers else None)
    result = NodeAgent(provider.runner(cluster, node), node.python).run(request, env=env, timeout=STAGE_TIMEOUT_S)
    events = [e for e in map(parse, result.output.splitlines()) if e is not None]
    staged = [e for e in events if e.kind is NodeEvent.STAGED]
    if not staged:
        raise StagingBenchError(f"{node.name}: no '{NodeEvent.STAGED}' event in: {result.output[-2000:]}")
    return staged[-1], [f"{node.name} gave up on peer {e['peer']}: {e['reason']}" for e in events
                        if e.kind is NodeEvent.FANOUT_FALLBACK]


def stage_once(provider: NetnsProvider, cluster: Cluster, store: NetnsStore, snapshot: DatasetSnapshot,
               snapshot_url: str, fanout: bool, workers: int) -> StagingRun:
    """Every node stages the whole snapshot at once from empty; the store's bytes and the wall time of it all."""
    _clean(cluster)
    servers = peer_servers(cluster) if fanout else nullcontext((None, None))
    sent = store_tx_bytes(store)
    started = time.monotonic()
    with servers as (peers, env), ThreadPoolExecutor(max_workers=len(cluster.nodes)) as pool:
        results = list(pool.map(lambda node: _stage_node(provider, cluster, node, snapshot_url, workers, peers, env),
                                cluster.nodes))
    wall = time.monotonic() - started
    sent = store_tx_bytes(store) - sent
    with ThreadPoolExecutor(max_workers=len(cluster.nodes)) as pool:
        list(pool.map(lambda node: _verify(snapshot, node), cluster.nodes))
    events = [event for event, _ in results]
    return StagingRun(nodes=len(cluster.nodes), fanout=fanout, store_bytes=sent, wall_s=round(wall, 3),
                      stage_s=max(float(e["seconds"]) for e in events),
                      node_store_bytes=sum(int(e["store_bytes"]) for e in events),
                      node_peer_bytes=sum(int(e["peer_bytes"]) for e in events),
                      fallback_files=sum(int(e["fallback_files"]) for e in events),
                      fallbacks=tuple(why for _, whys in results for why in whys))


@contextmanager
def netns_cluster(nodes: int, node_mbit: float) -> Iterator[tuple[NetnsProvider, Cluster]]:
    """A cluster of the workspace's netns provider (the one tasks.fanout gets by the cluster's provider name)."""
    provider = NetnsProvider()
    name = f"bench-staging-{nodes}n-{secrets.token_hex(3)}"
    cluster = provider.launch(name, ClusterSpec(provider="netns", nodes=nodes, netns={"link_mbit": node_mbit}),
                              run_id=name)
    try:
        yield provider, cluster
    finally:
        provider.terminate(name)


def run_staging_benchmark(config: StagingBenchConfig, echo: Callable[[str], None] = print) -> StagingBenchReport:
    if (why := config.problem()) is not None:
        raise StagingBenchError(f"bench staging: {why}")
    report = StagingBenchReport(config)
    with tempfile.TemporaryDirectory(prefix="trainpipe-bench-staging-", dir=config.workdir) as temp:
        scratch = Path(temp)
        (scratch / "source").mkdir()
        # etag_hash '': rclone would hash every object on every listing and HEAD, CPU the link is meant to bound.
        # The nodes' processes inherit this process's environment: the store's endpoint and keys are set in it for
        # the bench's length (patch.dict restores it after), like the workspace of each cluster below.
        with NetnsStore(scratch / "s3", etag_hash="") as store, patch.dict(os.environ, store.env()):
            bucket = store.make_bucket("bench-staging")
            files = _dataset(scratch / "source", config.size_mb)
            dataset = open_store(f"{bucket}/dataset")
            upload(scratch / "source", sorted(files), dataset, DEFAULT_CONFIG.but(workers=8))
            snapshot = take_snapshot(dataset)
            snapshot_url = save_snapshot(open_store(f"{bucket}/ckpt/bench"), snapshot)
            report.dataset_bytes = snapshot.bytes
            store.set_link_mbit(config.store_mbit)
            for nodes in config.nodes:
                # A workspace per cluster: its nodes' object caches (beside its dir) are its own and the bench's.
                with (patch.dict(os.environ, {WORKSPACE_ENV: str(scratch / f"workspace-{nodes}")}),
                      netns_cluster(nodes, config.node_mbit) as (provider, cluster)):
                    for fanout in (False, True):
                        run = stage_once(provider, cluster, store, snapshot, snapshot_url, fanout, config.workers)
                        report.runs.append(run)
                        echo(f"{nodes} nodes, fan-out {'on' if fanout else 'off'}: store sent "
                             f"{run.store_bytes / 1e6:,.1f} MB ({run.store_bytes / snapshot.bytes:.2f}× the "
                             f"dataset) in {run.wall_s:.1f} s; every node's files verify")
                        for why in run.fallbacks:
                            echo(f"  fallback to the store: {why}")
    return report
