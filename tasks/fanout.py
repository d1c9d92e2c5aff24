"""Fan-out staging, the orchestrator's side: whether a cluster uses it, and every node's peer server around the
stage (infra/node/fanout.py is the node's side); and the syncer's flags of the peer replicas of checkpoint parts
(infra/node/replica.py)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from infra.compute.access.remote import Process, last_error
from infra.compute.providers import Cluster, Node, get_provider
from infra.node.fanout import PEER_PORT_BASE, REPLICA_PORT_BASE, SHARE_DIR, peer_url
from infra.node.replica import REPLICA_DIR, buddy
from infra.storage.http import PASS_ENV, USER_ENV

log = logging.getLogger(__name__)

# A node reading an object store rarely gets more than this; a cluster whose slowest node-to-node link is slower
# gains nothing from filling its nodes from each other.
AUTO_MIN_LINK_GBPS = 1.0


def decide(mode: str, nodes: int, bench: dict[str, Any] | None, store_urls: Sequence[str] = ()) -> tuple[bool, str]:
    """Whether the cluster fans out (dataset.fanout), and why: the run summary says it. store_urls: where the staged
    bytes come from (the dataset's and the inputs' stores)."""
    if nodes < 2:
        return False, "one node: nothing to exchange"
    if mode != "auto":
        return mode == "on", f"dataset.fanout is {mode}"
    if store_urls and all(url.startswith("file://") for url in store_urls):
        # A path each node reads at its disk's speed (this machine's disk, or a shared mount): no egress to save.
        return False, "dataset.fanout auto: the store is a local path (file://): fan-out is off"
    links = (bench or {}).get("measurement", {}).get("links", [])
    if not links:
        return False, "dataset.fanout auto: no node-to-node figure (cluster.verify.bench is off): fan-out is off"
    slowest = min(link["gbps"] for link in links)
    if slowest < AUTO_MIN_LINK_GBPS:
        return False, (f"dataset.fanout auto: the slowest node-to-node link ({slowest:g} Gbit/s) is below "
                       f"{AUTO_MIN_LINK_GBPS:g} Gbit/s: fan-out is off")
    return True, f"dataset.fanout auto: the slowest node-to-node link is {slowest:g} Gbit/s: fan-out is on"


def peer_credentials() -> dict[str, str]:
    """A pair of peer-server credentials made for one use (a stage, a training launch), for the environment."""
    return {USER_ENV: f"run-{secrets.token_hex(4)}", PASS_ENV: secrets.token_urlsafe(24)}


def replica_argv(cluster: Cluster, node: Node) -> list[str]:
    """A node's syncer flags for checkpoints.peer_replica: it serves its share dir on its replica port while it runs
    and keeps its ring buddy's part under <workdir>/replica (credentials: peer_credentials in its environment)."""
    other = next(peer for peer in cluster.nodes if peer.rank == buddy(node.rank, len(cluster.nodes)))
    return ["--replica-buddy", peer_url(other.address, other.rank, REPLICA_PORT_BASE), "--replica-dir",
            node.path(REPLICA_DIR), "--replica-share-dir", node.path(SHARE_DIR),
            "--replica-serve", f"{node.address}:{REPLICA_PORT_BASE + node.rank}"]


@contextmanager
def peer_servers(cluster: Cluster) -> Iterator[tuple[list[str], dict[str, str]]]:
    """Every node serving its share dir on its cluster address (rank r: port PEER_PORT_BASE + r), with a pair of
    credentials made for this stage and passed in the environment, never on a command line; yields the peers' URLs
    by rank and that environment (the stagers need it too). Stopped on exit; teardown kills them anyway (they carry
    the cluster's process tags)."""
    env = peer_credentials()
    provider = get_provider(cluster.provider)
    started: list[tuple[str, Process]] = []

    def start(node: Node) -> Process:
        return provider.runner(cluster, node).start(
            [node.python, "-m", "infra.node", "peer-serve", "--dir", node.path(SHARE_DIR),
             "--addr", f"{node.address}:{PEER_PORT_BASE + node.rank}"],
            env=env, log_path=node.path("logs", "peer-serve.log"))

    try:
        # All at once: a start over SSH takes a round trip or more, and the stagers wait for none of them (a server
        # still starting is retried for the connect grace).
        with ThreadPoolExecutor(max_workers=len(cluster.nodes)) as pool:
            starting = [(node.name, pool.submit(start, node)) for node in cluster.nodes]
        failed = None
        for name, future in starting:
            if future.exception() is None:
                started.append((name, future.result()))
            else:
                failed = failed or future.exception()
        if failed is not None:
            raise failed
        yield [peer_url(node.address, node.rank) for node in cluster.nodes], env
    finally:
        def stop(name: str, process: Process) -> None:
            code = process.poll()
            if code is not None:
                # Its peers took what it owed from the store (each said so in a fanout-fallback event); this says why.
                log.warning("%s: peer server exited %s during the exchange: %s", name, code,
                            last_error(process, ("peer-serve:", "CRITICAL")))
                return
            log.info("%s: peer server stopped (exit %s)", name, process.terminate(grace_s=5.0))

        with ThreadPoolExecutor(max_workers=max(1, len(started))) as pool:
            for stopping in [pool.submit(stop, name, process) for name, process in started]:
                stopping.result()
