"""`code`: fetch the job's code archive from the store onto this node, verified, and unpack it.

A node that already holds this very code (same content hash, a recovery on the same machine) keeps it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from infra.node.events import emit, fail
from infra.storage import StorageError, open_store
from infra.storage.transfer import FileSpec, download
from infra.workload.code import CodeError, unpack

STAMP = ".trainpipe-code.sha256"  # beside the code dir, never in it: the code dir is exactly the archive's tree


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.node code", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the code archive (.tar.gz) in the store")
    parser.add_argument("--dest", required=True, type=Path, help="the code dir to (re)create")
    parser.add_argument("--sha256", help="the archive's expected sha256 (a packed local dir's content hash)")
    args = parser.parse_args(argv)
    stamp = args.dest.parent / STAMP
    if args.sha256 and args.dest.is_dir() and stamp.is_file() and stamp.read_text().strip() == args.sha256:
        emit("code", sha256=args.sha256, files=None, reused=True)
        return 0
    folder, name = args.url.rsplit("/", 1)
    fetched = args.dest.parent / "code-archive"
    try:
        result = download(open_store(folder), [FileSpec(name, sha256=args.sha256)], fetched)
        sha256 = result.files[0].sha256
        files = unpack(fetched / name, args.dest)
    except (StorageError, CodeError) as exc:
        return fail(f"code: {exc}")
    except OSError as exc:
        return fail(f"code: {exc.filename or args.dest}: {exc.strerror or exc}: check the node's disk")
    stamp.write_text(sha256 + "\n")
    emit("code", sha256=sha256, files=files, reused=False)
    return 0
