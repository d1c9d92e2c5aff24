"""`code`: fetch the job's code archive from the store onto this node, verified, and unpack it.

A node that already holds this very code (same content hash, a recovery on the same machine) keeps it.

With fan-out (peers, the archive's sha256 known) the store serves the archive once per cluster: its owner (the
node the exchange's split gives it to, rank 0) fetches it from the store and publishes it in its share dir; every
other node takes it from that peer's server, checked against the same sha256, and falls back to the store (with a
`fanout-fallback` event) when the owner is slow or gone (infra/node/fanout.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from infra.node.events import NodeEvent, emit, fail
from infra.node.fanout import Counts, Exchange, File, Piece, shares
from infra.node.protocol import CodeRequest, NodeCommand, NodeRequest, PeerExchange, as_request
from infra.storage import StorageError, open_store
from infra.storage.base import ObjectStore
from infra.storage.transfer import FileSpec, download, sha256_file
from infra.workload.code import CodeError, unpack

STAMP = ".trainpipe-code.sha256"  # beside the code dir, never in it: the code dir is exactly the archive's tree


def _holds(path: Path, piece: File) -> bool:
    return path.is_file() and path.stat().st_size == piece.size and f"sha256:{sha256_file(path)}" == piece.checksum


def _through_peers(request: CodeRequest, peers: PeerExchange, store: ObjectStore, name: str, fetched: Path,
                   reused: bool) -> Counts | None:
    """The archive at fetched/name through the exchange (None: this node needs nothing and owes nothing: it keeps
    its code and does not own the archive)."""
    info = store.head(name)  # the size the exchange checks a peer's copy by: metadata, no byte of the archive
    if info is None:
        raise StorageError(f"{store.url_for(name)}: no such object: publish the code first (trainpipe run does)")
    piece = File(name, info.size, f"sha256:{request.sha256}")
    owner = shares([piece], len(peers.urls))
    if reused and owner[piece.checksum] != request.rank:
        return None
    share_dir = Path(peers.share_dir)
    share_dir.mkdir(parents=True, exist_ok=True)
    exchange = Exchange(request.rank, peers.urls, share_dir, lambda _: fetched / name, command=NodeCommand.CODE,
                        wait_s=peers.wait_s, connect_grace_s=peers.connect_grace_s)

    def fetch_one(source: ObjectStore, wanted: Piece, key: str) -> None:
        # A peer serves it under its share name: verified there, then given its own name.
        download(source, [FileSpec(key, wanted.size, sha256=request.sha256)], fetched)
        if key != name:
            os.replace(fetched / key, fetched / name)

    def fetch_own(own: list[Piece]) -> None:
        for wanted in own:
            fetch_one(store, wanted, name)
            exchange.publish(wanted)

    return exchange.run([piece], [] if _holds(fetched / name, piece) else [piece], store, fetch_own, fetch_one)


def main(request: NodeRequest) -> int:
    fetching = as_request(request, CodeRequest)
    dest = Path(fetching.dest)
    stamp = dest.parent / STAMP
    reused = bool(fetching.sha256 and dest.is_dir() and stamp.is_file()
                  and stamp.read_text().strip() == fetching.sha256)
    folder, name = fetching.url.rsplit("/", 1)
    fetched = dest.parent / "code-archive"
    try:
        store = open_store(folder)
        counts = (_through_peers(fetching, fetching.peers, store, name, fetched, reused)
                  if fetching.peers is not None else None)
        if reused:
            emit(NodeEvent.CODE, sha256=fetching.sha256, files=None, reused=True)
            return 0
        if counts is None:
            result = download(store, [FileSpec(name, sha256=fetching.sha256)], fetched)
            # Without an expected sha256 the engine checked the store's CRC: the stamp still names the content's
            # sha256.
            sha256 = result.files[0].sha256 or sha256_file(fetched / name)
        else:
            sha256 = fetching.sha256
        files = unpack(fetched / name, dest)
    except (StorageError, CodeError) as exc:
        return fail(f"code: {exc}")
    except OSError as exc:
        return fail(f"code: {exc.filename or dest}: {exc.strerror or exc}: check the node's disk")
    stamp.write_text(sha256 + "\n")
    fanout = {} if counts is None else {"store_bytes": counts.store_bytes, "peer_bytes": counts.peer_bytes,
                                        "fallback_files": counts.fallback_files}
    emit(NodeEvent.CODE, sha256=sha256, files=files, reused=False, **fanout)
    return 0
