"""Fan-out: the store is read once per cluster; every node fetches its share of the files every node needs and
takes the rest from the share's owner over the cluster network.

The exchange moves pieces (Piece: a key in the store, a size, a tagged checksum): a snapshot's files when staging,
a committed checkpoint's files when restoring (infra/node/peerrestore.py). Each node serves its share dir read-only
(`python -m infra.node peer-serve`: rclone serve http, per-run basic-auth credentials from the environment); a peer
is an http:// store the transfer engine reads like any other, and each byte from it is checked against the piece's
checksum exactly as a store's byte is. Shares are a balanced, disjoint split of the files by checksum
(infra.dataset.assign), the same on every node, unless the caller names the owners (a restore: the node that wrote
a checkpoint file, which may still hold it). A file is published (hard-linked into the share dir under its
checksum) as soon as it is verified, so peers take pieces while they arrive: a node asks the owner for each file it
wants every _POLL_MAX_S at most (a HEAD, the server's cheapest reply), so a piece leaves its owner within a tenth of a
second of landing there. A peer that cannot be reached, refuses, sends bad bytes or does not have a file within the wait
bound is done with: what it owed comes from the store, with a `fanout-fallback` event naming it and why. The bound
counts from the peer's last sign of life, not from the first ask: every node's exchange beats (rewrites HEARTBEAT in
its share dir) while it runs, so an owner whose share takes the store minutes to send is waited for, and one whose
node or stager is gone is given up on within the bound. Each command's exchange beats a heartbeat of its own
(heartbeat()), read by the same command's exchange on its peers: the code fetch and the stage run side by side on one
node, and one's beats must neither clobber the other's file nor stand for the other's life.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from infra.dataset.assign import assign
from infra.dataset.errors import DatasetError
from infra.dataset.stagecache import link_into
from infra.node.events import NodeEvent, emit
from infra.node.protocol import PEER_CONNECT_GRACE_S, PEER_WAIT_S, NodeCommand
from infra.storage.base import ObjectStore, StorageError
from infra.storage.cloud import TransientStorageError
from infra.storage.http import HttpStore

log = logging.getLogger(__name__)

SHARE_DIR = "fanout"  # under the node's workdir: what its peer server serves, each file under its checksum's name
# In the share dir (share names are "<algorithm>-<value>"), one per command (heartbeat()): rewritten every BEAT_S while
# that command's exchange runs.
HEARTBEAT = "_alive"
BEAT_S = 2.0
# A piece published is fetched within _POLL_MAX_S: the exchange's tail (each owner's last piece) waits no longer for
# it. At 8 pieces awaited per node that is ≤ 80 HEADs a second a node sends, each answered from the owner's dir.
_POLL_FIRST_S, _POLL_MAX_S = 0.02, 0.1
# Ranged GETs in flight from the peers, shared by the pieces pulled at once (peer_workers): the python engine reads
# each part's body in one thread, so a fast node link needs many in flight (on loopback, 4 × 8 MiB moved ~90 MB/s, 16
# matched curl's ~380 MB/s), above all for each owner's last piece, the exchange's tail, pulled alone.
PEER_WORKERS = 16


def heartbeat(command: NodeCommand) -> str:
    """The name of the heartbeat one command's exchange beats in the share dir and its peers' same command reads."""
    return f"{HEARTBEAT}-{command.value}"


class Piece(Protocol):
    """One file every node needs: its key in the store, its size and its tagged checksum ("crc64nvme:<base64>",
    "sha256:<hex>", ...): a SnapshotFile, or a File."""

    @property
    def key(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def checksum(self) -> str: ...


@dataclass(frozen=True)
class File:
    key: str
    size: int
    checksum: str


# Fetch one piece from a store (the store, or a peer's share dir) under the given key to where it belongs on this
# node, verified against its checksum; raises DatasetError or StorageError.
Fetch = Callable[[ObjectStore, Piece, str], None]


def share_name(checksum: str) -> str:
    """A piece's name in the share dirs: its checksum, made a safe file name and URL path (base64's '/' and '+' as
    base64url's '_' and '-'; the padding dropped). A snapshot's hex checksums keep the object cache's names."""
    algorithm, _, value = checksum.partition(":")
    return f"{algorithm}-{value.replace('/', '_').replace('+', '-').rstrip('=')}"


def shares(files: Sequence[Piece], nodes: int, holders: Sequence[int] = ()) -> dict[str, int]:
    """checksum -> the rank that fetches it from the store; every node computes the same. holders: only these ranks
    own files (the nodes that already hold them: a replaced node's survivors), default every rank."""
    unique = sorted({file.checksum: file for file in files}.values(), key=lambda f: f.key)
    if not unique:
        return {}
    ranks = sorted(holders) if holders else list(range(nodes))
    split = assign(unique, "split", min(len(ranks), len(unique)))  # it reads only a key and a size
    return {file.checksum: ranks[index] for index, share in enumerate(split) for file in share}


@dataclass
class _Peer:
    rank: int
    store: HttpStore
    gone: str | None = None  # why this node stopped asking it
    starting: bool = False  # refused a connection within the grace: its server is still starting
    beat: bytes | None = None  # its heartbeat (this command's) as last read
    alive_at: float = field(default_factory=time.monotonic)  # when it last showed life (a beat changed, a piece came)


@dataclass
class Counts:
    store_bytes: int = 0
    peer_bytes: int = 0
    fallback_files: int = 0
    fallback_bytes: int = 0
    peers_gone: dict[int, str] = field(default_factory=dict)


class Exchange:
    """One stage's exchange on node `rank` among the peers (their URLs by rank, this node's own included); `local`
    says where a verified piece lies on this node (what gets published); `command` the node command it runs in,
    whose heartbeat it beats and reads."""

    def __init__(self, rank: int, peer_urls: Sequence[str], share_dir: Path, local: Callable[[Piece], Path], *,
                 command: NodeCommand, wait_s: float = PEER_WAIT_S, connect_grace_s: float = PEER_CONNECT_GRACE_S,
                 holders: Sequence[int] = ()) -> None:
        self.rank = rank
        self.heartbeat = heartbeat(command)
        self.holders = tuple(holders)  # the ranks that own the shares (shares()); empty: every rank
        self.peers = [_Peer(r, HttpStore(url)) for r, url in enumerate(peer_urls)]
        self.share_dir = share_dir
        self.local = local
        self.wait_s = wait_s
        self.connect_grace_s = connect_grace_s
        self.counts = Counts()
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._ended = threading.Event()  # run() returned: the heartbeat stops
        self._pulling = 0  # pieces being fetched from peers now
        self._started = time.monotonic()

    def peer_workers(self, floor: int) -> int:
        """Ranged GETs in flight for a piece starting from a peer now: PEER_WORKERS shared by the pieces being pulled
        (one alone gets them all), never fewer than floor."""
        with self._lock:
            return max(floor, PEER_WORKERS // max(1, self._pulling))

    def publish(self, file: Piece) -> None:
        link_into(self.local(file), self.share_dir / share_name(file.checksum))

    def run(self, mine: Sequence[Piece], fetch: Sequence[Piece], store: ObjectStore,
            fetch_own: Callable[[list[Piece]], None], fetch_one: Fetch, owner: Mapping[str, int] | None = None
            ) -> Counts:
        """Publish what this node already holds of its share, fetch the rest of its share from the store (fetch_own
        publishes through on_fetched), and every other file of `fetch` from its owner, in parallel. owner: checksum
        -> rank for every piece of `mine`; by default a balanced split among the holders (shares)."""
        owner = shares(mine, len(self.peers), self.holders) if owner is None else owner
        wanted = {file.checksum for file in fetch}
        for file in mine:
            if owner[file.checksum] == self.rank and file.checksum not in wanted:
                self.publish(file)
        own = [file for file in fetch if owner[file.checksum] == self.rank]
        others = [file for file in fetch if owner[file.checksum] != self.rank]
        emit(NodeEvent.FANOUT, rank=self.rank, peers=len(self.peers), own_files=len(own),
             own_bytes=sum(f.size for f in own), peer_files=len(others))
        beating = threading.Thread(target=self._beat, name="fanout-heartbeat", daemon=True)
        beating.start()
        try:
            return self._exchange(own, others, owner, store, fetch_own, fetch_one)
        finally:
            self._ended.set()
            beating.join(timeout=BEAT_S + 1)

    def _exchange(self, own: list[Piece], others: list[Piece], owner: Mapping[str, int], store: ObjectStore,
                  fetch_own: Callable[[list[Piece]], None], fetch_one: Fetch) -> Counts:
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(others)))) as pool:
            pulls = [pool.submit(self._from_peer, file, self.peers[owner[file.checksum]], store, fetch_one)
                     for file in others]
            try:
                fetch_own(own)
                with self._lock:
                    self.counts.store_bytes += sum(f.size for f in own)
            except BaseException:
                self._cancel.set()
                raise
            for pull in pulls:
                pull.result()
        return self.counts

    def _beat(self) -> None:
        """This exchange's sign of life to its peers, while it runs: a new value every BEAT_S (one that stops changing
        means a stager or node gone). A beat that cannot be written is said once and the exchange goes on: its peers
        then wait only the bound for it."""
        beats = 0
        while True:
            beats += 1
            try:
                self.share_dir.mkdir(parents=True, exist_ok=True)
                # A temp file of this beater's own: two beating at once never write, or move away, each other's.
                temp = self.share_dir / f".{self.heartbeat}.{os.getpid()}.{threading.get_ident()}.tmp"
                temp.write_text(f"{self.rank} {self._started} {beats}\n")
                temp.replace(self.share_dir / self.heartbeat)
            except OSError as exc:
                log.warning("fan-out heartbeat not written (%s): peers wait for this node only %gs", exc, self.wait_s)
                return
            if self._ended.wait(BEAT_S):
                return

    def _shows_life(self, peer: _Peer) -> bool:
        """Whether the peer showed life within the bound: its heartbeat changed since last read (read now)."""
        try:
            beat = peer.store.get_bytes(self.heartbeat)
        except StorageError:
            beat = None  # no exchange running there (yet): only the time since it last showed life counts
        with self._lock:
            if beat is not None and beat != peer.beat:
                peer.beat, peer.alive_at = beat, time.monotonic()
            return time.monotonic() - peer.alive_at < self.wait_s

    def _from_peer(self, file: Piece, peer: _Peer, store: ObjectStore, fetch_one: Fetch) -> None:
        name = share_name(file.checksum)
        delay = _POLL_FIRST_S
        next_beat_check = time.monotonic() + BEAT_S
        while peer.gone is None:
            if self._cancel.is_set():
                return
            try:
                info = peer.store.head(name)
            except TransientStorageError as exc:
                if time.monotonic() - self._started < self.connect_grace_s:
                    if not peer.starting:  # said once: it is asked every _POLL_MAX_S
                        peer.starting = True
                        log.info("peer %d: %s: retrying while its server starts", peer.rank, exc)
                    info = None
                else:
                    self._give_up(peer, f"unreachable ({exc})")
                    break
            except StorageError as exc:
                self._give_up(peer, str(exc))
                break
            if info is not None and info.size == file.size:
                with self._lock:
                    self._pulling += 1
                try:
                    # The share dir holds each file under its checksum's name (one namespace for every snapshot).
                    fetch_one(peer.store, file, name)
                except (DatasetError, StorageError) as exc:
                    self._give_up(peer, f"{name}: {exc}")
                    break
                finally:
                    with self._lock:
                        self._pulling -= 1
                self.publish(file)
                with self._lock:
                    self.counts.peer_bytes += file.size
                    peer.alive_at = time.monotonic()
                return
            if time.monotonic() >= next_beat_check:
                next_beat_check = time.monotonic() + BEAT_S
                if not self._shows_life(peer):
                    self._give_up(peer, f"{name} not there and no sign of life from it for {self.wait_s:g}s")
                    break
            if self._cancel.wait(delay):
                return
            delay = min(_POLL_MAX_S, delay * 2)
        if self._cancel.is_set():
            return
        fetch_one(store, file, file.key)
        self.publish(file)
        with self._lock:
            self.counts.store_bytes += file.size
            self.counts.fallback_files += 1
            self.counts.fallback_bytes += file.size

    def _give_up(self, peer: _Peer, why: str) -> None:
        with self._lock:
            if peer.gone is not None:
                return
            peer.gone = why
            self.counts.peers_gone[peer.rank] = why
        log.warning("peer %d (%s): %s: what it owes comes from the store", peer.rank, peer.store.url, why)
        emit(NodeEvent.FANOUT_FALLBACK, peer=peer.rank, url=peer.store.url, reason=why)
