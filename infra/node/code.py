"""`code`: fetch the job's code archive from the store onto this node, verified, and unpack it.

A node that already holds this very code (same content hash, a recovery on the same machine) keeps it.

With fan-out (--peers, the archive's sha256 known) the store serves the archive once per cluster: its owner (the
node the exchange's split gives it to, rank 0) fetches it from the store and publishes it in its share dir; every
other node takes it from that peer's server, checked against the same sha256, and falls back to the store (with a
`fanout-fallback` event) when the owner is slow or gone (infra/node/fanout.py).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from infra.node.events import NodeEvent, emit, fail
from infra.node.fanout import Counts, Exchange, File, Piece, add_peer_arguments, shares
from infra.storage import StorageError, open_store
from infra.storage.base import ObjectStore
from infra.storage.transfer import FileSpec, download, sha256_file
from infra.workload.code import CodeError, unpack

STAMP = ".trainpipe-code.sha256"  # beside the code dir, never in it: the code dir is exactly the archive's tree


def _holds(path: Path, piece: File) -> bool:
    return path.is_file() and path.stat().st_size == piece.size and f"sha256:{sha256_file(path)}" == piece.checksum


def _through_peers(args: argparse.Namespace, store: ObjectStore, name: str, fetched: Path, reused: bool
                   ) -> Counts | None:
    """The archive at fetched/name through the exchange (None: this node needs nothing and owes nothing: it keeps
    its code and does not own the archive)."""
    info = store.head(name)  # the size the exchange checks a peer's copy by: metadata, no byte of the archive
    if info is None:
        raise StorageError(f"{store.url_for(name)}: no such object: publish the code first (trainpipe run does)")
    piece = File(name, info.size, f"sha256:{args.sha256}")
    peers = args.peers.split(",")
    owner = shares([piece], len(peers))
    if reused and owner[piece.checksum] != args.rank:
        return None
    args.share_dir.mkdir(parents=True, exist_ok=True)
    exchange = Exchange(args.rank, peers, args.share_dir, lambda _: fetched / name, wait_s=args.peer_wait,
                        connect_grace_s=args.peer_connect_grace)

    def fetch_one(source: ObjectStore, wanted: Piece, key: str) -> None:
        # A peer serves it under its share name: verified there, then given its own name.
        download(source, [FileSpec(key, wanted.size, sha256=args.sha256)], fetched)
        if key != name:
            os.replace(fetched / key, fetched / name)

    def fetch_own(own: list[Piece]) -> None:
        for wanted in own:
            fetch_one(store, wanted, name)
            exchange.publish(wanted)

    return exchange.run([piece], [] if _holds(fetched / name, piece) else [piece], store, fetch_own, fetch_one)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.node code", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the code archive (.tar.gz) in the store")
    parser.add_argument("--dest", required=True, type=Path, help="the code dir to (re)create")
    parser.add_argument("--sha256", help="the archive's expected sha256 (a packed local dir's content hash)")
    parser.add_argument("--rank", type=int, default=0, help="fan-out: this node's rank")
    add_peer_arguments(parser)
    args = parser.parse_args(argv)
    if args.peers and (args.share_dir is None or not args.sha256):
        parser.error("--peers needs --share-dir and --sha256 (a peer's copy is checked against it)")
    stamp = args.dest.parent / STAMP
    reused = bool(args.sha256 and args.dest.is_dir() and stamp.is_file() and stamp.read_text().strip() == args.sha256)
    folder, name = args.url.rsplit("/", 1)
    fetched = args.dest.parent / "code-archive"
    try:
        store = open_store(folder)
        counts = _through_peers(args, store, name, fetched, reused) if args.peers else None
        if reused:
            emit(NodeEvent.CODE, sha256=args.sha256, files=None, reused=True)
            return 0
        if counts is None:
            result = download(store, [FileSpec(name, sha256=args.sha256)], fetched)
            # Without an expected sha256 the engine checked the store's CRC: the stamp still names the content's
            # sha256.
            sha256 = result.files[0].sha256 or sha256_file(fetched / name)
        else:
            sha256 = args.sha256
        files = unpack(fetched / name, args.dest)
    except (StorageError, CodeError) as exc:
        return fail(f"code: {exc}")
    except OSError as exc:
        return fail(f"code: {exc.filename or args.dest}: {exc.strerror or exc}: check the node's disk")
    stamp.write_text(sha256 + "\n")
    fanout = {} if counts is None else {"store_bytes": counts.store_bytes, "peer_bytes": counts.peer_bytes,
                                        "fallback_files": counts.fallback_files}
    emit(NodeEvent.CODE, sha256=sha256, files=files, reused=False, **fanout)
    return 0
