"""AzureBlobStore and the transfer engine against Azurite (the real Azure Storage emulator)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from azure.core.exceptions import HttpResponseError, ServiceResponseError
from store_checks import FAST_RETRY, check_engine_round_trip, check_object_contract

from infra.errors import is_transient
from infra.storage import ChecksumMismatch, StorageError, open_store
from infra.storage.azure import CHECKSUM_METADATA, AzureBlobStore, translate
from infra.storage.checksum import checksum_bytes
from infra.storage.parts import MultipartUploads
from infra.storage.stall import StalledRequest
from infra.storage.transfer import TransferConfig, upload

PART = 1 << 20
CONFIG = TransferConfig(workers=4, part_size=PART, retry=FAST_RETRY, engine="python")


def test_object_contract(az_url: str) -> None:
    store = open_store(f"{az_url}/root/prefix")
    assert isinstance(store, AzureBlobStore) and isinstance(store, MultipartUploads)
    check_object_contract(store)


def test_engine_round_trip(az_url: str, tmp_path: Path) -> None:
    store = open_store(f"{az_url}/data")
    assert isinstance(store, AzureBlobStore)

    def add_prefix_marker(name: str) -> None:
        store.container.upload_blob(store.keys.name(name), b"")

    check_engine_round_trip(store, tmp_path, CONFIG, add_prefix_marker)


def test_blocks_commit_whole_with_the_crc_that_reads_check(az_url: str, tmp_path: Path) -> None:
    """A file of several blocks is one object carrying its CRC64NVME (in HEAD and the listing, as S3's); a whole
    read of an object whose bytes differ from its recorded CRC fails naming it."""
    store = open_store(az_url)
    assert isinstance(store, AzureBlobStore)
    data = os.urandom(3 * PART + 17)
    (tmp_path / "big.bin").write_bytes(data)
    sent = upload(tmp_path, ["big.bin"], store, CONFIG)
    crc = str(checksum_bytes(data))
    assert sent.files[0].crc == crc
    blocks = store._blob("big.bin").get_block_list()[0]
    assert [block.size for block in blocks] == [PART, PART, PART, 17]
    head = store.head("big.bin")
    assert head is not None and head.size == len(data) and head.checksum == crc
    assert [info.checksum for info in store.list()] == [crc]
    assert store.put_bytes("small", b"abc").size == 3 and store.head("small").checksum == str(  # type: ignore[union-attr]
        checksum_bytes(b"abc"))

    # The bytes replaced behind the store's back, the recorded CRC left as it was.
    store._blob("small").upload_blob(b"abd", overwrite=True, metadata={CHECKSUM_METADATA: checksum_bytes(b"abc").value})
    with pytest.raises(ChecksumMismatch, match="small"):
        store.get_bytes("small")
    with pytest.raises(ChecksumMismatch, match="small"):
        store.get_file("small", tmp_path / "small")


def test_put_if_absent_creates_once(az_url: str) -> None:
    store = open_store(az_url)
    assert isinstance(store, AzureBlobStore)
    assert store.put_if_absent("alias/production", b"first") is True
    assert store.put_if_absent("alias/production", b"second") is False
    assert store.get_bytes("alias/production") == b"first"


def test_missing_container_and_account_are_one_clear_line(az_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(StorageError, match="container 'no-such-container' does not exist: create it"):
        open_store("az://no-such-container/x").get_bytes("key")
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(StorageError, match="no Azure storage account: set AZURE_STORAGE_CONNECTION_STRING"):
        open_store(f"{az_url}/x").head("key")


def test_failures_are_transient_only_where_a_retry_can_help() -> None:
    class Reply:
        def __init__(self, status: int) -> None:
            self.status_code, self.reason, self.headers = status, "", {}

        def text(self) -> str:
            return ""

    def answer(status: int) -> HttpResponseError:
        return HttpResponseError(message=f"status {status}", response=Reply(status))  # type: ignore[arg-type]

    url = "az://c/k"
    assert is_transient(translate(answer(503), url, "c", "read"))
    assert is_transient(translate(answer(429), url, "c", "read"))
    assert not is_transient(translate(answer(400), url, "c", "read"))
    assert "access denied" in str(translate(answer(403), url, "c", "read"))
    assert isinstance(translate(ServiceResponseError("Read timed out"), url, "c", "read"), StalledRequest)
    assert is_transient(translate(ServiceResponseError("Connection reset by peer"), url, "c", "read"))


def test_blocks_that_do_not_tile_the_object_are_not_committed(az_url: str) -> None:
    store = open_store(az_url)
    assert isinstance(store, AzureBlobStore)
    upload_id = store.start_multipart("gap")
    tags = [store.put_part("gap", upload_id, 1, 0, b"a" * 10), store.put_part("gap", upload_id, 2, 12, b"b" * 10)]
    with pytest.raises(StorageError, match="do not tile the object"):
        store.finish_multipart("gap", upload_id, tags)
    assert store.head("gap") is None
