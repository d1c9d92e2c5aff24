"""The s3:// object store: any S3-compatible server (AWS_ENDPOINT_URL). Whole files move through awscrt's S3
client (s3_native.py, the transfer engine's native path), and so do listing, HEAD, a small object's read and the
multipart upload's create, complete and abort (s3_control.py); small objects' writes, deletes and the python
engine's ranged GETs and parts go through boto3.

botocore is imported only when its client is first needed: `trainpipe cp` of a tree lists, fetches and sends
without it (its import and client were ~0.3 s of the copy's start). The endpoint, region and credentials are read
as botocore reads them: credentials from the environment when AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are set
(first in botocore's chain too), else from botocore's standard chain (profiles, SSO, roles); the region from
AWS_DEFAULT_REGION or AWS_REGION, else the profile's in the config file.

botocore's own retries are off: the transfer engine retries each request (each part on its own) with logged
backoff, so every failure here is either marked transient (throttling, 5xx, dropped connections) or is a
one-line StorageError naming the object and the fix.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from awscrt.exceptions import AwsCrtError

from infra.storage import s3_control, s3_native
from infra.storage.base import ChecksumMismatch, ObjectInfo, ObjectNotFound, ObjectStore, StorageError
from infra.storage.checksum import CRC64NVME, Checksum
from infra.storage.cloud import BucketKeys, TransientStorageError, nothing_to_read, split_bucket_url, translating
from infra.storage.files import os_errors_named, write_all, write_atomically
from infra.storage.records import DEFAULT_CONFIG, FileJob, TransferConfig
from infra.storage.stall import StalledRequest

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Enough for the engine's widest pool (connections are opened only when used, so a large pool costs nothing).
MAX_POOL_CONNECTIONS = 128
MIN_PART_SIZE = s3_native.MIN_PART_SIZE
MAX_PUT_SIZE = 5 << 30  # S3's largest single PUT
_READ_CHUNK = 8 << 20
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0  # control calls; a transfer's requests get its stall bound (S3Store.with_stall_timeout)

_THROTTLED = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
    "RequestTimeout", "InternalError", "ServiceUnavailable", "RequestTimeTooSkewed",
}
_DENIED = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "403",
    "AllAccessDisabled", "AccountProblem",
}

# Which endpoint, region and credentials the standard chain finds: a change of any of these is another connection.
_ENVIRONMENT = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE",
                "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE",
                "AWS_SHARED_CREDENTIALS_FILE")
# Endpoints whose reply to CreateMultipartUpload the CRT cannot read (rclone): large files go part by part there.
_crt_multipart_refused: set[str | None] = set()


@dataclass(frozen=True)
class _StaticCredentials:
    """Credentials from the environment, in the shape botocore's have (what s3_native's provider reads)."""

    access_key: str
    secret_key: str
    token: str | None

    def get_frozen_credentials(self) -> _StaticCredentials:
        return self


@dataclass
class _Connection:
    """One endpoint, region and set of credentials, with the clients made for it (each made once, when first
    needed: a botocore session alone costs tens of milliseconds, its import and S3 client ~0.3 s)."""

    endpoint: str | None
    region: str
    env_credentials: _StaticCredentials | None
    boto: dict[float, Any] = field(default_factory=dict)  # by the read timeout (the stall bound) it was made with
    crt: dict[tuple[Any, ...], Any] = field(default_factory=dict)  # by the tuning the CRT client was made with
    presigner: Any = None  # the client that signs URLs (_presigner)
    _session: Any = None

    def session(self) -> Any:
        """botocore's session (what boto3 wraps), made on first use: the same credential chain and config,
        without importing s3transfer, which boto3 does on import and which no path here uses."""
        if self._session is None:
            import botocore.session

            self._session = botocore.session.Session()
        return self._session

    def credentials(self) -> Any:
        """The credentials the standard chain finds (None when there are none): the environment's, else botocore's
        chain (refreshed by botocore when they expire)."""
        return self.env_credentials or self.session().get_credentials()


_connections: dict[tuple[str | None, ...], _Connection] = {}
_connections_lock = threading.Lock()


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _region() -> str:
    """botocore's region (AWS_DEFAULT_REGION, else the profile's in the config file), or AWS_REGION (the CRT's and
    the newer SDKs'); a custom endpoint (rclone, MinIO, ...) has none of its own, but v4 signatures need one."""
    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
    if region:
        return region
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    import configparser  # only here: ~10 ms of every start that has its region in the environment

    config = configparser.RawConfigParser()
    config.read(Path(os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config").expanduser())
    section = "default" if profile == "default" else f"profile {profile}"
    return config.get(section, "region", fallback="") or "us-east-1"


def _env_credentials() -> _StaticCredentials | None:
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    return _StaticCredentials(key, secret, os.environ.get("AWS_SESSION_TOKEN") or None) if key and secret else None


def _connection() -> _Connection:
    key = tuple(os.environ.get(name) for name in _ENVIRONMENT)
    with _connections_lock:
        connection = _connections.get(key)
        if connection is None:
            connection = _connections[key] = _Connection(_endpoint(), _region(), _env_credentials())
        return connection


def s3_client(read_timeout_s: float = READ_TIMEOUT_S) -> Any:
    """One thread-safe client per endpoint, region, credentials and read timeout, shared by every store in the
    process. The read timeout bounds how long a request may go without a byte: the transfer's stall bound."""
    connection = _connection()
    with _connections_lock:
        if read_timeout_s not in connection.boto:
            from botocore.config import Config

            config = Config(
                max_pool_connections=MAX_POOL_CONNECTIONS,
                retries={"total_max_attempts": 1, "mode": "standard"},
                connect_timeout=min(CONNECT_TIMEOUT_S, read_timeout_s),
                read_timeout=read_timeout_s,
                # Integrity is end to end (the engine's CRCs, computed from the bytes it moves); botocore's own
                # would checksum every byte a second time and not every S3-compatible server accepts them.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                s3={"addressing_style": "path"} if connection.endpoint else {},
            )
            connection.boto[read_timeout_s] = connection.session().create_client(
                "s3", endpoint_url=connection.endpoint, region_name=connection.region, config=config
            )
        return connection.boto[read_timeout_s]


def _presigner() -> Any:
    """The client that signs URLs: with Signature V4, which every region and S3-compatible server takes (botocore
    may presign with V2, which both refuse)."""
    connection = _connection()
    with _connections_lock:
        if connection.presigner is None:
            from botocore.config import Config

            connection.presigner = connection.session().create_client(
                "s3", endpoint_url=connection.endpoint, region_name=connection.region,
                config=Config(signature_version="s3v4", s3={"addressing_style": "path"} if connection.endpoint else {}))
        return connection.presigner


def _connection_errors() -> tuple[type[BaseException], ...]:
    """Failures of the connection itself, before or during a response: a retry on a fresh connection can succeed.
    (Imported with the client that raises them.)"""
    import botocore.exceptions
    import urllib3.exceptions

    return (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError,
            botocore.exceptions.IncompleteReadError, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)


def _boto_errors() -> tuple[type[BaseException], ...]:
    """What a boto call may raise that the store translates."""
    import botocore.exceptions

    return botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, *_connection_errors()


def _code(exc: Any) -> tuple[str, int]:
    """(code, HTTP status) of a botocore ClientError."""
    error = exc.response.get("Error", {})
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return str(error.get("Code") or status), status


def _from_code(code: str, status: int, message: str, url: str, bucket: str, action: str) -> StorageError:
    """The one-line StorageError for an S3 error response, whichever client received it."""
    if code == "NoSuchBucket":
        return StorageError(f"{url}: bucket '{bucket}' does not exist: create it or fix the URL")
    if code in _DENIED or status == 403:
        return StorageError(
            f"{url}: cannot {action}: access denied ({code}): check the credentials "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and the bucket's permissions"
        )
    if code in ("NoSuchKey", "404") or status == 404:
        return ObjectNotFound(f"{url}: no such object: check the key, or upload it first")
    # ConditionalRequestConflict (409): a concurrent conditional write of the key was in flight; S3 asks for a retry.
    if code in _THROTTLED or code == "ConditionalRequestConflict" or status == 429 or status >= 500:
        return TransientStorageError(f"{url}: cannot {action}: {code} (HTTP {status}): {message or code}")
    return StorageError(f"{url}: cannot {action}: {code}: {message or code}")


_NO_CREDENTIALS = "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or a role"


def translate(exc: Exception, url: str, bucket: str, action: str) -> StorageError:
    """The one-line StorageError for a boto failure; transient ones are marked so the engine retries them."""
    import botocore.exceptions

    if isinstance(exc, botocore.exceptions.ClientError):
        code, status = _code(exc)
        return _from_code(code, status, exc.response.get("Error", {}).get("Message") or "", url, bucket, action)
    if isinstance(exc, botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError):
        return StorageError(f"{url}: {_NO_CREDENTIALS}")
    if isinstance(exc, botocore.exceptions.ReadTimeoutError | botocore.exceptions.ConnectTimeoutError):
        return StalledRequest(f"{url}: cannot {action}: stalled: {type(exc).__name__}: {' '.join(str(exc).split())}")
    if isinstance(exc, _connection_errors()):
        return TransientStorageError(f"{url}: cannot {action}: {type(exc).__name__}: {' '.join(str(exc).split())}")
    return StorageError(f"{url}: cannot {action}: {type(exc).__name__}: {' '.join(str(exc).split())}")


class S3Store(ObjectStore):
    """Objects under s3://bucket/prefix; the client comes from the standard AWS credential chain."""

    scheme = "s3"
    min_part_size = MIN_PART_SIZE

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.bucket, prefix = split_bucket_url(self.url, "s3")
        self.keys = BucketKeys(self.url, prefix)
        self.read_timeout_s = READ_TIMEOUT_S
        self._client: Any = None

    @property
    def client(self) -> Any:
        """boto3's client, made on first use (listing, HEAD and whole files go through the CRT without it)."""
        if self._client is None:
            self._client = s3_client(self.read_timeout_s)
        return self._client

    @client.setter
    def client(self, client: Any) -> None:
        self._client = client

    def with_stall_timeout(self, seconds: float) -> S3Store:
        bounded = S3Store(self.url)
        bounded.read_timeout_s = seconds
        return bounded

    def _calling(self, key: str, action: str) -> AbstractContextManager[None]:
        return translating(_boto_errors(), lambda exc: translate(exc, self.url_for(key), self.bucket, action))

    def _info(self, key: str, size: int, etag: str | None, modified: Any = None, checksum: str | None = None
              ) -> ObjectInfo:
        return ObjectInfo(key, size, etag.strip('"') if etag else None, modified.timestamp() if modified else None,
                          checksum)

    # -- reads -------------------------------------------------------------------------------------

    def child(self, prefix: str) -> S3Store:
        return S3Store(self.url_for(prefix.strip("/")))

    def list(self, prefix: str = "", *, page_size: int = s3_control.PAGE_SIZE) -> Iterator[ObjectInfo]:
        client, endpoint = self._native(DEFAULT_CONFIG)
        try:
            listed = s3_control.list_objects(client, endpoint, self.bucket, self.keys.search_prefix(prefix),
                                           self.read_timeout_s, f"list {self.url_for(prefix)}", page_size)
        except AwsCrtError as exc:
            raise self._crt_error(exc, prefix, "list") from None
        found = [ObjectInfo(key, item.size, item.etag, item.modified) for item in listed
                 if (key := self.keys.key(item.name)) and not key.endswith("/")]  # "directories" are not objects
        # Servers over file systems (rclone) list in directory order; callers are promised key order.
        found.sort(key=lambda info: info.key)
        return iter(found)

    def head(self, key: str) -> ObjectInfo | None:
        client, endpoint = self._native(DEFAULT_CONFIG)
        try:
            item = s3_control.head_object(client, endpoint, self.bucket, self.keys.name(key), self.read_timeout_s,
                                        f"HEAD {self.url_for(key)}")
        except AwsCrtError as exc:
            error = self._crt_error(exc, key, "stat")
            if isinstance(error, ObjectNotFound):
                return None
            raise error from None
        return ObjectInfo(key, item.size, item.etag, item.modified, item.checksum)

    def presigned_get(self, key: str, expires_s: float) -> str | None:
        with self._calling(key, "sign a URL for"):
            return str(_presigner().generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": self.keys.name(key)}, ExpiresIn=int(expires_s)))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if nothing_to_read(self.url_for(key), start, length):
            return b""
        import botocore.exceptions  # loaded with the client the call below makes

        with self._calling(key, f"read bytes {start}-{start + length - 1}"):
            try:
                reply = self.client.get_object(
                    Bucket=self.bucket, Key=self.keys.name(key), Range=f"bytes={start}-{start + length - 1}"
                )
            except botocore.exceptions.ClientError as exc:
                if _code(exc)[0] == "InvalidRange":  # start at or past the end: no bytes there
                    return b""
                raise
            return _read_body(reply, self.url_for(key))

    def get_bytes(self, key: str) -> bytes:
        data, expected = self._control(key, "read", s3_control.get_object)
        if len(data) != expected:
            # A connection cut mid-body that the HTTP layer did not notice: fetch it again.
            raise TransientStorageError(f"{self.url_for(key)}: got {len(data)} of {expected} bytes: the connection was "
                                        "cut")
        return data

    def get_file(self, key: str, path: Path) -> ObjectInfo:
        with self._calling(key, "read"):
            reply = self.client.get_object(Bucket=self.bucket, Key=self.keys.name(key))
            body = reply["Body"]

            def fill(fd: int) -> None:
                for chunk in body.iter_chunks(_READ_CHUNK):
                    write_all(fd, chunk)

            with os_errors_named(str(path), "write"):
                written = write_atomically(Path(path), fill)
        if written.st_size != reply["ContentLength"]:
            raise TransientStorageError(
                f"{self.url_for(key)}: got {written.st_size} of {reply['ContentLength']} bytes: run again"
            )
        return self._info(key, written.st_size, reply.get("ETag"), reply.get("LastModified"))

    # -- writes ------------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        with self._calling(key, "write"):
            reply = self.client.put_object(Bucket=self.bucket, Key=self.keys.name(key), Body=data)
        return self._info(key, len(data), reply.get("ETag"))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        import botocore.exceptions  # loaded with the client the call below makes

        with self._calling(key, "create"):
            try:
                self.client.put_object(Bucket=self.bucket, Key=self.keys.name(key), Body=data, IfNoneMatch="*")
            except botocore.exceptions.ClientError as exc:
                code, status = _code(exc)
                if code == "PreconditionFailed":  # 412: the key exists
                    return False
                if code != "NotImplemented" and status != 501:
                    raise
                # A server without conditional writes (some S3-compatible ones): a plain put, as the interface says
                # for a store that has none; honours_create_only then finds it out.
                self.put_bytes(key, data)
        return True

    def put_file(self, path: Path, key: str) -> ObjectInfo:
        path = Path(path)
        with os_errors_named(str(path), "read"):
            size = path.stat().st_size
            if size > MAX_PUT_SIZE:
                raise StorageError(
                    f"{path}: {size} bytes is over S3's single-PUT limit: upload it with the transfer engine "
                    "(infra.storage.transfer.upload or `trainpipe cp`), which sends it in parts"
                )
            with open(path, "rb") as body, self._calling(key, "write"):
                reply = self.client.put_object(Bucket=self.bucket, Key=self.keys.name(key), Body=body)
        return self._info(key, size, reply.get("ETag"))

    def delete(self, key: str) -> None:
        with self._calling(key, "delete"):
            self.client.delete_object(Bucket=self.bucket, Key=self.keys.name(key))

    # -- multipart (infra.storage.transfer.MultipartUploads) ---------------------------------------

    def _control(self, key: str, action: str, call: Callable[..., _T], *args: Any) -> _T:
        """call(client, endpoint, bucket, name, *args, stall bound, what) through the CRT, its failure as the
        store's one line."""
        client, endpoint = self._native(DEFAULT_CONFIG)
        try:
            return call(client, endpoint, self.bucket, self.keys.name(key), *args, self.read_timeout_s,
                        f"{action} {self.url_for(key)}")
        except AwsCrtError as exc:
            raise self._crt_error(exc, key, action) from None
        except s3_control.ErrorReply as exc:
            raise _from_code(exc.code, exc.status, exc.message, self.url_for(key), self.bucket, action) from None

    def start_multipart(self, key: str, *, full_object_crc: bool = False) -> str:
        return self._control(key, "start a multipart upload", s3_control.create_multipart, full_object_crc)

    def put_part(self, key: str, upload_id: str, number: int, offset: int, data: bytes) -> str:
        with self._calling(key, f"upload part {number}"):
            reply = self.client.upload_part(
                Bucket=self.bucket, Key=self.keys.name(key), UploadId=upload_id, PartNumber=number, Body=data
            )
        return str(reply["ETag"])

    def finish_multipart(self, key: str, upload_id: str, tags: list[str], *, crc: Checksum | None = None
                         ) -> ObjectInfo:
        # The object's CRC64NVME, so the store checks the assembled object against the bytes that were sent.
        self._control(key, "complete a multipart upload", s3_control.complete_multipart, upload_id, tags,
                      crc.b64 if crc is not None else None)
        info = self.head(key)
        if info is None:
            raise TransientStorageError(f"{self.url_for(key)}: not visible after its multipart upload completed")
        return info

    def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            self._control(key, "abort a multipart upload", s3_control.abort_multipart, upload_id)
        except ObjectNotFound:
            return  # NoSuchUpload: already aborted or completed


    # -- whole files through awscrt (infra.storage.native.NativeTransfers) ------------------------------

    def _native(self, config: TransferConfig) -> tuple[Any, s3_native.Endpoint]:
        """The CRT client for this endpoint, credentials and tuning (one per process), and the endpoint."""
        connection = _connection()
        endpoint = s3_native.Endpoint(connection.endpoint, connection.region)
        tuning = (config.throughput_target_gbps, config.memory_limit, config.part_size, config.retry,
                  config.connections_per_cpu)
        with _connections_lock:
            client = connection.crt.get(tuning)
            if client is None:
                credentials = connection.credentials()
                if credentials is None:
                    raise StorageError(f"{self.url}: {_NO_CREDENTIALS}")
                client = connection.crt[tuning] = s3_native.new_client(endpoint, credentials, config)
        return client, endpoint

    def _crt_error(self, exc: AwsCrtError, key: str, action: str, expected: Checksum | None = None) -> StorageError:
        url = self.url_for(key)
        response = s3_native.error_code(exc)
        if response is not None:
            return _from_code(*response, url, self.bucket, action)
        error = s3_native.crt_failure(exc, url, action)
        if isinstance(error, ChecksumMismatch) and expected is not None:
            return ChecksumMismatch(
                f"{url}: the {expected.algorithm} of the bytes received does not match the expected {expected.value}: "
                "the object or its manifest is corrupt: re-upload the object or fix the manifest"
            )
        return error

    def files_in_flight(self, config: TransferConfig) -> int:
        return config.files_in_flight  # the CRT schedules their parts over its own connections, outside the GIL

    def start_fetch(self, key: str, path: Path, size: int, expected: Checksum | None, job: FileJob
                    ) -> s3_native.CrtGet:
        client, endpoint = self._native(job.config)
        request = s3_native.get_request(endpoint, self.bucket, self.keys.name(key))
        try:
            return s3_native.start_get(client, request, path, expected, job,
                                       lambda exc: self._crt_error(exc, key, "read", expected),
                                       f"GET {self.url_for(key)}")
        except AwsCrtError as exc:
            raise self._crt_error(exc, key, "read", expected) from None

    def send_file(self, path: Path, key: str, size: int, job: FileJob) -> Checksum:
        client, endpoint = self._native(job.config)
        name = self.keys.name(key)
        parts = partial(self._send_parts, client, endpoint, path, key, size, job)
        if size > max(job.config.multipart_threshold, MIN_PART_SIZE) and endpoint.url in _crt_multipart_refused:
            return parts()
        try:
            try:
                echoed = s3_native.send(client, s3_native.put_request(endpoint, self.bucket, name, size), path, job,
                                        f"PUT {self.url_for(key)}")
            except AwsCrtError as exc:
                if exc.name != "AWS_ERROR_S3_MISSING_UPLOAD_ID":
                    raise
                if endpoint.url not in _crt_multipart_refused:
                    _crt_multipart_refused.add(endpoint.url)
                    log.warning("%s answers CreateMultipartUpload in a form the CRT cannot read (rclone does): files "
                                "over %d MiB go up part by part", endpoint.url, job.config.multipart_threshold >> 20)
                return parts()
            kept = None
            if echoed is None:  # the store did not say what it checked: ask what it keeps
                info = s3_control.head_object(client, endpoint, self.bucket, name, job.config.stall_timeout_s,
                                              f"HEAD {self.url_for(key)}", job.cancel)
                if info.size != size:
                    raise StorageError(
                        f"{self.url_for(key)}: stored {info.size} bytes of {path}'s {size}: upload it again"
                    )
                kept = Checksum.parse(info.checksum) if info.checksum else None
                kept = kept if kept is not None and kept.algorithm == CRC64NVME else None  # the CRC sent
        except AwsCrtError as exc:
            raise self._crt_error(exc, key, "write") from None
        return s3_native.checksum_after_put(echoed, kept, path)

    def _send_parts(
        self, client: Any, endpoint: s3_native.Endpoint, path: Path, key: str, size: int, job: FileJob
    ) -> Checksum:
        upload_id = self.start_multipart(key, full_object_crc=True)
        try:
            try:
                etags, crc = s3_native.send_parts(client, endpoint, self.bucket, self.keys.name(key), path, size,
                                                  upload_id, job, f"PUT {self.url_for(key)}")
            except AwsCrtError as exc:
                raise self._crt_error(exc, key, "write") from None
            info = self.finish_multipart(key, upload_id, etags, crc=crc)
        except BaseException:
            try:
                self.abort_multipart(key, upload_id)
            except StorageError as exc:  # the upload's own error is the one to raise
                log.error("%s: could not abort multipart upload %s (%s): abort it with the store's tools",
                          self.url_for(key), upload_id, exc)
            raise
        if info.size != size:
            raise StorageError(f"{self.url_for(key)}: stored {info.size} bytes of {path}'s {size}: upload it again")
        return crc



def _read_body(reply: dict[str, Any], url: str) -> bytes:
    data: bytes = reply["Body"].read()
    expected = int(reply["ContentLength"])
    if len(data) != expected:
        # A connection cut mid-body that the HTTP layer did not notice: fetch it again.
        raise TransientStorageError(f"{url}: got {len(data)} of {expected} bytes: the connection was cut")
    return data
