"""Peer replicas of checkpoint parts (infra/node/replica.py) on 3 local nodes with real peer servers (rclone serve
http) and a real store (rclone serve s3 behind a counting proxy): each node keeps its ring buddy's part of the newest
commit, so after node 1 is lost and replaced, the restore fills every node with 0 checkpoint bytes from the store;
a replica damaged on disk is not trusted; and a replica that cannot be pulled never stops the syncer."""

from __future__ import annotations

import shutil
import socket
import threading
from pathlib import Path

import pytest
from cloud_env import wait_for
from servers import S3Server
from test_checkpoints import make_step, node_dirs
from test_fanout_restore import NODES, STEP, commit_step, events, held, peer_credentials, whole
from test_fanout_stage import Node, Staging, counted_store, local_nodes, node_command, peer_exchange, start_server
from test_syncer import SyncProcess, is_event

from infra.checkpoints.layout import CheckpointManifest
from infra.checkpoints.steps import step_name
from infra.checkpoints.store import CheckpointStore
from infra.node.events import NodeEvent
from infra.node.protocol import RestoreRequest
from infra.node.replica import ReplicaConfig, Replicator, buddy, replica_holder
from infra.storage import open_store

__all__ = ["peer_credentials"]  # a fixture, used by name


def replica_dir(node: Node) -> Path:
    return node.workdir / "replica"


def replicate(checkpoints: CheckpointStore, manifest: CheckpointManifest, nodes: list[Node]) -> None:
    """What each node's syncer does once its part is uploaded: publish it (its record naming where it serves it: here
    the node's peer server), pull its buddy's."""
    wrote = checkpoints.uploaders(manifest)
    for node in nodes:
        record = checkpoints.current_record(STEP, node.rank, manifest.attempt)
        assert record is not None
        checkpoints.write_record(STEP, node.rank, record.files, manifest.attempt, replica_url=node.url)
    replicators = [Replicator(node.rank, NODES, checkpoints, ReplicaConfig(node.workdir / "share", replica_dir(node)),
                              manifest.attempt)
                   for node in nodes]
    for node, replicator in zip(nodes, replicators, strict=True):
        own = [entry for entry in manifest.files if wrote[entry.path] == node.rank]
        replicator.publish(STEP, node.workdir / "ckpt" / step_name(STEP), own)
        replicator.shipped(STEP)
    for replicator in replicators:
        assert replicator.wait_idle(120)


def restore(url: str, node: Node, nodes: list[Node], holders: str) -> Staging:
    return node_command(RestoreRequest(url=url, dest=str(node.workdir / "ckpt"), sync_dir=str(node.workdir / "sync"),
                                       rank=node.rank, peers=peer_exchange(node, nodes, connect_grace_s=2),
                                       holders=tuple(int(rank) for rank in holders.split(",")),
                                       replica_dir=str(replica_dir(node))))


def finished(one: Staging) -> dict[str, object]:
    assert one.process.wait(timeout=240) == 0, "".join(one.output)[-3000:]
    return events(one, NodeEvent.RESTORE_FANOUT)[0]


@pytest.mark.parametrize("case", ["intact", "damaged", "survivor-deleted-its-save"])
def test_a_replaced_node_is_filled_from_its_peers_and_their_replicas_with_no_checkpoint_bytes_from_the_store(
        s3_url: str, s3_server: S3Server, tmp_path: Path, peer_credentials: None, monkeypatch: pytest.MonkeyPatch,
        case: str) -> None:
    checkpoints = CheckpointStore(open_store(f"{s3_url}/run-1"))
    with local_nodes(tmp_path, NODES) as nodes:
        for node in nodes:
            (node.workdir / "ckpt").mkdir(parents=True)
            start_server(node)
        manifest = commit_step(checkpoints, [node.workdir / "ckpt" for node in nodes], STEP)
        expected = whole([node.workdir / "ckpt" for node in nodes])
        replicate(checkpoints, manifest, nodes)
        lost = next(entry for entry in manifest.files if entry.path == "__1_0.distcp")
        holder = nodes[replica_holder(1, NODES)]
        assert holder.rank == 2
        replica = replica_dir(holder) / step_name(STEP) / lost.path
        assert replica.read_bytes() == expected[lost.path], "node 2 keeps node 1's part, verified"
        assert not (nodes[1].workdir / "ckpt" / step_name(STEP) / "__0_0.distcp").exists(), \
            "a replica never lands in the script's checkpoint dir"
        wrote = checkpoints.uploaders(manifest)
        part = {rank: sum(e.bytes for e in manifest.files if wrote[e.path] == rank) for rank in range(NODES)}
        if case == "survivor-deleted-its-save":
            # The script's own retention removed node 0's save: its uploaded part's links (the replica holder's
            # source) still hold it.
            shutil.rmtree(nodes[0].workdir / "ckpt" / step_name(STEP))
        if case == "damaged":
            data = bytearray(replica.read_bytes())
            data[7] ^= 0xFF
            replica.write_bytes(bytes(data))

        # Node 1 is preempted: a new node with an empty disk takes its place.
        assert nodes[1].server is not None
        nodes[1].server.kill()
        nodes[1].server.wait()
        shutil.rmtree(nodes[1].workdir)
        start_server(nodes[1])

        with counted_store(s3_server, monkeypatch) as store:
            restoring = [restore(checkpoints.store.url, node, nodes, "0,2") for node in nodes]
            fanned = [finished(one) for one in restoring]
        for node in nodes:
            assert held(node.workdir / "ckpt") == expected
        from_store = [int(event["store_bytes"]) for event in fanned]
        print(f"store: {store.served} bytes served for a {manifest.total_bytes}-byte checkpoint; {case}")
        if case == "damaged":
            # Node 2 finds its replica bad, fetches that file from the store, and serves node 1.
            assert from_store == [0, 0, lost.bytes]
            assert fanned[2]["replica_bytes"] == 0
            assert lost.bytes <= store.served <= lost.bytes + 0.05 * manifest.total_bytes
        else:
            assert from_store == [0, 0, 0]
            assert fanned[2]["replica_bytes"] == lost.bytes
            # Node 0 takes node 2's part from its replica, and its own deleted one from its uploaded part's links.
            assert fanned[0]["replica_bytes"] == part[2] + (part[0] if case == "survivor-deleted-its-save" else 0)
            # What the store still serves is the manifest, records and listings: no checkpoint byte.
            assert store.served <= 0.05 * manifest.total_bytes, store.served
        assert int(fanned[1]["peer_bytes"]) == manifest.total_bytes - len(expected["extra/copy.distcp"])


def test_a_replica_that_cannot_be_pulled_never_stops_the_syncer(tmp_path: Path, peer_credentials: None) -> None:
    """Node 1 replicates node 0, which runs without replicas (its records name no server): each pull fails, is said,
    and the syncers commit every step and stop cleanly."""
    checkpoints = CheckpointStore(open_store(f"file://{tmp_path / 'store' / 'run-1'}"))
    dirs = node_dirs(tmp_path)
    stop = tmp_path / "stop"
    replica = {"replica_dir": str(tmp_path / "replica-1"), "replica_share_dir": str(tmp_path / "share-1")}
    syncers = [SyncProcess(tmp_path, dirs[0], checkpoints.store.url, 0, stop_file=str(stop)),
               SyncProcess(tmp_path, dirs[1], checkpoints.store.url, 1, stop_file=str(stop), **replica)]
    try:
        for step in (100, 200):
            for rank in (0, 1):
                make_step(dirs[rank], step, rank)
            syncers[0].wait_for(is_event(NodeEvent.COMMITTED, step))
            failed = syncers[1].wait_for(is_event(NodeEvent.REPLICA_FAILED, step))
            assert failed["buddy"] == 0 and "names no replica server" in str(failed["reason"]), failed
        stop.touch()
        assert [syncer.finish() for syncer in syncers] == [0, 0]
    finally:
        for syncer in syncers:
            if syncer.proc.poll() is None:
                syncer.proc.kill()
                syncer.proc.wait()
    assert syncers[1].uploaded_steps() == [100, 200]
    assert not (tmp_path / "replica-1" / step_name(100)).exists()
    # Node 1's own parts (of steps 100 and 200) are linked for its replica holder, under their checksums' names.
    assert len(list((tmp_path / "share-1" / "replica").iterdir())) == 2


def test_syncers_serve_their_parts_and_keep_their_buddys_part_of_the_newest_commit(
        tmp_path: Path, peer_credentials: None) -> None:
    """Two real syncers, each serving its own part (--replica-serve): after each commit each keeps the other's part
    of it; a syncer killed takes its peer server with it."""
    checkpoints = CheckpointStore(open_store(f"file://{tmp_path / 'store' / 'run-1'}"))
    dirs = node_dirs(tmp_path)
    stop = tmp_path / "stop"

    def replica(rank: int) -> dict[str, str]:
        return {"replica_dir": str(tmp_path / f"replica-{rank}"), "replica_share_dir": str(tmp_path / f"share-{rank}"),
                "replica_serve": "127.0.0.1"}

    syncers = [SyncProcess(tmp_path, dirs[rank], checkpoints.store.url, rank, stop_file=str(stop),
                           **replica(rank)) for rank in (0, 1)]
    try:
        # Each picks its port when it starts (two clusters on one host never collide) and names it in its records.
        urls = [str(syncer.wait_for(is_event(NodeEvent.REPLICA_SERVING))["url"]) for syncer in syncers]
        assert len(set(urls)) == 2, urls
        for step in (100, 200):
            for rank in (0, 1):
                make_step(dirs[rank], step, rank)
            syncers[0].wait_for(is_event(NodeEvent.COMMITTED, step))
            for syncer in syncers:
                syncer.wait_for(is_event(NodeEvent.REPLICA, step))
        for rank in (0, 1):
            record = checkpoints.current_record(200, rank, "a1")
            assert record is not None and record.replica_url == urls[rank]
            kept = tmp_path / f"replica-{rank}"
            # The two newest: the newest is pulled as soon as its part is uploaded, before it is committed.
            assert sorted(path.name for path in kept.iterdir()) == [step_name(100), step_name(200)]
            other = dirs[buddy(rank, 2)] / step_name(200)
            assert {p.name: p.read_bytes() for p in (kept / step_name(200)).iterdir()} == \
                {p.name: p.read_bytes() for p in other.iterdir()}
        # Killed however it dies, a syncer's peer server goes with it.
        ports = [int(url.rsplit(":", 1)[1]) for url in urls]
        syncers[1].proc.kill()
        syncers[1].proc.wait()
        wait_closed(ports[1])
        stop.touch()  # nothing is left to commit: the coordinator stops alone
        assert syncers[0].finish() == 0
        wait_closed(ports[0])
    finally:
        for syncer in syncers:
            if syncer.proc.poll() is None:
                syncer.proc.kill()
                syncer.proc.wait()


def test_the_same_rank_of_two_clusters_on_one_host_serves_its_part_on_a_port_of_its_own(
        tmp_path: Path, peer_credentials: None) -> None:
    """Node 0 of two clusters training on one machine: each syncer's replica server picks a free port (its records
    name it), so both serve their own part. A port fixed by rank made the second fail to bind: no replica of it."""
    from infra.storage.cloud import TransientStorageError
    from infra.storage.http import HttpStore

    checkpoints = CheckpointStore(open_store(f"file://{tmp_path / 'store' / 'run-1'}"))
    replicators = [Replicator(0, 2, checkpoints, ReplicaConfig(tmp_path / f"share-{name}", tmp_path / f"replica-{name}",
                                                               "127.0.0.1"), "a1") for name in ("a", "b")]

    def served(url: str) -> bytes | None:
        try:
            return HttpStore(url).get_bytes("whose")
        except TransientStorageError:  # refused: rclone is still starting
            return None

    try:
        urls = [str(replicator.url) for replicator in replicators]
        assert None not in [replicator.url for replicator in replicators] and len(set(urls)) == 2, urls
        for name, replicator, url in zip(("a", "b"), replicators, urls, strict=True):
            replicator.share_dir.mkdir(parents=True, exist_ok=True)
            (replicator.share_dir / "whose").write_text(name)
            wait_for(lambda url=url: served(url) is not None, 30, f"{url} serving")
            assert served(url) == name.encode()
    finally:
        for replicator in replicators:
            replicator.close()


def test_the_replica_server_is_checked_while_a_pull_is_held(
        tmp_path: Path, peer_credentials: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull waits up to COMMIT_WAIT_S (900 s) for its buddy's record, then downloads a whole part. The checks of the
    node's own peer server ran on the same thread, between pulls: a server that died during a pull went unrestarted
    (its part unserved to its replica holder) for as long. Now a pull held open by the hook does not keep a dead
    server from being restarted within the check interval."""
    from infra.node import replica

    monkeypatch.setattr(replica, "SERVER_CHECK_S", 0.1)
    checkpoints = CheckpointStore(open_store(f"file://{tmp_path / 'store' / 'run-1'}"))
    replicator = Replicator(1, 2, checkpoints, ReplicaConfig(tmp_path / "share", tmp_path / "replica", "127.0.0.1"),
                            "a1")
    pulling, release = threading.Event(), threading.Event()

    def held(step: int) -> int | None:
        pulling.set()
        assert release.wait(60), "the test never released the pull"
        return None

    replicator.pull = held  # type: ignore[method-assign]
    try:
        first = replicator.server
        assert first is not None
        replicator.shipped(STEP)
        assert pulling.wait(30), "the pull never started"
        first.kill()
        first.wait()
        seconds = wait_for(lambda: replicator.server is not first and replicator.server is not None, 10,
                           "the dead peer server restarted during the pull")
        assert replicator.server is not None and replicator.server.poll() is None
        print(f"figures: peer server restarted {seconds:.2f} s after it died, a pull held open meanwhile")
    finally:
        release.set()
        assert replicator.wait_idle(30)
        replicator.close()


def test_a_part_is_served_before_its_record_names_it(tmp_path: Path) -> None:
    """The replica holder pulls a part as soon as its upload record is in the store: the part's files must already be
    in the share dir then. Linked after the record, a pull that came in between found nothing (404) and that step's
    replica was lost."""
    from infra.checkpoints.layout import FileEntry, NodeRecord
    from infra.node.fanout import share_name
    from infra.node.protocol import SyncRequest
    from infra.node.sync import Syncer, sync_config

    share = tmp_path / "share-0"
    served_at_record: list[bool] = []

    class Watched(CheckpointStore):
        def write_record(self, step: int, node_rank: int, files: list[FileEntry], attempt: str = "",
                         replica_url: str | None = None) -> NodeRecord:
            linked = {path.name for path in (share / "replica").glob("*")}
            served_at_record.append({share_name(str(entry.checksum)) for entry in files} <= linked)
            return super().write_record(step, node_rank, files, attempt, replica_url)

    ckpt_dir = node_dirs(tmp_path)[0]
    (tmp_path / "sync-0").mkdir()
    url = f"file://{tmp_path / 'store' / 'run-1'}"
    config = sync_config(SyncRequest(ckpt_dir=str(ckpt_dir), sync_dir=str(tmp_path / "sync-0"), url=url, node_rank=0,
                                     nodes=2, attempt="a1", config_hash="h", keep=2,
                                     replica_dir=str(tmp_path / "replica-0"), replica_share_dir=str(share)))
    syncer = Syncer(config, Watched(open_store(url)))
    assert syncer.replica is not None
    try:
        make_step(ckpt_dir, 100, 0)
        syncer.find_and_ship()
    finally:
        syncer.replica.close()
    assert served_at_record == [True]


def wait_closed(port: int, timeout_s: float = 30.0) -> None:
    def closed() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return True
        return False

    wait_for(closed, timeout_s, f"port {port} closed after its syncer ended")


def test_peer_replica_is_on_with_two_nodes_off_when_asked_and_refused_on_one() -> None:
    from pydantic import ValidationError

    from infra.compute.providers import Cluster
    from infra.compute.providers import Node as ClusterNode
    from infra.job.spec import JobSpec
    from tasks.train import TrainLaunch, syncer_request

    def job(nodes: int, **checkpoints: object) -> JobSpec:
        return JobSpec.model_validate({"dataset": {"url": "file:///d"}, "cluster": {"nodes": nodes},
                                       "checkpoints": {"url": "file:///c", **checkpoints},
                                       "training": {"command": ["-m", "trainer.train"]}})

    nodes = tuple(ClusterNode(f"n{r}", r, f"10.0.0.{r + 1}", f"/w{r}", "/d", f"/w{r}/ckpt", "python") for r in (0, 1))
    cluster = Cluster("c", "local", "run", nodes, 0.0)
    launch = TrainLaunch("file:///c", "file:///d", 29500, "hash", attempt_id="0-x")
    request = syncer_request(job(2), cluster, nodes[0], launch)
    assert request.replica_serve == "10.0.0.1"  # its cluster address: the port is picked there
    assert request.replica_dir == "/w0/replica"
    assert syncer_request(job(2, peer_replica=False), cluster, nodes[0], launch).replica_serve is None
    assert not job(1).peer_replica
    with pytest.raises(ValidationError, match=r"checkpoints\.peer_replica true with cluster\.nodes 1"):
        job(1, peer_replica=True)
