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
from collections.abc import Callable
from pathlib import Path

import pytest
from azurite import AzuriteServer
from cloud_env import wait_for
from servers import BreakingProxy

from infra.storage import azure_account, open_store, s3, s3_control, s3_native
from infra.storage.checksum import Checksum, checksum_bytes
from infra.storage.s3 import MIN_PART_SIZE
from infra.storage.transfer import FileSpec, RetryPolicy, TransferConfig, download, upload

STALL_S = 2.0  # the engines' stall bound in these tests
STALL_AFTER_BYTES = 3 << 20  # the first connection that carries a body stops forwarding after this much
SIZE = 8 << 20
CONFIG = TransferConfig(workers=4, part_size=MIN_PART_SIZE, multipart_threshold=MIN_PART_SIZE,
                        retry=RetryPolicy(attempts=4, base_s=0.01, max_s=0.05), stall_timeout_s=STALL_S)


class StallingProxy(BreakingProxy):
    """A TCP proxy whose first connection to carry STALL_AFTER_BYTES stops forwarding there, in both directions;
    the client's side is held open (no FIN, no reset) until the proxy closes: a stalled path, not a broken one."""

    break_after = STALL_AFTER_BYTES

    def __init__(self, upstream_port: int) -> None:
        self.stalled_at: float | None = None  # time.monotonic() of the stall
        self._held: list[socket.socket] = []
        self._closed = threading.Event()
        super().__init__(upstream_port)

    def breaks(self, client: socket.socket) -> bool:
        if self.stalled_at is not None:
            return False
        self.stalled_at = time.monotonic()
        self._held.append(client)
        return True

    def kept_open(self, client: socket.socket) -> bool:
        return client in self._held

    def break_off(self, client: socket.socket, upstream: socket.socket) -> None:
        # The server's side goes: the emulator serves one request at a time, and one stuck on this connection would
        # stall every retry too. The client's side stays open and silent until the test ends.
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_RDWR)
        upstream.close()
        self._closed.wait()

    def close(self) -> None:
        self._closed.set()
        super().close()
        for sock in self._held:
            sock.close()


@pytest.fixture(autouse=True)
def _crt_log_bridged() -> None:
    """The CRT's log bridge is on before the test runs: pytest's capture then sees what the CRT's loggers pass on
    (it attaches to the loggers that do not propagate as each phase begins), as a host program's handler would."""
    s3_native._bridge_crt_log()


def _port(endpoint: str) -> int:
    return int(endpoint.rstrip("/").rsplit(":", 1)[1])


def _proxied(scheme: str, kind: type[StallingProxy], request: pytest.FixtureRequest,
             monkeypatch: pytest.MonkeyPatch) -> tuple[str, StallingProxy, Callable[[], None]]:
    """(a new bucket's URL, the proxy every new client of the store goes through, what drops the clients)."""
    from infra.storage import gcs

    if scheme == "s3":
        url, server = request.getfixturevalue("s3_url"), request.getfixturevalue("s3_server")
        proxy, variable, clients = kind(_port(server.endpoint)), "AWS_ENDPOINT_URL", s3._connections.clear
        value = f"http://127.0.0.1:{proxy.port}"
    elif scheme == "az":
        url, server = request.getfixturevalue("az_url"), request.getfixturevalue("azurite_server")
        host, account = server.endpoint.rsplit("/", 1)
        proxy, variable, clients = kind(_port(host)), "AZURE_STORAGE_CONNECTION_STRING", azure_account._clients.clear
        value = AzuriteServer(f"http://127.0.0.1:{proxy.port}/{account}").connection_string
    else:
        url, server = request.getfixturevalue("gs_url"), request.getfixturevalue("gcs_server")
        proxy, variable, clients = kind(_port(server.host)), "STORAGE_EMULATOR_HOST", gcs._clients.clear
        value = f"http://127.0.0.1:{proxy.port}"
    monkeypatch.setenv(variable, value)
    clients()  # fresh clients: their first connections go through the proxy
    request.addfinalizer(clients)
    request.addfinalizer(proxy.close)
    return url, proxy, clients


STALL_SLACK_BOUNDS = 5  # a third of the CRT's own ~30 s at the tests' 2 s bound


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
    # The CRT's line for the cancel we asked for is no error (issue 23): it stays at debug.
    cancels = [r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG and "successfully cancelled" in
               r.getMessage()]
    assert not cancels, cancels
    # Found within the bound (plus the pool's tick and a loaded machine's slack), not the CRT's ~30 s: 7.0 s was seen
    # for a 2 s bound with two test files running at once on 2 cores (make test's pytest-xdist), so 5 bounds.
    assert detected < config.stall_timeout_s * STALL_SLACK_BOUNDS, detected
    return detected


@pytest.mark.parametrize("direction", ["download", "upload"])
@pytest.mark.parametrize(("scheme", "engine"), [("s3", "native"), ("s3", "python"), ("gs", "native"),
                                                ("gs", "python"), ("az", "python")])  # az: the python engine only
def test_stalled_request_is_retried_within_the_bound(
    scheme: str, engine: str, direction: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, proxy, clients = _proxied(scheme, StallingProxy, request, monkeypatch)
    _copy_through(url, proxy, tmp_path, CONFIG.but(engine=engine), caplog, direction, clients)


SLOW_BYTES_PER_S = 1_000_000  # each connection's pace through the throttling proxy, both ways: a shaped link
SLOW_STALL_S = 1.0  # far less than a part's time to land at that pace (5 MiB: ~5 s)


class ThrottlingProxy(StallingProxy):
    """A TCP proxy that forwards every connection steadily at bytes_per_s (None: at full speed): slow, never
    stalled."""

    bytes_per_s: float | None = SLOW_BYTES_PER_S

    def _pump(self, src: socket.socket, dst: socket.socket, carried: list[int], *both: socket.socket) -> None:
        try:
            while chunk := src.recv(16 << 10):
                dst.sendall(chunk)
                if self.bytes_per_s is not None:
                    time.sleep(len(chunk) / self.bytes_per_s)
        except OSError:
            pass
        for sock in both:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


# The python engine's sent bytes are still taken for a stall on a slow link: a boto3 request's read timeout runs
# while the body still drains from the socket's buffers. (A native PUT's are seen as the far end acknowledges them:
# infra.storage.crt_traffic.)
_SENT_IS_NOT_SEEN = pytest.mark.xfail(strict=True, reason="boto3's read timeout runs while a slow body drains")


@pytest.mark.parametrize(("scheme", "engine", "direction"), [
    # Not GCS: its emulator serves one request at a time, so a second part waits out the first, slow one for its
    # headers (a read timeout that real GCS, which serves parts in parallel, does not give).
    ("s3", "native", "download"), ("s3", "python", "download"),
    ("s3", "native", "upload"),
    pytest.param("s3", "python", "upload", marks=_SENT_IS_NOT_SEEN),
])
def test_a_slow_but_moving_request_is_not_retried(scheme: str, engine: str, direction: str, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes keep arriving, but a whole part takes several stall bounds to land: not a stall, so no retry."""
    size = MIN_PART_SIZE + (1 << 20)
    data = os.urandom(size)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big.bin").write_bytes(data)
    crc = str(checksum_bytes(data))
    config = CONFIG.but(engine=engine, stall_timeout_s=SLOW_STALL_S)
    url, proxy, _clients = _proxied(scheme, ThrottlingProxy, request, monkeypatch)
    assert isinstance(proxy, ThrottlingProxy)
    if direction == "download":
        proxy.bytes_per_s = None  # the object is put in place at full speed
        upload(tmp_path / "src", ["big.bin"], open_store(url), config)
        proxy.bytes_per_s = SLOW_BYTES_PER_S
    with caplog.at_level(logging.WARNING):
        started = time.monotonic()
        if direction == "download":
            download(open_store(url), [FileSpec("big.bin", size, crc=crc)], tmp_path / "dest", config)
            assert (tmp_path / "dest" / "big.bin").read_bytes() == data
        else:
            sent = upload(tmp_path / "src", ["big.bin"], open_store(url), config)
            kept = Checksum.parse(sent.files[0].crc or "")
            assert kept == checksum_bytes(data, kept.algorithm)
        took = time.monotonic() - started
    retries = [r.getMessage() for r in caplog.records if re.search(r"stall|retr", r.getMessage())]
    logging.getLogger(__name__).warning("%s %s through %.1f MB/s per connection: %.1fs, %d retries (bound %.1fs)",
                                        engine, direction, SLOW_BYTES_PER_S / 1e6, took, len(retries), SLOW_STALL_S)
    assert not retries, retries
    assert took > SLOW_STALL_S * 2, f"{took:.1f}s: the proxy did not slow the copy down enough to test anything"


def test_a_control_request_queued_behind_moving_parts_is_not_stalled(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A HEAD waits in the CRT's queue while every connection carries a slow, moving GET: no byte of its own for
    longer than the bound, yet no stall (an upload's HEAD after each PUT was retried so on a busy link)."""
    config = CONFIG.but(stall_timeout_s=SLOW_STALL_S, connections_per_cpu=1, part_size=MIN_PART_SIZE)
    url, proxy, _clients = _proxied("s3", ThrottlingProxy, request, monkeypatch)
    assert isinstance(proxy, ThrottlingProxy)
    store = open_store(url)
    names = [f"f{i}.bin" for i in range(2 * len(os.sched_getaffinity(0)))]  # twice the CRT's connections
    (tmp_path / "src").mkdir()
    for name in names:
        (tmp_path / "src" / name).write_bytes(os.urandom(MIN_PART_SIZE))
    proxy.bytes_per_s = None  # the objects are put in place at full speed
    upload(tmp_path / "src", names, store, config)
    proxy.bytes_per_s = SLOW_BYTES_PER_S  # each GET then holds its connection ~5 s
    dest = tmp_path / "dest"
    fetching = threading.Thread(target=download, args=(store, [FileSpec(n, MIN_PART_SIZE) for n in names], dest,
                                                       config), daemon=True)
    fetching.start()
    # The CRT creates each file as its GET goes out.
    wait_for(lambda: any(dest.glob("*.part")), 60, "the downloads starting", interval=0.05)
    client, endpoint = s3.S3Store(url)._native(config)
    started = time.monotonic()
    info = s3_control.head_object(client, endpoint, url.removeprefix("s3://"), names[-1], SLOW_STALL_S, "HEAD")
    waited = time.monotonic() - started
    fetching.join(timeout=120)
    assert info.size == MIN_PART_SIZE
    assert waited > SLOW_STALL_S, f"{waited:.1f}s: the HEAD was not queued behind the GETs: nothing was tested"


def test_acknowledged_bytes_are_counted_and_no_descriptor_is_left_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tcp_bytes_acked sums what the far ends acknowledged, through duplicates of the process's descriptors. A
    descriptor listed as a socket may be a file by the time it is duplicated (its number reused): that duplicate is
    closed too (socket() keeps a descriptor it refuses, and the sampler runs every 50 ms for a whole transfer)."""
    from infra.storage import crt_traffic

    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as sender, listener.accept()[0] as receiver:
        before = crt_traffic.tcp_bytes_acked()
        sender.sendall(b"x" * 100_000)
        got = 0
        while got < 100_000:
            got += len(receiver.recv(65536))
        deadline = time.monotonic() + 10
        while crt_traffic.tcp_bytes_acked() - before < 100_000:
            assert time.monotonic() < deadline, "the receiver's acknowledgements were never counted"
            time.sleep(0.01)
    (tmp_path / "file").write_bytes(b"not a socket")
    with open(tmp_path / "file", "rb"):
        fds = len(os.listdir("/proc/self/fd"))
        monkeypatch.setattr(crt_traffic.os, "readlink", lambda path: "socket:[1]")  # every descriptor "a socket"
        for _ in range(5):
            crt_traffic.tcp_bytes_acked()
        monkeypatch.undo()
        assert len(os.listdir("/proc/self/fd")) == fds
