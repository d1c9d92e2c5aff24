"""Restore from peers on 3 local nodes (processes on loopback): a checkpoint committed from every node's part is
restored onto each node by the real `restore` command with the store (`rclone serve s3`, behind a proxy that counts
what it serves) read once per cluster; a node that still holds its own part serves it as it is, so the store serves
only what no node holds; a peer killed mid-restore: what it owed comes from the store, and the nodes say so."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import S3Server
from test_checkpoints import CONFIG_HASH, make_step
from test_fanout_stage import Node, Staging, counted_store, local_nodes, node_command, peer_exchange, start_server

from infra.checkpoints.layout import CheckpointManifest
from infra.checkpoints.steps import step_name
from infra.checkpoints.store import CheckpointStore
from infra.node.events import Event, NodeEvent
from infra.node.protocol import RestoreRequest
from infra.node.sync import RESTORED
from infra.storage import open_store
from infra.storage.http import PASS_ENV, USER_ENV

MB = 1 << 20
NODES = 3
STEP = 100
COPY = "extra/copy.distcp"


@pytest.fixture
def peer_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(USER_ENV, "run-" + secrets.token_hex(4))
    monkeypatch.setenv(PASS_ENV, secrets.token_urlsafe(24))


@pytest.fixture
def committed(s3_url: str, tmp_path: Path) -> tuple[CheckpointStore, CheckpointManifest, list[Path]]:
    """Step 100 committed from 3 nodes' parts (rank 1's of more than one ranged part; rank 2's with the same bytes
    under two paths); returns the writers' dirs."""
    checkpoints = CheckpointStore(open_store(f"{s3_url}/run-1"))
    writers = [tmp_path / f"writer-{rank}" / "ckpt" for rank in range(NODES)]
    for ckpt_dir in writers:
        ckpt_dir.mkdir(parents=True)
    return checkpoints, commit_step(checkpoints, writers, STEP), writers


def commit_step(checkpoints: CheckpointStore, writers: list[Path], step: int) -> CheckpointManifest:
    for rank, ckpt_dir in enumerate(writers):
        part = make_step(ckpt_dir, step, rank, size=9 * MB if rank == 1 else 2 * MB, world_size=NODES)
        if rank == 2:
            (part / "extra").mkdir()
            (part / COPY).write_bytes((part / "__2_0.distcp").read_bytes())
        checkpoints.upload_node_part(part, step, rank, list(written(ckpt_dir, step)), attempt="0-aaaa")
    manifest = checkpoints.try_commit(step, nodes=NODES, world_size=NODES, config_hash=CONFIG_HASH, attempt="0-aaaa")
    assert manifest is not None
    return manifest


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[Node]]:
    with local_nodes(tmp_path, NODES) as nodes:
        yield nodes


def start_restore(url: str, node: Node, nodes: list[Node], dest: Path, *, fanout: bool,
                  peer_wait_s: float = 60) -> Staging:
    peers = peer_exchange(node, nodes, connect_grace_s=2, wait_s=peer_wait_s) if fanout else None
    return node_command(RestoreRequest(url=url, dest=str(dest), sync_dir=str(node.workdir / "sync"),
                                       rank=node.rank if fanout else 0, peers=peers))


def finished(restoring: Staging) -> Event:
    assert restoring.process.wait(timeout=240) == 0, "".join(restoring.output)[-3000:]
    return restoring.wait_for(NodeEvent.RESTORED)


def written(ckpt_dir: Path, step: int = STEP) -> dict[str, bytes]:
    """A node's files of the step, by path in the checkpoint."""
    folder = ckpt_dir / step_name(step)
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def whole(writers: list[Path]) -> dict[str, bytes]:
    return {name: data for ckpt_dir in writers for name, data in written(ckpt_dir).items()}


held = written


def restore_all(checkpoints: CheckpointStore, nodes: list[Node], dests: list[Path], s3_server: S3Server,
                monkeypatch: pytest.MonkeyPatch, *, fanout: bool) -> tuple[int, list[Staging]]:
    """Every node's restore at once; returns the bytes the store served and the restores."""
    with counted_store(s3_server, monkeypatch) as store:
        restoring = [start_restore(checkpoints.store.url, node, nodes, dest, fanout=fanout)
                     for node, dest in zip(nodes, dests, strict=True)]
        for one in restoring:
            finished(one)
    return store.served, restoring


def events(restoring: Staging, kind: NodeEvent) -> list[Event]:
    return [event for event in restoring.events if event.kind is kind]


def test_fanout_restore_reads_the_store_once_and_every_node_has_the_whole_checkpoint(
        committed: tuple[CheckpointStore, CheckpointManifest, list[Path]], s3_server: S3Server, cluster: list[Node],
        peer_credentials: None, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoints, manifest, writers = committed
    total = manifest.total_bytes
    unique = total - len(whole(writers)[COPY])  # the same bytes under two paths are fetched once
    off, _ = restore_all(checkpoints, cluster, [n.workdir / "off" for n in cluster], s3_server, monkeypatch,
                         fanout=False)
    assert off >= NODES * total

    for node in cluster:
        start_server(node)
    on, restoring = restore_all(checkpoints, cluster, [n.workdir / "ckpt" for n in cluster], s3_server, monkeypatch,
                                fanout=True)
    print(f"store bytes / checkpoint bytes: fan-out off {off / total:.3f}, on {on / total:.3f}")
    assert on <= 1.05 * total, [e for r in restoring for e in events(r, NodeEvent.FANOUT_FALLBACK)]
    fanned = [events(r, NodeEvent.RESTORE_FANOUT)[0] for r in restoring]
    assert sum(int(e["store_bytes"]) for e in fanned) == unique
    assert sum(int(e["peer_bytes"]) for e in fanned) == (NODES - 1) * unique
    for node in cluster:
        assert held(node.workdir / "ckpt") == whole(writers)
        # The syncer learns the restored step is committed: it never ships it again.
        assert json.loads((node.workdir / "sync" / RESTORED).read_text())["step"] == STEP


def test_nodes_holding_their_own_parts_serve_them_and_the_store_serves_only_the_rest(
        committed: tuple[CheckpointStore, CheckpointManifest, list[Path]], s3_server: S3Server, cluster: list[Node],
        peer_credentials: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes 0 and 1 survived with their own parts on their disks; node 2 is a fresh disk: only its part is read
    from the store. A node's own file that no longer matches the manifest is not trusted: it is fetched again."""
    checkpoints, manifest, writers = committed
    expected = whole(writers)
    (writers[0] / step_name(STEP) / ".metadata").write_bytes(os.urandom(2 * MB))  # same size, other bytes
    lost = len(expected["__2_0.distcp"])  # node 2's part: its copy is made on the node
    stale = len(expected[".metadata"])
    for node in cluster:
        start_server(node)
    dests = [*writers[:2], cluster[2].workdir / "ckpt"]
    served, restoring = restore_all(checkpoints, cluster, dests, s3_server, monkeypatch, fanout=True)
    print(f"store bytes / checkpoint bytes, two nodes holding their parts: {served / manifest.total_bytes:.3f}")
    assert lost + stale <= served <= lost + stale + 0.05 * manifest.total_bytes
    fanned = [events(r, NodeEvent.RESTORE_FANOUT)[0] for r in restoring]
    assert [e["local_bytes"] for e in fanned] == [len(expected["__0_0.distcp"]),
                                                  len(expected["__1_0.distcp"]), 0]
    assert sum(int(e["store_bytes"]) for e in fanned) == lost + stale
    for dest in dests:
        assert held(dest) == expected


def test_a_peer_killed_mid_restore_its_files_come_from_the_store(
        committed: tuple[CheckpointStore, CheckpointManifest, list[Path]], s3_server: S3Server, cluster: list[Node],
        peer_credentials: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 2's server is up but its restore never starts; the others wait on its file, then its server is killed:
    they take its file from the store, finish, and say so."""
    checkpoints, manifest, writers = committed
    for node in cluster:
        start_server(node)
    with counted_store(s3_server, monkeypatch) as store:
        restoring = [start_restore(checkpoints.store.url, node, cluster, node.workdir / "ckpt", fanout=True)
                     for node in cluster[:2]]
        for one in restoring:
            one.wait_for(NodeEvent.FANOUT)
        assert cluster[2].server is not None
        cluster[2].server.kill()
        cluster[2].server.wait()
        for one in restoring:
            finished(one)
    owed = len(whole(writers)["__2_0.distcp"])  # node 2's part, fetched once: its copy is made on the node
    for node, one in zip(cluster[:2], restoring, strict=True):
        assert [e["peer"] for e in events(one, NodeEvent.FANOUT_FALLBACK)] == [2]
        assert events(one, NodeEvent.RESTORE_FANOUT)[0]["fallback_files"] == 1
        assert held(node.workdir / "ckpt") == whole(writers)
    # Nodes 0 and 1 each took their own part once and node 2's part each: nothing else.
    assert store.served <= 1.05 * (manifest.total_bytes - owed + 2 * owed), store.served


@pytest.mark.parametrize("how", ["flipped", "deleted"])
def test_a_damaged_newest_step_is_set_aside_and_every_node_restores_the_one_before(
        committed: tuple[CheckpointStore, CheckpointManifest, list[Path]], s3_server: S3Server, cluster: list[Node],
        peer_credentials: None, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Step 200's file of node 1 is damaged in the store. deleted: every node sees it before fetching and restores
    step 100 from its peers. flipped (only the bytes tell): node 1 finds it fetching its part, the others when their
    wait for node 1 ends and the store sends the same bytes; each sets it aside and restores step 100."""
    checkpoints, older, writers = committed
    newest = commit_step(checkpoints, writers, 200)
    key = newest.file_key(next(e for e in newest.files if e.path == "__1_0.distcp"))
    if how == "deleted":
        checkpoints.store.delete(key)
    else:
        data = bytearray(checkpoints.store.get_bytes(key))
        data[100] ^= 0xFF
        checkpoints.store.put_bytes(key, bytes(data))
    for node in cluster:
        start_server(node)
    with counted_store(s3_server, monkeypatch) as store:
        restoring = [start_restore(checkpoints.store.url, node, cluster, node.workdir / "ckpt", fanout=True,
                                   peer_wait_s=5) for node in cluster]
        restored = [finished(one) for one in restoring]
    assert [event["step"] for event in restored] == [STEP] * NODES
    for node, one in zip(cluster, restoring, strict=True):
        assert "skipped checkpoint step 200" in "".join(one.output), "".join(one.output)[-3000:]
        assert held(node.workdir / "ckpt") == whole(writers)
        assert not (node.workdir / "ckpt" / step_name(200)).exists(), "a skipped step's files are removed"
    assert [note.step for note in checkpoints.set_aside_notes()] == [200]
    if how == "deleted":
        print(f"store bytes / step 100's bytes after a damaged step 200: {store.served / older.total_bytes:.3f}")
        assert store.served <= 1.05 * older.total_bytes
