"""S3Store and the transfer engine against a real S3 server (`rclone serve s3` over a temp dir)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import S3Server, _serving, free_port
from store_checks import FAST_RETRY, check_engine_round_trip, check_object_contract, tree, write_tree

from infra.errors import is_transient
from infra.storage import StorageError, open_store, s3
from infra.storage.checksum import checksum_bytes, checksum_file
from infra.storage.s3 import MIN_PART_SIZE, S3Store, s3_client, translate
from infra.storage.transfer import FileSpec, MultipartUploads, NativeTransfers, TransferConfig, download, upload

# Parts of S3's smallest size, and uploads past one part go multipart: every path runs on a few MB.
CONFIG = TransferConfig(workers=4, part_size=MIN_PART_SIZE, multipart_threshold=MIN_PART_SIZE, retry=FAST_RETRY)


def test_object_contract(s3_url: str) -> None:
    store = open_store(f"{s3_url}/root/prefix")
    assert isinstance(store, S3Store) and isinstance(store, MultipartUploads) and isinstance(store, NativeTransfers)
    check_object_contract(store)


@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `moto_server` process: an S3 that answers CreateMultipartUpload as AWS does, so the CRT's own
    multipart upload (which rclone's reply defeats) runs here. Mocked S3, used for that path only."""
    port = free_port()
    moto = str(Path(sys.executable).with_name("moto_server"))
    with _serving([moto, "-H", "127.0.0.1", "-p", str(port)], port, tmp_path_factory.mktemp("moto") / "moto.log"):
        yield f"http://127.0.0.1:{port}"


# Keys S3 must encode in a listing: '+' (a space in a form encoding), spaces, unicode, '%', '&', '=', '~'.
ODD_KEYS = ["a+b.bin", "a b.bin", "dir with space/x+y z.bin", "ünï/çødé ✓.bin", "100%25 & =~.bin", "plain.bin"]


def _check_crt_listing(store: S3Store) -> None:
    for number, key in enumerate(ODD_KEYS):
        store.put_bytes(key, b"x" * (number + 1))
    # Pages of 2 keys: the continuation tokens carry the listing across pages as they do across S3's 1000s.
    listed = list(store.list(page_size=2))
    assert [info.key for info in listed] == sorted(ODD_KEYS)
    assert {info.key: info.size for info in listed} == {key: n + 1 for n, key in enumerate(ODD_KEYS)}
    assert all(info.mtime and info.mtime > 0 for info in listed)
    # A prefix with the same characters goes out encoded in the query and comes back decoded.
    assert [info.key for info in store.list("dir with space/x+")] == ["dir with space/x+y z.bin"]
    assert [info.key for info in store.child("ünï").list()] == ["çødé ✓.bin"]
    head = store.head("ünï/çødé ✓.bin")
    assert head is not None and head.size == ODD_KEYS.index("ünï/çødé ✓.bin") + 1
    assert store.head("a+b") is None


def test_crt_listing_of_odd_keys_over_pages(s3_url: str) -> None:
    """Listing and HEAD go through the CRT (no botocore): keys decode as botocore decodes them, over pages."""
    store = open_store(f"{s3_url}/odd")
    assert isinstance(store, S3Store)
    _check_crt_listing(store)


def test_crt_listing_against_moto(on_moto: str) -> None:
    """moto encodes a listing as AWS does (rclone's encoder is its own): the same keys come back the same."""
    s3_client().create_bucket(Bucket="odd-keys")
    store = open_store("s3://odd-keys/root")
    assert isinstance(store, S3Store)
    _check_crt_listing(store)
    # botocore's own listing of the bucket says the same.
    pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket="odd-keys", Prefix="root/")
    assert sorted(item["Key"].removeprefix("root/") for page in pages for item in page["Contents"]) == sorted(ODD_KEYS)
    # The multipart calls go through the CRT too: a completion the store refuses is its one line.
    upload_id = store.start_multipart("a+b.bin")
    with pytest.raises(StorageError, match=r"a\+b.bin: cannot complete a multipart upload: InvalidPart"):
        store.finish_multipart("a+b.bin", upload_id, ['"no-such-part"'])
    store.abort_multipart("a+b.bin", upload_id)


@pytest.fixture
def on_moto(moto_s3: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The environment pointing every S3 client at moto_server; its endpoint."""
    for name, value in {"AWS_ENDPOINT_URL": moto_s3, "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
                        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    return moto_s3


@pytest.mark.parametrize("engine", ["native", "python"])
def test_engine_round_trip(s3_url: str, tmp_path: Path, engine: str) -> None:
    # rclone over a directory cannot hold a 0-byte "prefix/" marker as S3 does (it becomes a file): moto's does.
    check_engine_round_trip(open_store(f"{s3_url}/data"), tmp_path, CONFIG.but(engine=engine))


def test_crt_multipart_upload_against_moto(on_moto: str, tmp_path: Path) -> None:
    s3_client().create_bucket(Bucket="crt-multipart")
    store = open_store("s3://crt-multipart/data")
    assert isinstance(store, S3Store)

    def add_prefix_marker(name: str) -> None:
        s3_client().put_object(Bucket=store.bucket, Key=store.keys.name(name), Body=b"")

    check_engine_round_trip(store, tmp_path, CONFIG, add_prefix_marker)
    assert on_moto not in s3._crt_multipart_refused  # the CRT's own multipart upload did the large files
    # The CRT sent each file's CRC64NVME (multipart: the full-object one) and the store kept it.
    head = store.head("big/many parts.bin")
    assert head is not None and head.checksum == str(checksum_file(tmp_path / "src/big/many parts.bin"))


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
    with pytest.raises(StorageError,
                       match=r"unknown scheme 'ftp://' in 'ftp://x/y': use file://, s3://, gs://, az:// or http://"):
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
    with pytest.raises(StorageError, match=f"{s3_url}/nope: no such object"):
        download(open_store(s3_url), [FileSpec("nope")], tmp_path / "dest")


def test_native_uploads_are_byte_exact_and_keep_their_crc(s3_url: str, s3_server: S3Server, tmp_path: Path) -> None:
    """Decides where the CRC goes: rclone keeps a CRC sent in a header (and returns it on GET and HEAD) but not one
    sent as an aws-chunked trailer, so the native engine sends it in a header; the bytes stored are the file's."""
    sizes = {"one part.bin": 3 << 20, "several parts.bin": 3 * MIN_PART_SIZE + 5}
    write_tree(tmp_path / "src", sizes)
    sent = upload(tmp_path / "src", sorted(sizes), open_store(f"{s3_url}/up"), CONFIG)
    on_disk = s3_server.root / s3_url.removeprefix("s3://") / "up"
    assert tree(on_disk) == tree(tmp_path / "src")
    crcs = {f.key: f.crc for f in sent.files}
    assert crcs == {key: str(checksum_file(tmp_path / "src" / key)) for key in sizes}
    head = open_store(f"{s3_url}/up").head("one part.bin")
    assert head is not None and head.checksum == crcs["one part.bin"]


def test_native_path_errors_are_one_clear_line(s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With size and CRC known (a manifest) nothing asks boto3 first: the CRT's own requests meet the errors.
    spec = FileSpec("k.bin", 10, crc=str(checksum_bytes(b"0123456789")))
    with pytest.raises(StorageError, match=r"^s3://no-such-bucket-here/k.bin: bucket 'no-such-bucket-here' does not "
                                           r"exist: create it or fix the URL$"):
        download(open_store("s3://no-such-bucket-here"), [spec], tmp_path / "a", CONFIG)
    open_store(s3_url).put_bytes("k.bin", b"0123456789")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not/the/right/secret/key/0123456789abcdef")
    (tmp_path / "up.bin").write_bytes(b"1")
    for call in (lambda: download(open_store(s3_url), [spec], tmp_path / "b", CONFIG),
                 lambda: upload(tmp_path, ["up.bin"], open_store(s3_url), CONFIG)):
        with pytest.raises(StorageError, match=r"denied \(SignatureDoesNotMatch\): check the credentials") as err:
            call()
        assert "\n" not in str(err.value) and not is_transient(err.value)
    assert list((tmp_path / "b").rglob("*.part")) == []


def test_http_dates_are_read_without_email_utils() -> None:
    """HEAD's Last-Modified in S3's own form is read by hand (email.utils is ~12 ms of `trainpipe cp`'s start); any
    other form still reads as email.utils reads it."""
    from email.utils import parsedate_to_datetime

    from infra.storage.s3_control import _http_time

    for text in ("Sun, 06 Nov 1994 08:49:37 GMT", "Sat, 29 Feb 2020 23:59:59 GMT", "Sunday, 06-Nov-94 08:49:37 GMT",
                 "Sun, 06 Nov 1994 08:49:37 +0100", "Mon, 1 Jan 2024 0:0:0 GMT"):
        assert _http_time(text) == parsedate_to_datetime(text).timestamp(), text


def test_crt_connections_are_capped_per_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CRT opens at most connections_per_cpu per CPU: each connection's part buffer is fresh memory to fault in."""
    from infra.storage import s3_native

    made: dict[str, object] = {}
    monkeypatch.setattr(s3_native.s3, "S3Client", lambda **kwargs: made.update(kwargs))
    endpoint = s3_native.Endpoint("http://127.0.0.1:9", "us-east-1")
    s3_native.new_client(endpoint, s3._StaticCredentials("k", "s", None), TransferConfig(connections_per_cpu=3))
    assert made["max_active_connections_override"] == 3 * len(os.sched_getaffinity(0))
