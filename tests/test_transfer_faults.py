"""Faults on real connections and disks: cut responses, corrupt objects, a destination without space."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from azurite import AzuriteServer
from servers import BreakingProxy, S3Server
from store_checks import FAST_RETRY
from typer.testing import CliRunner

from infra.storage import ChecksumMismatch, azure_account, open_store, s3
from infra.storage.checksum import checksum_bytes
from infra.storage.s3 import MIN_PART_SIZE
from infra.storage.transfer import FileSpec, RetryPolicy, TransferConfig, download, upload
from trainpipe.cli import app

CUTS_PER_PHASE = 3  # connections cut in each direction's phase ...
CUT_AFTER_BYTES = (600 << 10) + 12345  # ... once one has carried this much: inside its first part (1 or 5 MiB)
RETRY = RetryPolicy(attempts=8, base_s=0.01, max_s=0.05)
CONFIG = TransferConfig(workers=4, part_size=MIN_PART_SIZE, multipart_threshold=MIN_PART_SIZE, retry=RETRY)


class CuttingProxy(BreakingProxy):
    """A TCP proxy to the S3 server that resets the next `arm(n)` connections that carry CUT_AFTER_BYTES.

    A budget rather than every Nth connection: which connections carry a body depends on how the client pools
    them, and a doomed connection that only ever carries small requests would cut nothing.

    Connections are kept alive across requests, so the cut lands inside a response body (downloads) or a
    request body (uploads), wherever it happens to be, the way a flaky network breaks them.
    """

    break_after = CUT_AFTER_BYTES

    def __init__(self, upstream_port: int) -> None:
        self.connections = 0
        self.cuts = 0
        self._cuts_left = 0
        super().__init__(upstream_port)

    def connected(self, client: socket.socket, upstream: socket.socket) -> None:
        with self._lock:
            self.connections += 1
        super().connected(client, upstream)

    def arm(self, cuts: int) -> None:
        with self._lock:
            self._cuts_left = cuts

    def breaks(self, client: socket.socket) -> bool:
        if self._cuts_left <= 0:
            return False
        self._cuts_left -= 1
        self.cuts += 1
        return True

    def break_off(self, client: socket.socket, upstream: socket.socket) -> None:
        for sock in (client, upstream):
            # shutdown wakes the other direction's thread blocked in recv (close alone would not, and the socket
            # would stay open until the client's read timeout).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@pytest.fixture
def cut_url(s3_url: str, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, CuttingProxy]]:
    proxy = CuttingProxy(int(s3_server.endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    yield s3_url, proxy
    proxy.close()


@pytest.fixture
def az_cut_url(az_url: str, azurite_server: AzuriteServer, monkeypatch: pytest.MonkeyPatch
               ) -> Iterator[tuple[str, CuttingProxy]]:
    host, account = azurite_server.endpoint.rsplit("/", 1)
    proxy = CuttingProxy(int(host.rsplit(":", 1)[1]))
    through = AzuriteServer(f"http://127.0.0.1:{proxy.port}/{account}")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", through.connection_string)
    azure_account._clients.clear()
    yield az_url, proxy
    azure_account._clients.clear()
    proxy.close()


@pytest.mark.parametrize("engine", ["native", "python"])
def test_cut_connections_still_yield_verified_copies(
    cut_url: tuple[str, CuttingProxy], tmp_path: Path, engine: str, caplog: pytest.LogCaptureFixture
) -> None:
    url, proxy = cut_url
    _copy_while_cutting(url, proxy, tmp_path, CONFIG.but(engine=engine), caplog, s3._connections.clear)


def test_cut_connections_to_azure_still_yield_verified_copies(
    az_cut_url: tuple[str, CuttingProxy], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, proxy = az_cut_url
    _copy_while_cutting(url, proxy, tmp_path, CONFIG.but(engine="python"), caplog, azure_account._clients.clear)


def _copy_while_cutting(url: str, proxy: CuttingProxy, tmp_path: Path, config: TransferConfig,
                        caplog: pytest.LogCaptureFixture, drop_clients: Callable[[], None]) -> None:
    store = open_store(url)
    sizes = {"big.bin": 4 * MIN_PART_SIZE + 777, "mid.bin": MIN_PART_SIZE + 1, **{f"s/{i}": 300_000 for i in range(8)}}
    src = tmp_path / "src"
    crcs = {}
    for rel, size in sizes.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        data = os.urandom(size)
        (src / rel).write_bytes(data)
        crcs[rel] = str(checksum_bytes(data))
    proxy.arm(CUTS_PER_PHASE)
    with caplog.at_level(logging.WARNING):
        sent = upload(src, sorted(sizes), store, config)
        assert {f.key: f.crc for f in sent.files} == crcs
        cuts_up = proxy.cuts
        # Fresh clients, so the download opens fresh connections: the next ones that carry a body are cut.
        drop_clients()
        store = open_store(url)
        specs = [FileSpec(rel, size, crc=crcs[rel]) for rel, size in sizes.items()]
        proxy.arm(CUTS_PER_PHASE)
        download(store, specs, tmp_path / "dest", config.but(part_size=1 << 20))
    for rel in sizes:
        assert (tmp_path / "dest" / rel).read_bytes() == (src / rel).read_bytes()
    assert cuts_up >= 2 and proxy.cuts - cuts_up >= 2  # both directions were really cut, several times
    # Every retry is logged: by the engine (python) or, for the part requests the CRT retries, by its log bridge.
    retries = [r.getMessage() for r in caplog.records if r.name in ("infra.storage.retry", "infra.storage.s3_native")
               and r.levelno == logging.WARNING and "retr" in r.getMessage()]
    assert len(retries) >= proxy.cuts, retries


@pytest.mark.parametrize("engine", ["native", "python"])
def test_corrupt_object_raises_naming_it_and_leaves_nothing_valid(
    s3_url: str, s3_server: S3Server, tmp_path: Path, engine: str
) -> None:
    store = open_store(s3_url)
    good = os.urandom(4 << 20)
    (tmp_path / "good.bin").write_bytes(good)
    # One part: the native path sends its CRC in a header, which rclone keeps (and returns on GET and HEAD).
    sent = upload(tmp_path, ["good.bin"], store.child("data"), CONFIG)
    spec = FileSpec("data/good.bin", len(good), crc=sent.files[0].crc)
    # The bytes on the server rot (same size, one byte flipped): only the checksum can tell.
    on_disk = s3_server.root / s3_url.removeprefix("s3://") / "data/good.bin"
    with open(on_disk, "r+b") as file:
        file.seek(len(good) // 2)
        file.write(bytes([good[len(good) // 2] ^ 0xFF]))
    config = CONFIG.but(engine=engine, part_size=1 << 20, retry=FAST_RETRY)
    not_matching = rf"^{s3_url}/data/good.bin: .*crc64nvme .*does not match the expected {spec.crc[10:]}: .*corrupt"
    for dest in (tmp_path / "dest", tmp_path / "dest"):  # a rerun must not trust anything the failed run left
        with pytest.raises(ChecksumMismatch, match=not_matching.replace("+", r"\+")):
            download(store, [spec], dest, config)
        assert [p.name for p in dest.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("engine", ["native", "python"])
def test_bytes_that_differ_from_the_stores_own_checksum_are_refused(s3_url: str, tmp_path: Path, engine: str) -> None:
    """Without a manifest (as `cp` runs) the object is held to the CRC64NVME the store keeps for it."""
    store = open_store(s3_url)
    assert isinstance(store, s3.S3Store)
    good = os.urandom(3 << 20)
    claimed = checksum_bytes(good + b"!")  # what a faulty writer (or rotted metadata) says the bytes are
    store.client.put_object(Bucket=store.bucket, Key="shard.bin", Body=good, ChecksumCRC64NVME=claimed.b64)
    assert store.head("shard.bin").checksum == str(claimed)  # type: ignore[union-attr]
    with pytest.raises(ChecksumMismatch, match=rf"^{s3_url}/shard.bin: .*does not match the expected"):
        download(store, [FileSpec("shard.bin")], tmp_path / "dest", CONFIG.but(engine=engine, retry=FAST_RETRY))
    assert [p.name for p in (tmp_path / "dest").rglob("*") if p.is_file()] == []


def test_destination_without_space_is_one_clear_line(tmp_path: Path) -> None:
    # A sparse object larger than the free space: real sizes from a real store, no bytes written to make it.
    src = tmp_path / "store"
    src.mkdir()
    huge = shutil.disk_usage(tmp_path).free + (1 << 30)
    with open(src / "huge.bin", "wb") as file:
        file.truncate(huge)
    result = CliRunner().invoke(app, ["cp", "--recursive", str(src), str(tmp_path / "dest")])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
    assert f"{tmp_path / 'dest'}: 1 files need" in result.stderr and "free space or choose another" in result.stderr
    assert not (tmp_path / "dest" / "huge.bin").exists()
