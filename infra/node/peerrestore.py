"""Restore from peers: every node ends with the whole committed checkpoint while the store serves each of its files
at most once per cluster (infra/node/fanout.py's exchange, over the peers' `peer-serve`).

A file's owner is the node that wrote it (the commit's upload records): it may still hold it on its disk from
before the preemption, and then it is checked against the manifest (size and checksum) and served as it is; an
owner that does not hold it fetches it from the store. With peer replicas (infra/node/replica.py) a file written by
a node that is not among the holders (a replaced node) is owned by the holder that keeps the writer's replica, which
checks its replica against the manifest like its own files (a replica missing or bad: it fetches the file from the
store). Files no node of this cluster wrote are split among the
nodes, balanced. Every other file comes from its owner's share dir, verified against the manifest like a store's
byte; a peer gone or slow means the store, with a `fanout-fallback` event.
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from infra.checkpoints.layout import CheckpointManifest, FileEntry
from infra.checkpoints.store import CheckpointStore
from infra.node.events import NodeEvent, emit
from infra.node.fanout import Counts, Exchange, File, Piece, share_name, shares
from infra.node.protocol import NodeCommand
from infra.node.replica import REPLICA_DIR, replica_holder, replica_path
from infra.storage.base import ObjectStore
from infra.storage.checksum import checksum_file
from infra.storage.transfer import FileSpec, download

log = logging.getLogger(__name__)

INCOMING = ".peer-incoming"  # under the checkpoint's folder: a peer's file lands here under its share name first
_OWN_WORKERS = 4


def _piece(entry: FileEntry) -> File:
    return File(entry.path, entry.bytes, str(entry.checksum))


def _holds(path: Path, entry: FileEntry) -> bool:
    """Whether the node's own copy is the committed file: its size, then its checksum."""
    try:
        if not path.is_file() or path.stat().st_size != entry.bytes:
            return False
    except OSError:
        return False
    return checksum_file(path, entry.checksum.algorithm) == entry.checksum


def _copy(source: Path, target: Path) -> None:
    """A copy, not a link: a script that rewrites one of the two files in place must not change the other."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.copy")
    shutil.copyfile(source, temp)
    os.replace(temp, target)


@dataclass
class PeerFill:
    """A CheckpointStore.restore fill for node `rank` of the peers (their URLs by rank, its own included)."""

    rank: int
    peers: list[str]
    share_dir: Path
    wait_s: float
    connect_grace_s: float
    holders: tuple[int, ...] = ()  # the ranks that may hold their own parts (a replace-one's survivors); () every rank
    replica_dir: Path | None = None  # this node's replicas of its buddy's part (peer replica on)
    counts: Counts = field(default_factory=Counts)
    local_bytes: int = 0  # what the node held already, verified
    replica_bytes: int = 0  # of local_bytes, what came from its replica

    def __call__(self, checkpoints: CheckpointStore, manifest: CheckpointManifest, folder: Path) -> None:
        entries = {entry.path: entry for entry in manifest.files}
        pieces = [_piece(entry) for entry in manifest.files]
        held = {piece.key for piece in pieces if _holds(folder / piece.key, entries[piece.key])}
        for piece in pieces:
            kept = next((path for path in self._kept_copies(manifest.step, piece)
                         if piece.key not in held and _holds(path, entries[piece.key])), None)
            if kept is not None:
                _copy(kept, folder / piece.key)  # a copy: the kept one outlives what the script does to this one
                held.add(piece.key)
                self.replica_bytes += piece.size
        self.local_bytes = sum(piece.size for piece in pieces if piece.key in held)
        # The same bytes under two paths are exchanged once (one share name), from a copy held here if any.
        first: dict[str, File] = {}
        for piece in sorted(pieces, key=lambda piece: piece.key not in held):
            first.setdefault(piece.checksum, piece)
        unique = list(first.values())
        owner = self._owners(checkpoints, manifest, pieces)
        self.share_dir.mkdir(parents=True, exist_ok=True)
        exchange = Exchange(self.rank, self.peers, self.share_dir, lambda piece: folder / piece.key,
                            command=NodeCommand.RESTORE, wait_s=self.wait_s, connect_grace_s=self.connect_grace_s)

        def fetch_one(store: ObjectStore, piece: Piece, key: str) -> None:
            entry = entries[piece.key]
            spec = FileSpec(key, entry.bytes, entry.sha256, entry.crc)
            if key == piece.key:
                download(store, [spec], folder)
                return
            # A peer's copy is under its share name: verified there, then moved to its path.
            incoming = folder / INCOMING / piece.key
            download(store, [spec], incoming)
            target = folder / piece.key
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(incoming / key, target)

        def fetch_own(own: list[Piece]) -> None:
            def one(piece: Piece) -> None:
                fetch_one(source, piece, piece.key)
                exchange.publish(piece)

            with ThreadPoolExecutor(max_workers=max(1, min(_OWN_WORKERS, len(own)))) as pool:
                list(pool.map(one, own))

        source = checkpoints.source(manifest)
        try:
            self.counts = exchange.run(unique, [p for p in unique if p.key not in held], source, fetch_own,
                                       fetch_one, owner=owner)
        finally:
            shutil.rmtree(folder / INCOMING, ignore_errors=True)
        for piece in pieces:
            if piece.key not in held and first[piece.checksum] is not piece:
                _copy(folder / first[piece.checksum].key, folder / piece.key)
        emit(NodeEvent.RESTORE_FANOUT, step=manifest.step, local_bytes=self.local_bytes,
             replica_bytes=self.replica_bytes, store_bytes=self.counts.store_bytes, peer_bytes=self.counts.peer_bytes,
             fallback_files=self.counts.fallback_files, peers_gone=self.counts.peers_gone)

    @property
    def sources(self) -> dict[str, int]:
        """The restored bytes by where they came from: the store, peers, this node's disk, its peer replica."""
        return {"store": self.counts.store_bytes, "peer": self.counts.peer_bytes,
                "local": self.local_bytes - self.replica_bytes, "replica": self.replica_bytes}

    def _kept_copies(self, step: int, piece: File) -> list[Path]:
        """Where this node may keep a piece outside the checkpoint dir (peer replica on): its replica of its buddy's
        part, and its own uploaded part's links (the script may have deleted its own save since)."""
        if self.replica_dir is None:
            return []
        return [replica_path(self.replica_dir, step, piece.key),
                self.share_dir / REPLICA_DIR / share_name(piece.checksum)]

    def _owners(self, checkpoints: CheckpointStore, manifest: CheckpointManifest, pieces: list[File]
                ) -> dict[str, int]:
        """checksum -> rank, the same on every node: the node that wrote the file (a replaced one's replica holder,
        replicas on), else a balanced split."""
        nodes = len(self.peers)
        wrote = checkpoints.uploaders(manifest)
        holders = set(self.holders) or set(range(nodes))
        owner: dict[str, int] = {}
        for piece in pieces:
            rank = wrote.get(piece.key)
            if rank is not None and rank not in holders and self.replica_dir is not None \
                    and replica_holder(rank, nodes) in holders:
                rank = replica_holder(rank, nodes)
            if rank is not None and rank < nodes:
                owner[piece.checksum] = min(rank, owner.get(piece.checksum, rank))
        owner.update(shares([piece for piece in pieces if piece.checksum not in owner], nodes))
        return owner
