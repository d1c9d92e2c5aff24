"""A request whose connection stops moving bytes (held open, no reset) is found within the engine's stall bound,
cancelled and retried, on every engine; the copy still completes with the exact bytes."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from servers import GcsServer, S3Server, free_port

from infra.storage import open_store, s3
from infra.storage.checksum import Checksum, checksum_bytes
from infra.storage.s3 import MIN_PART_SIZE
from infra.storage.transfer import FileSpec, RetryPolicy, TransferConfig, download, upload

STALL_S = 2.0  # the engines' stall bound in these tests
STALL_AFTER_BYTES = 3 << 20  # the first connection that carries a body stops forwarding after this much
SIZE = 8 << 20
CONFIG = TransferConfig(workers=4, part_size=MIN_PART_SIZE, multipart_threshold=MIN_PART_SIZE,
                        retry=RetryPolicy(attempts=4, base_s=0.01, max_s=0.05), stall_timeout_s=STALL_S)


class StallingProxy:
    """A TCP proxy whose first connection to carry STALL_AFTER_BYTES stops forwarding there, in both directions;
    the client's side is held open (no FIN, no reset) until the proxy closes: a stalled path, not a broken one."""

    def __init__(self, upstream_port: int) -> None:
        self.port = free_port()
        self.upstream_port = upstream_port
        self.stalled_at: float | None = None  # time.monotonic() of the stall
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            carried = [0]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst, carried, client, upstream), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, carried: list[int], *both: socket.socket) -> None:
        try:
            while chunk := src.recv(64 << 10):
                with self._lock:
                    room = STALL_AFTER_BYTES - carried[0]
                    carried[0] += len(chunk)
                    stall = self.stalled_at is None and 0 < room <= len(chunk)
                    if stall:
                        self.stalled_at = time.monotonic()
                        self._held.append(both[0])
                    stalled = both[0] in self._held
                if stall:
                    dst.sendall(chunk[:room])
                    # The server's side goes: the emulator serves one request at a time, and one stuck on this
                    # connection would stall every retry too. The client's side stays open and silent.
                    with contextlib.suppress(OSError):
                        both[1].shutdown(socket.SHUT_RDWR)
                    both[1].close()
                if stalled:
                    self._closed.wait()  # the connection stays open, silent, until the test ends
                    return
                dst.sendall(chunk)
        except OSError:
            pass
        with self._lock:
            if both[0] in self._held:
                return
        for sock in both:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for sock in self._held:
            sock.close()


def _port(endpoint: str) -> int:
    return int(endpoint.rstrip("/").rsplit(":", 1)[1])


@pytest.fixture
def s3_proxy(s3_url: str, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, StallingProxy]]:
    proxy = StallingProxy(_port(s3_server.endpoint))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    s3._connections.clear()  # fresh clients: their first connections go through the proxy
    yield s3_url, proxy
    proxy.close()
    s3._connections.clear()


@pytest.fixture
def gcs_proxy(gs_url: str, gcs_server: GcsServer, monkeypatch: pytest.MonkeyPatch
              ) -> Iterator[tuple[str, StallingProxy]]:
    from infra.storage import gcs

    proxy = StallingProxy(_port(gcs_server.host))
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{proxy.port}")
    gcs._clients.clear()
    yield gs_url, proxy
    proxy.close()
    gcs._clients.clear()


def _stall_to_retry_s(proxy: StallingProxy, caplog: pytest.LogCaptureFixture) -> float:
    """Seconds from the stall to the first retry the engine logged for it."""
    assert proxy.stalled_at is not None, "the proxy never stalled a connection: the test moved too few bytes"
    retries = [r for r in caplog.records if r.levelno == logging.WARNING and re.search(r"stall", r.getMessage())]
    assert retries, [r.getMessage() for r in caplog.records]
    return retries[0].created - (time.time() - (time.monotonic() - proxy.stalled_at))


def _copy_through(url: str, proxy: StallingProxy, tmp_path: Path, config: TransferConfig,
                  caplog: pytest.LogCaptureFixture, direction: str, reopen: Callable[[], None]) -> float:
    data = os.urandom(SIZE)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big.bin").write_bytes(data)
    crc = str(checksum_bytes(data))
    store = open_store(url)
    with caplog.at_level(logging.WARNING):
        if direction == "download":
            proxy.stalled_at = -1.0  # the upload that puts the object in place goes through unharmed
            upload(tmp_path / "src", ["big.bin"], store, config)
            reopen()
            proxy.stalled_at = None
            started = time.monotonic()
            got = download(open_store(url), [FileSpec("big.bin", SIZE, crc=crc)], tmp_path / "dest", config)
            assert (tmp_path / "dest" / "big.bin").read_bytes() == data
            assert got.files[0].crc == crc
        else:
            started = time.monotonic()
            sent = upload(tmp_path / "src", ["big.bin"], store, config)
            kept = Checksum.parse(sent.files[0].crc or "")  # what the store checked: GCS keeps a CRC32C
            assert kept == checksum_bytes(data, kept.algorithm)
        took = time.monotonic() - started
        detected = _stall_to_retry_s(proxy, caplog)
        if direction == "upload":  # what arrived is the exact bytes: read back past the proxy's stall
            reopen()
            proxy.stalled_at = -1.0
            download(open_store(url), [FileSpec("big.bin", SIZE, crc=crc)], tmp_path / "dest", config)
            assert (tmp_path / "dest" / "big.bin").read_bytes() == data
    logging.getLogger(__name__).warning("%s: stall found after %.2fs (bound %.1fs); copy took %.1fs",
                                        direction, detected, config.stall_timeout_s, took)
    # Found within the bound (plus the pool's tick and a loaded machine's slack), not the CRT's ~30 s.
    assert detected < config.stall_timeout_s * 3, detected
    return detected


@pytest.mark.parametrize("direction", ["download", "upload"])
@pytest.mark.parametrize("engine", ["native", "python"])
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_stalled_request_is_retried_within_the_bound(
    scheme: str, engine: str, direction: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    from infra.storage import gcs

    url, proxy = request.getfixturevalue("s3_proxy" if scheme == "s3" else "gcs_proxy")
    clients = s3._connections if scheme == "s3" else gcs._clients
    _copy_through(url, proxy, tmp_path, CONFIG.but(engine=engine), caplog, direction, clients.clear)
