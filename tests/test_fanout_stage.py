"""Fan-out staging (and the code archive's fan-out) on 3 local nodes (processes on loopback): the store (`rclone serve
s3`, behind a proxy that counts what it serves) is read once per cluster; the nodes take the rest from each other's
`peer-serve` (rclone serve http, per-run credentials), every byte checked against the snapshot. A peer whose server
dies mid-exchange: what it owed comes from the store, and the nodes say so.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cloud_env import wait_for
from conftest import REPO
from servers import CountingProxy, S3Server, _wait_for_port, free_port
from test_dataset_stage import freeze, put_dataset, tree

from infra.analysis.clusterbench import BenchResult, ClusterMeasurement, LinkFigure, Verdict, VerifyBench
from infra.dataset.snapshot import read_snapshot
from infra.node.events import Event, NodeEvent, parse
from infra.node.fanout import SHARE_DIR, Exchange, File, Piece, shares
from infra.node.processes import NODE_TAG, tagged_processes
from infra.node.protocol import CodeRequest, NodeRequest, PeerExchange, PeerServeRequest, StageRequest
from infra.storage import open_store
from infra.storage.base import ObjectStore
from infra.storage.http import PASS_ENV, USER_ENV
from infra.workload.code import PackedCode, pack
from tasks.fanout import decide, outcome
from tasks.results import Restored, Staged, StagedNode

MB = 1 << 20
NODES = 3


@dataclass
class Node:
    rank: int
    workdir: Path
    port: int = field(default_factory=free_port)
    server: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Staging:
    process: subprocess.Popen[str]
    events: list[Event] = field(default_factory=list)
    output: list[str] = field(default_factory=list)
    seen: threading.Condition = field(default_factory=threading.Condition)

    def follow(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self.seen:
                self.output.append(line)
                if (event := parse(line)) is not None:
                    self.events.append(event)
                self.seen.notify_all()

    def wait_for(self, kind: NodeEvent, timeout_s: float = 120.0) -> Event:
        with self.seen:
            assert self.seen.wait_for(lambda: any(e.kind is kind for e in self.events) or
                                      self.process.poll() is not None, timeout_s), f"no {kind} in {timeout_s}s"
        found = [e for e in self.events if e.kind is kind]
        assert found, "".join(self.output)[-3000:]
        return found[0]


@pytest.fixture
def credentials(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    pair = {USER_ENV: "run-" + secrets.token_hex(4), PASS_ENV: secrets.token_urlsafe(24)}
    for name, value in pair.items():
        monkeypatch.setenv(name, value)
    return pair


@pytest.fixture
def dataset(s3_server: S3Server, s3_url: str, tmp_path: Path) -> tuple[str, dict[str, bytes]]:
    """A dataset of a few MB (small files, one of more than one part, two files of the same bytes), frozen."""
    files = {f"shard-{i:02d}.bin": os.urandom(150_000 + 40_000 * i) for i in range(9)}
    files["big/weights.bin"] = os.urandom(9 * MB)
    files["copy/shard-00.bin"] = files["shard-00.bin"]
    store = open_store(f"{s3_url}/dataset")
    put_dataset(store, tmp_path / "source", files)
    return freeze(store, f"{s3_url}/ckpt/run-1"), files


@contextmanager
def counted_store(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingProxy]:
    """The nodes reach the store only through a counting proxy."""
    proxy = CountingProxy(int(s3_server.endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        yield proxy
    finally:
        proxy.close()


def start_server(node: Node) -> None:
    log = node.workdir / "peer-serve.log"
    node.workdir.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        request = PeerServeRequest(dir=str(node.workdir / "share"), addr=f"127.0.0.1:{node.port}")
        node.server = subprocess.Popen(request.command_line(sys.executable), cwd=REPO,
                                       env=request.environment(os.environ), stdout=out, stderr=subprocess.STDOUT)
    _wait_for_port(node.port, node.server, log)


def start_stage(snapshot_url: str, node: Node, nodes: list[Node], *, fanout: bool) -> Staging:
    peers = peer_exchange(node, nodes, connect_grace_s=2) if fanout else None
    return node_command(StageRequest(snapshot=snapshot_url, rank=node.rank, nodes=len(nodes),
                                     dest=str(node.workdir / "data"), workdir=str(node.workdir),
                                     cache=str(node.workdir / "cache"), run="run-1", workers=8, peers=peers))


def peer_exchange(node: Node, nodes: list[Node], *, connect_grace_s: float, wait_s: float = 60) -> PeerExchange:
    """Fan-out among the local nodes, node's share dir under its workdir."""
    return PeerExchange(urls=tuple(n.url for n in nodes), share_dir=str(node.workdir / "share"), wait_s=wait_s,
                        connect_grace_s=connect_grace_s)


def node_command(request: NodeRequest) -> Staging:
    """The request's node command started, its output followed (events as they come)."""
    process = subprocess.Popen(request.command_line(sys.executable), cwd=REPO, env=request.environment(os.environ),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    staging = Staging(process)
    threading.Thread(target=staging.follow, daemon=True).start()
    return staging


def finished(staging: Staging) -> Event:
    assert staging.process.wait(timeout=240) == 0, "".join(staging.output)[-3000:]
    return staging.wait_for(NodeEvent.STAGED)


@contextmanager
def local_nodes(root: Path, count: int = NODES) -> Iterator[list[Node]]:
    """Nodes under root; their peer servers (those started, even of nodes swapped into the list) stopped on exit."""
    nodes = [Node(rank, root / f"node-{rank}") for rank in range(count)]
    try:
        yield nodes
    finally:
        for node in nodes:
            if node.server is not None and node.server.poll() is None:
                node.server.kill()
                node.server.wait()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[Node]]:
    with local_nodes(tmp_path) as nodes:
        yield nodes


def stored_bytes(files: dict[str, bytes]) -> int:
    return sum(len(data) for data in files.values())


def test_fanout_reads_the_store_once_and_every_node_verifies(
        dataset: tuple[str, dict[str, bytes]], s3_server: S3Server, cluster: list[Node], credentials: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot_url, files = dataset
    unique = stored_bytes(files) - len(files["shard-00.bin"])  # the same bytes under two keys are fetched once
    with counted_store(s3_server, monkeypatch) as store:
        off = [finished(start_stage(snapshot_url, node, cluster, fanout=False)) for node in cluster]
    assert store.served >= NODES * unique
    assert all(event["store_bytes"] == unique and event["peer_bytes"] == 0 for event in off)

    fresh = [Node(n.rank, n.workdir.with_name(f"on-{n.rank}")) for n in cluster]
    cluster[:] = fresh  # the fixture stops these servers
    for node in fresh:
        start_server(node)
    with counted_store(s3_server, monkeypatch) as store:
        stagings = [start_stage(snapshot_url, node, fresh, fanout=True) for node in fresh]
        on = [finished(staging) for staging in stagings]
    assert store.served <= 1.05 * unique, [e for s in stagings for e in s.events if e.kind is NodeEvent.FANOUT_FALLBACK]
    assert sum(int(event["store_bytes"]) for event in on) == unique
    assert sum(int(event["peer_bytes"]) for event in on) == (NODES - 1) * unique
    assert all(event["fallback_files"] == 0 for event in on)
    for node in fresh:
        assert tree(node.workdir / "data") == files


def test_a_peer_killed_mid_exchange_its_share_comes_from_the_store(
        dataset: tuple[str, dict[str, bytes]], s3_server: S3Server, cluster: list[Node], credentials: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 2's server is up but its share never arrives (its stager is slow to start); the others wait on it, then
    its server is killed: they take its share from the store, finish, and say so."""
    snapshot_url, files = dataset
    for node in cluster:
        start_server(node)
    owner = shares(read_snapshot(snapshot_url).files, NODES)
    owed = {checksum for checksum, rank in owner.items() if rank == 2}
    snapshot_files = {f.checksum: f.size for f in read_snapshot(snapshot_url).files}
    with counted_store(s3_server, monkeypatch) as store:
        stagings = [start_stage(snapshot_url, node, cluster, fanout=True) for node in cluster[:2]]
        for staging in stagings:
            staging.wait_for(NodeEvent.FANOUT)
        assert cluster[2].server is not None
        cluster[2].server.kill()
        cluster[2].server.wait()
        staged = [finished(staging) for staging in stagings]
    for staging, event in zip(stagings, staged, strict=True):
        fallbacks = [e for e in staging.events if e.kind is NodeEvent.FANOUT_FALLBACK]
        assert [e["peer"] for e in fallbacks] == [2], fallbacks
        assert event["fallback_files"] == len(owed)
    for node in cluster[:2]:
        assert tree(node.workdir / "data") == files
    unique = sum(snapshot_files.values())
    assert store.served <= 1.05 * (unique + sum(snapshot_files[c] for c in owed)), store.served


def benched(*gbps: float) -> VerifyBench:
    """A verify stage's bench that measured node-to-node links at these speeds."""
    links = tuple(LinkFigure(src="node-0", dst=f"node-{i + 1}", gbps=g, streams=1, bytes=1, seconds=1.0,
                             receiver_gbps=g) for i, g in enumerate(gbps))
    measurement = ClusterMeasurement(nodes=len(gbps) + 1, instance_type=None, links=links, allreduce=(), disks=())
    return VerifyBench("warn", BenchResult(measurement, Verdict(checks=()), catalog_key=None))


@pytest.mark.parametrize(("mode", "nodes", "gbps", "on"), [
    ("on", 2, None, True), ("off", 4, 10.0, False), ("on", 1, None, False),
    ("auto", 4, None, False),  # no bench: no node-to-node figure, so off
    ("auto", 4, 0.4, False), ("auto", 4, 25.0, True),
])
def test_fanout_is_decided_from_the_spec_and_the_cluster_bench(mode: str, nodes: int, gbps: float | None,
                                                               on: bool) -> None:
    bench = VerifyBench("off") if gbps is None else benched(gbps, gbps * 2)
    decided, why = decide(mode, nodes, bench)
    assert decided is on and why


def test_auto_fanout_is_off_when_every_store_is_a_local_path() -> None:
    fast = benched(25.0)
    assert decide("auto", 4, fast, ["file:///data/ds", "file:///data/base"])[0] is False
    assert decide("auto", 4, fast, ["file:///data/ds", "s3://bucket/base"])[0] is True
    assert decide("on", 4, fast, ["file:///data/ds"])[0] is True


@pytest.fixture
def code_archive(s3_url: str, tmp_path: Path) -> tuple[str, PackedCode]:
    """The job's code packed and published as tasks.workload does; incompressible, so its bytes dominate a count."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('hello')\n")
    (code / "weights.bin").write_bytes(os.urandom(2 * MB))
    packed = pack(code, tmp_path / "packed")
    open_store(f"{s3_url}/code").put_file(packed.archive, packed.archive.name)
    return f"{s3_url}/code/{packed.archive.name}", packed


def start_code(url: str, packed: PackedCode, node: Node, nodes: list[Node]) -> Staging:
    return node_command(CodeRequest(url=url, dest=str(node.workdir / "code"), sha256=packed.sha256, rank=node.rank,
                                    peers=peer_exchange(node, nodes, connect_grace_s=1)))


def fetched_code(staging: Staging) -> Event:
    assert staging.process.wait(timeout=120) == 0, "".join(staging.output)[-3000:]
    return staging.wait_for(NodeEvent.CODE)


def test_the_code_archive_is_read_from_the_store_once_per_cluster(
        code_archive: tuple[str, PackedCode], s3_server: S3Server, cluster: list[Node], credentials: dict[str, str],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    url, packed = code_archive
    size = packed.archive.stat().st_size
    for node in cluster:
        start_server(node)
    with counted_store(s3_server, monkeypatch) as store:
        events = [fetched_code(staging) for staging in [start_code(url, packed, node, cluster) for node in cluster]]
    # One node read it from the store; the store sent it once (plus HEADs' and requests' headers).
    assert size <= store.served <= 1.05 * size, store.served
    assert sorted(int(e["store_bytes"]) for e in events) == [0] * (NODES - 1) + [size], events
    assert sum(int(e["peer_bytes"]) for e in events) == (NODES - 1) * size
    for node, event in zip(cluster, events, strict=True):
        assert event["sha256"] == packed.sha256 and event["fallback_files"] == 0
        assert tree(node.workdir / "code") == tree(tmp_path / "code")


def test_the_code_archive_comes_from_the_store_when_its_owner_is_gone(
        code_archive: tuple[str, PackedCode], s3_server: S3Server, cluster: list[Node], credentials: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The archive's owner (rank 0) never serves: the other nodes give up on it after the connect grace, read the
    archive from the store, and say so."""
    url, packed = code_archive
    for node in cluster[1:]:
        start_server(node)
    stagings = [start_code(url, packed, node, cluster) for node in cluster[1:]]
    for staging in stagings:
        event = fetched_code(staging)
        assert event["store_bytes"] == packed.archive.stat().st_size and event["fallback_files"] == 1
        assert [e["peer"] for e in staging.events if e.kind is NodeEvent.FANOUT_FALLBACK] == [0]


def test_an_owner_slower_than_the_wait_bound_but_alive_is_waited_for(
        tmp_path: Path, cluster: list[Node], credentials: dict[str, str]) -> None:
    """The wait for a peer's piece counted from the first ask: an owner whose share took the store longer than the
    bound (minutes, for a large share) was given up on by every node, and the store sent its share N times. Now the
    bound counts from the owner's last sign of life: its exchange's heartbeat, so it is waited for (2 s bound, a fetch
    that lasts until the taker has waited past it), while a gone one (test above) is still given up on."""
    data = os.urandom(3 * MB)
    piece = File("weights.bin", len(data), f"sha256:{hashlib.sha256(data).hexdigest()}")
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    (store_dir / piece.key).write_bytes(data)
    store = open_store(f"file://{store_dir}")
    for node in cluster[:2]:
        start_server(node)
    urls = [node.url for node in cluster[:2]]
    landed = {rank: cluster[rank].workdir / "data" for rank in (0, 1)}

    def exchange(rank: int) -> Exchange:
        return Exchange(rank, urls, cluster[rank].workdir / "share", lambda p: landed[rank] / p.key, wait_s=2.0,
                        connect_grace_s=5.0)

    def fetch_one(rank: int) -> Callable[[ObjectStore, Piece, str], None]:
        def fetch(source: ObjectStore, wanted: Piece, key: str) -> None:
            body = source.get_bytes(key)
            assert f"sha256:{hashlib.sha256(body).hexdigest()}" == wanted.checksum
            landed[rank].mkdir(parents=True, exist_ok=True)
            (landed[rank] / wanted.key).write_bytes(body)
        return fetch

    owner, taker = exchange(1), exchange(0)
    # The owner's store fetch lasts until the taker, past its wait bound, has judged the owner alive: held by that
    # event, not a sleep.
    waited_past_bound = threading.Event()
    shows_life = taker._shows_life

    def judged(peer: Any) -> bool:
        alive = shows_life(peer)
        if alive and time.monotonic() - taker._started > taker.wait_s:
            waited_past_bound.set()
        return alive

    taker._shows_life = judged  # type: ignore[method-assign]

    def slow_own(own: list[Piece]) -> None:
        assert waited_past_bound.wait(60), "the taker never waited past its bound"
        for wanted in own:
            fetch_one(1)(store, wanted, wanted.key)
            owner.publish(wanted)

    owners = {piece.checksum: 1}
    with ThreadPoolExecutor(2) as pool:
        owning = pool.submit(owner.run, [piece], [piece], store, slow_own, fetch_one(1), owners)
        counts = taker.run([piece], [piece], store, lambda own: None, fetch_one(0), owners)
        assert owning.result().store_bytes == len(data)
    assert (counts.peer_bytes, counts.store_bytes, counts.peers_gone) == (len(data), 0, {})
    assert (landed[0] / piece.key).read_bytes() == data


@contextmanager
def local_cluster(name: str, nodes: int) -> Iterator[Any]:
    from infra.compute.providers import get_provider
    from infra.compute.spec import ClusterSpec

    provider = get_provider("local")
    cluster = provider.launch(name, ClusterSpec(provider="local", nodes=nodes), name)
    try:
        yield cluster
    finally:
        provider.terminate(cluster.name)


def test_two_clusters_on_one_host_serve_their_peers_on_ports_of_their_own(
        workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two local clusters staging at once (two runs on one machine): each node's peer server picks a free port, so
    every node of both is served, its own share dir, with its own stage's credentials. Ports fixed by rank collided:
    the second cluster's servers could not bind, and its nodes took everything from the store."""
    from infra.storage.cloud import TransientStorageError
    from infra.storage.http import HttpStore
    from tasks.fanout import peer_servers

    def served(url: str, key: str) -> bytes | None:
        try:
            return HttpStore(url).get_bytes(key)
        except TransientStorageError:  # refused: rclone is still starting
            return None

    with local_cluster("tp-ports-a", 2) as first, local_cluster("tp-ports-b", 2) as second, \
            peer_servers(first) as (first_urls, first_env), peer_servers(second) as (second_urls, second_env):
        assert len(set(first_urls + second_urls)) == 4, first_urls + second_urls
        for cluster, urls, env in ((first, first_urls, first_env), (second, second_urls, second_env)):
            assert env is not None
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            for node, url in zip(cluster.nodes, urls, strict=True):
                Path(node.path(SHARE_DIR)).mkdir(parents=True, exist_ok=True)
                Path(node.path(SHARE_DIR), "whose").write_text(node.name)
                wait_for(lambda url=url: served(url, "whose") is not None, 30, f"{url} serving")
                assert served(url, "whose") == node.name.encode()


def test_a_peer_server_that_cannot_start_turns_the_exchange_off_and_says_why(
        workspace: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A node whose peer server exits before naming its port (here: its cluster address is not this machine's) means
    no exchange for that stage: every node reads the store (no URLs are handed out), and the warning says why."""
    import dataclasses
    import logging

    from tasks.fanout import peer_servers

    with local_cluster("tp-peer-nostart", 2) as cluster:
        unassignable = dataclasses.replace(cluster.nodes[1], address="192.0.2.1")  # TEST-NET-1: no local address
        broken = dataclasses.replace(cluster, nodes=(cluster.nodes[0], unassignable))
        with caplog.at_level(logging.WARNING, logger="tasks.fanout"), peer_servers(broken) as (urls, env):
            assert (urls, env) == ([], None)
    assert "fan-out is off for this stage" in caplog.text
    assert f"{unassignable.name}: peer server: exited" in caplog.text
    assert "no free port on 192.0.2.1" in caplog.text


def test_a_peer_server_that_died_during_the_exchange_is_said(
        workspace: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A node's peer server that dies mid-exchange costs its peers the store for what it owed, which they say; the
    orchestrator says which server died, not only that it was stopped."""
    import logging

    import psutil

    from tasks.fanout import peer_servers

    with local_cluster("tp-peer-died", 1) as cluster, caplog.at_level(logging.WARNING, logger="tasks.fanout"), \
            peer_servers(cluster) as (urls, _):
        assert len(urls) == 1
        port = int(urls[0].rsplit(":", 1)[1])

        def listening() -> list[psutil.Process]:
            # The peer-serve process became rclone (exec): the one listening on the port it named.
            return [p for p in tagged_processes(NODE_TAG, cluster.head.name)
                    if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                           for c in p.net_connections(kind="tcp"))]

        wait_for(lambda: listening(), 30, f"the peer server listening on {port}")
        server = listening()[0]
        server.kill()
        # It is this process's child (the local runner's): its exit is seen without reaping it (WNOWAIT), which is
        # left to the orchestrator's handle, as it would find a server that died on its own.
        wait_for(lambda: os.waitid(os.P_PID, server.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None, 30,
                 "the peer server gone")
    assert f"{cluster.head.name}: peer server exited -9" in caplog.text


def _staged(store_bytes: int, peer_bytes: int, fallback_files: int = 0) -> StagedNode:
    return StagedNode(Staged(files=1, bytes=store_bytes + peer_bytes, skipped_files=0, skipped_bytes=0,
                             node_bytes=store_bytes + peer_bytes, seconds=1.0, mb_per_s=1.0, store_bytes=store_bytes,
                             peer_bytes=peer_bytes, fallback_files=fallback_files), {})


PEERS = ["http://10.0.0.1:1", "http://10.0.0.2:1"]


@pytest.mark.parametrize(("fan", "exchanging", "peers", "nodes", "restores", "said"), [
    (True, True, PEERS, [_staged(5, 5), _staged(5, 5)], [], "ran"),
    # A resume's files from the peers count too.
    (True, True, PEERS, [], [Restored(step=1, path="p", sources={"store": 5, "peer": 5})], "ran"),
    (False, True, PEERS, [_staged(10, 0)], [], "off: dataset.fanout is off"),
    (True, False, [], [], [], "off: nothing to exchange (no staged dataset, input, resume or code archive)"),
    (True, True, [], [_staged(10, 0), _staged(10, 0)], [],
     "off: a peer server did not start (the run's log says why): every node read the store"),
    (True, True, PEERS, [_staged(10, 0, 2), _staged(10, 0, 3)], [],
     "off: the peers served nothing: the 5 files they owed came from the store"),
    (True, True, PEERS, [_staged(0, 0), _staged(0, 0)], [],
     "off: nothing to exchange: every node already held its files"),
])
def test_the_summary_says_whether_the_exchange_ran_from_what_the_nodes_reported(
        fan: bool, exchanging: bool, peers: list[str], nodes: list[StagedNode], restores: list[Restored],
        said: str) -> None:
    why = "dataset.fanout is on" if fan else "dataset.fanout is off"
    assert outcome(fan, why, exchanging, peers, nodes, restores) == said
