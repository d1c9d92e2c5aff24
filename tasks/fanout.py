"""Fan-out staging, the orchestrator's side: whether a cluster uses it, and every node's peer server around the
stage (infra/node/fanout.py is the node's side); and the syncer's flags of the peer replicas of checkpoint parts
(infra/node/replica.py)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from infra.compute.access.agent import NodeAgent
from infra.compute.access.events import EventTap
from infra.compute.access.remote import Process, RemoteError, last_error
from infra.compute.providers import Cluster, Node, provider_of
from infra.job.summary import ClusterBenchRecord
from infra.node.events import NodeEvent
from infra.node.fanout import SHARE_DIR, share_name
from infra.node.protocol import PeerServeRequest, UnshareRequest
from infra.node.replica import REPLICA_DIR
from infra.storage.http import PASS_ENV, USER_ENV
from tasks.node_output import last_event
from tasks.results import Restored, StagedNode

log = logging.getLogger(__name__)

# A node reading an object store rarely gets more than this; a cluster whose slowest node-to-node link is slower
# gains nothing from filling its nodes from each other.
AUTO_MIN_LINK_GBPS = 1.0
# A peer server names its port within this: a start over SSH, Python's start and its imports, on a loaded node.
PEER_START_S = 60.0
UNSHARE_S = 60.0  # a node's unshare: a start over SSH and one dir's links unlinked
SERVER_ERRORS = ("peer-serve:", "CRITICAL")  # a peer server's own error lines (its own, then rclone's)


def decide(mode: str, nodes: int, bench: ClusterBenchRecord | None, store_urls: Sequence[str] = ()) -> tuple[bool, str]:
    """Whether the cluster fans out (dataset.fanout), and why: the run summary says it. store_urls: where the staged
    bytes come from (the dataset's and the inputs' stores)."""
    if nodes < 2:
        return False, "one node: nothing to exchange"
    if mode != "auto":
        return mode == "on", f"dataset.fanout is {mode}"
    if store_urls and all(url.startswith("file://") for url in store_urls):
        # A path each node reads at its disk's speed (this machine's disk, or a shared mount): no egress to save.
        return False, "dataset.fanout auto: the store is a local path (file://): fan-out is off"
    slowest = bench.slowest_link_gbps if bench is not None else None
    if slowest is None:
        return False, "dataset.fanout auto: no node-to-node figure (cluster.verify.bench is off): fan-out is off"
    if slowest < AUTO_MIN_LINK_GBPS:
        return False, (f"dataset.fanout auto: the slowest node-to-node link ({slowest:g} Gbit/s) is below "
                       f"{AUTO_MIN_LINK_GBPS:g} Gbit/s: fan-out is off")
    return True, f"dataset.fanout auto: the slowest node-to-node link is {slowest:g} Gbit/s: fan-out is on"


def outcome(fan: bool, why: str, exchanging: bool, peers: Sequence[str], staged: Sequence[StagedNode],
            restored: Sequence[Restored]) -> str:
    """What the run summary says of the exchange, from what the nodes reported rather than from the setting: `ran`
    when some node took bytes from its peers, else `off: <why>`. fan, why: decide's; exchanging: there was something
    to exchange; peers: the URLs peer_servers handed out (none: a server did not start); staged, restored: the nodes'
    staging and restore events."""
    if not fan:
        return f"off: {why}"
    if not exchanging:
        return "off: nothing to exchange (no staged dataset, input, resume or code archive)"
    if not peers:
        return "off: a peer server did not start (the run's log says why): every node read the store"
    stages = [s for node in staged for s in (node.dataset, *node.inputs.values()) if s is not None]
    if sum(s.peer_bytes for s in stages) + sum(r.sources.get("peer", 0) for r in restored) > 0:
        return "ran"
    fallbacks = sum(s.fallback_files for s in stages)
    if fallbacks:
        return f"off: the peers served nothing: the {fallbacks} files they owed came from the store"
    return "off: nothing to exchange: every node already held its files"


def peer_credentials() -> dict[str, str]:
    """A pair of peer-server credentials made for one use (a stage, a training launch), for the environment."""
    return {USER_ENV: f"run-{secrets.token_hex(4)}", PASS_ENV: secrets.token_urlsafe(24)}


def replica_fields(node: Node) -> dict[str, str]:
    """A node's syncer request fields for checkpoints.peer_replica: it serves its share dir on its cluster address (a
    free port its upload records name) while it runs and keeps its ring buddy's part under <workdir>/replica
    (credentials: peer_credentials in its environment)."""
    return {"replica_dir": node.path(REPLICA_DIR), "replica_share_dir": node.path(SHARE_DIR),
            "replica_serve": node.cluster_address}


def code_share(code_sha256: str) -> str:
    """The code archive's name in the share dirs (infra/node/code.py publishes it under its sha256)."""
    return share_name(f"sha256:{code_sha256}")


@contextmanager
def peer_servers(cluster: Cluster, keep: Sequence[str] = ()) -> Iterator[tuple[list[str], dict[str, str] | None]]:
    """Every node serving its share dir on its cluster address, on a port it picks free when it starts (a fixed one
    would collide with another cluster's servers on the same host), with a pair of credentials made for this stage and
    passed in the environment, never on a command line; yields the peers' URLs by rank and that environment (the
    stagers need it too). A server that exits before naming its port (or names none within PEER_START_S) turns the
    exchange off for this stage, said in a warning: every node then reads the store, as without fan-out ([] and None
    are yielded). Stopped on exit; teardown kills them anyway (they carry the cluster's process tags). Then every
    node's share dir is pruned (unshare): what it held for this stage's exchanges would keep their bytes on the disk;
    keep: the share names left (the code archive, which a later replacement takes from the survivors)."""
    env = peer_credentials()
    provider = provider_of(cluster)
    servers: list[tuple[Node, Process, EventTap]] = []

    def start(node: Node) -> tuple[Node, Process, EventTap]:
        tap = EventTap(markers=SERVER_ERRORS)
        agent = NodeAgent(provider.runner(cluster, node), node.python, env)
        process = agent.start(PeerServeRequest(dir=node.path(SHARE_DIR), addr=f"{node.cluster_address}:0"),
                              log_path=node.path("logs", "peer-serve.log"), on_line=tap)
        return node, process, tap

    try:
        # All at once: a start over SSH takes a round trip or more.
        with ThreadPoolExecutor(max_workers=len(cluster.nodes)) as pool:
            starting = [pool.submit(start, node) for node in cluster.nodes]
        failed = None
        for future in starting:
            if future.exception() is None:
                servers.append(future.result())
            else:
                failed = failed or future.exception()
        if failed is not None:
            raise failed
        try:
            addrs = [tap.wait_for(NodeEvent.PEER_SERVING, process, PEER_START_S,
                                  f"{node.name}: peer server")["addr"] for node, process, tap in servers]
        except RemoteError as exc:
            log.warning("fan-out is off for this stage, every node reads the store: %s", exc)
            addrs = None
        yield ([f"http://{addr}" for addr in addrs], env) if addrs is not None else ([], None)
    finally:
        def stop(node: Node, process: Process) -> None:
            code = process.poll()
            if code is not None:
                # Its peers took what it owed from the store (each said so in a fanout-fallback event); this says why.
                log.warning("%s: peer server exited %s: %s", node.name, code, last_error(process, SERVER_ERRORS))
                return
            log.info("%s: peer server stopped (exit %s)", node.name, process.terminate(grace_s=5.0))

        with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
            for stopping in [pool.submit(stop, node, process) for node, process, _ in servers]:
                stopping.result()
        unshare_all(cluster, keep)


def unshare_all(cluster: Cluster, keep: Sequence[str]) -> None:
    """Every node's share dir pruned (infra/node/unshare.py), all at once. A node that cannot be reached keeps its
    links (said in a warning): its disk holds more than its budget until the next stage prunes it or teardown."""
    provider = provider_of(cluster)

    def one(node: Node) -> None:
        request = UnshareRequest(dir=node.path(SHARE_DIR), keep=tuple(keep))
        try:
            result = NodeAgent(provider.runner(cluster, node), node.python).run(request, timeout=UNSHARE_S)
        except RemoteError as exc:
            log.warning("%s: share dir not pruned, its links keep their bytes on the disk: %s", node.name, exc)
            return
        unshared = last_event(result.output, NodeEvent.UNSHARED)
        log.info("%s: share dir pruned: %d links removed, %d bytes freed", node.name, unshared["removed"],
                 unshared["freed_bytes"])

    with ThreadPoolExecutor(max_workers=max(1, len(cluster.nodes))) as pool:
        for pruning in [pool.submit(one, node) for node in cluster.nodes]:
            pruning.result()
