"""GcsStore and the transfer engine against the GCS emulator (gcp-storage-emulator via STORAGE_EMULATOR_HOST)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.api_core import exceptions as api_exceptions
from google.resumable_media.common import DataCorruption
from store_checks import FAST_RETRY, check_engine_round_trip, check_object_contract

from infra.errors import is_transient
from infra.storage import ChecksumMismatch, StorageError, open_store
from infra.storage.gcs import UPLOAD_CHUNK_SIZE, GcsStore, translate
from infra.storage.transfer import NativeTransfers, TransferConfig

PART = 1 << 20
CONFIG = TransferConfig(workers=4, part_size=PART, multipart_threshold=PART, retry=FAST_RETRY)


def test_object_contract(gs_url: str) -> None:
    store = open_store(f"{gs_url}/root/prefix")
    assert isinstance(store, GcsStore) and isinstance(store, NativeTransfers)
    check_object_contract(store)


@pytest.mark.parametrize("engine", ["native", "python"])
def test_engine_round_trip(gs_url: str, tmp_path: Path, engine: str) -> None:
    store = open_store(f"{gs_url}/data")
    assert isinstance(store, GcsStore)

    def add_prefix_marker(name: str) -> None:
        store.bucket.blob(store.keys.name(name)).upload_from_string(b"")

    check_engine_round_trip(store, tmp_path, CONFIG.but(engine=engine), add_prefix_marker)


def test_large_file_goes_up_in_resumable_chunks(gs_url: str, tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    data = bytes(range(256)) * ((UPLOAD_CHUNK_SIZE + 12345) // 256)
    path.write_bytes(data)
    store = open_store(gs_url)
    info = store.put_file(path, "big.bin")
    assert info.size == len(data) and store.get_bytes("big.bin") == data
    store.get_file("big.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == data


def test_missing_bucket_is_one_clear_line(gs_url: str) -> None:
    store = open_store("gs://no-such-bucket-here/data")
    with pytest.raises(StorageError, match=r"^gs://no-such-bucket-here/data: bucket 'no-such-bucket-here' does not"):
        list(store.list())
    with pytest.raises(StorageError, match=r"bucket 'no-such-bucket-here' does not exist: create it or fix the URL$"):
        store.put_bytes("x", b"1")


def test_failures_are_classified() -> None:
    assert is_transient(translate(api_exceptions.ServiceUnavailable("busy"), "gs://b/k", "read"))
    assert is_transient(translate(api_exceptions.TooManyRequests("slow down"), "gs://b/k", "read"))
    denied = translate(api_exceptions.Forbidden("no"), "gs://b/k", "read")
    assert not is_transient(denied) and "check the credentials" in str(denied)
    corrupt = translate(DataCorruption(None, "crc32c mismatch"), "gs://b/k", "read")
    assert isinstance(corrupt, ChecksumMismatch) and str(corrupt).startswith("gs://b/k: checksum mismatch")
