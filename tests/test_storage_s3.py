"""S3Store and the transfer engine against a real S3 server (`rclone serve s3` over a temp dir)."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_checks import check_engine_round_trip, check_object_contract

from infra.errors import is_transient
from infra.storage import StorageError, open_store
from infra.storage.s3 import MIN_PART_SIZE, S3Store, translate
from infra.storage.transfer import MultipartUploads, download


def test_object_contract(s3_url: str) -> None:
    store = open_store(f"{s3_url}/root/prefix")
    assert isinstance(store, S3Store) and isinstance(store, MultipartUploads)
    check_object_contract(store)


def test_engine_round_trip_in_parts(s3_url: str, tmp_path: Path) -> None:
    check_engine_round_trip(open_store(s3_url), tmp_path, MIN_PART_SIZE)


def test_missing_bucket_is_one_clear_line(s3_url: str, tmp_path: Path) -> None:
    store = open_store("s3://no-such-bucket-here/data")
    with pytest.raises(StorageError, match=r"^s3://no-such-bucket-here/data: bucket 'no-such-bucket-here' does not"):
        list(store.list())
    with pytest.raises(StorageError, match=r"bucket 'no-such-bucket-here' does not exist: create it or fix the URL$"):
        store.put_bytes("x", b"1")


def test_wrong_credentials_are_one_clear_line(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    open_store(s3_url).put_bytes("x", b"1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not/the/right/secret/key/0123456789abcdef")
    store = open_store(s3_url)
    for call in (lambda: list(store.list()), lambda: store.get_bytes("x"), lambda: store.head("x")):
        with pytest.raises(StorageError, match=r"access denied .*: check the credentials") as caught:
            call()
        assert "\n" not in str(caught.value) and not is_transient(caught.value)


def test_unknown_scheme_and_bad_bucket() -> None:
    with pytest.raises(StorageError, match=r"unknown scheme 'ftp://' in 'ftp://x/y': use file://, s3:// or gs://"):
        open_store("ftp://x/y")
    with pytest.raises(StorageError, match="invalid bucket name 'Bad_Bucket!'"):
        open_store("s3://Bad_Bucket!/x")


def test_throttling_and_cut_connections_are_transient() -> None:
    from botocore.exceptions import ClientError, ResponseStreamingError

    def client_error(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                           "GetObject")

    assert is_transient(translate(client_error("SlowDown", 503), "s3://b/k", "b", "read"))
    assert is_transient(translate(client_error("InternalError", 500), "s3://b/k", "b", "read"))
    assert is_transient(translate(ResponseStreamingError(error="cut"), "s3://b/k", "b", "read"))
    assert not is_transient(translate(client_error("NoSuchBucket", 404), "s3://b/k", "b", "read"))
    assert not is_transient(translate(client_error("AccessDenied", 403), "s3://b/k", "b", "read"))


def test_download_of_missing_object_names_it(s3_url: str, tmp_path: Path) -> None:
    from infra.storage.transfer import FileSpec

    with pytest.raises(StorageError, match=f"{s3_url}/nope: no such object"):
        download(open_store(s3_url), [FileSpec("nope")], tmp_path / "dest")
