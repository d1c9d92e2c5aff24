"""The gs:// object store on google-cloud-storage: default credentials, STORAGE_EMULATOR_HOST, ranged reads,
chunked resumable uploads of large files, crc32c verification of whole-object reads and writes.

Whole files (the transfer engine's native path) go through transfer_manager: download_chunks_concurrently (ranged
chunks in parallel, their CRC32Cs joined and checked against the object's, no second read) and
upload_chunks_concurrently (XML multipart, each part's CRC32C checked by GCS). A server without XML multipart
uploads (the GCS emulator) gets large files as resumable uploads instead, said once in a warning.

The library's own retries are off (retry=None): the transfer engine retries each request (here: each whole
file) with logged backoff, so failures here are either marked transient or are one line naming the object and
the fix.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import google.auth.exceptions
import requests.adapters
import requests.exceptions
import urllib3.exceptions
from google.api_core import exceptions as api_exceptions
from google.cloud import storage
from google.cloud.storage import transfer_manager
from google.cloud.storage.exceptions import DataCorruption as MediaDataCorruption
from google.cloud.storage.exceptions import InvalidResponse as MediaInvalidResponse
from google.resumable_media.common import DataCorruption, InvalidResponse

from infra.storage.base import ChecksumMismatch, ObjectInfo, ObjectNotFound, ObjectStore, StorageError
from infra.storage.checksum import CRC32C, Checksum, check, checksum_file
from infra.storage.cloud import BucketKeys, TransientStorageError, nothing_to_read, split_bucket_url, translating
from infra.storage.files import os_errors_named
from infra.storage.pool import Threaded
from infra.storage.records import FileJob, TransferConfig
from infra.storage.retry import call_with_retries
from infra.storage.stall import StalledRequest

log = logging.getLogger(__name__)

# requests keeps 10 connections per host by default: more parallel workers than that would open and drop
# a connection per request. Connections are opened only when used, so a large pool costs nothing.
MAX_POOL_CONNECTIONS = 128
UPLOAD_CHUNK_SIZE = 32 << 20  # resumable uploads go in chunks of this size (a multiple of 256 KiB)
EMULATOR_PROJECT = "trainpipe-emulated"
DEFAULT_TIMEOUT_S = 60.0  # the library's own; a transfer's requests get its stall bound (with_stall_timeout)

_TRANSIENT = (
    api_exceptions.TooManyRequests,
    api_exceptions.InternalServerError,
    api_exceptions.BadGateway,
    api_exceptions.ServiceUnavailable,
    api_exceptions.GatewayTimeout,
    api_exceptions.RetryError,
    requests.exceptions.ConnectionError,
    requests.exceptions.ChunkedEncodingError,
    requests.exceptions.Timeout,
    google.auth.exceptions.TransportError,
    ConnectionError,
    TimeoutError,
)

# What the client library raises, translated into one-line StorageErrors.
_CLIENT_ERRORS = (
    api_exceptions.GoogleAPIError,
    google.auth.exceptions.GoogleAuthError,
    DataCorruption,
    InvalidResponse,
    MediaDataCorruption,
    MediaInvalidResponse,
    requests.exceptions.RequestException,
    urllib3.exceptions.HTTPError,  # a body streamed by transfer_manager's chunks fails as urllib3's own
    ConnectionError,
    TimeoutError,
)
_clients: dict[tuple[str | None, ...], storage.Client] = {}
_clients_lock = threading.Lock()
# Servers that answered an XML multipart upload with "not implemented" (the emulator): resumable uploads there.
_xml_multipart_refused: set[str | None] = set()


def gcs_client() -> storage.Client:
    """One client per emulator host and credentials file, shared by every store in the process."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST") or None
    cache_key = (emulator, os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"), os.environ.get("GOOGLE_CLOUD_PROJECT"))
    with _clients_lock:
        client = _clients.get(cache_key)
        if client is None:
            if emulator:
                # An emulator takes no credentials; the library then talks to STORAGE_EMULATOR_HOST.
                from google.auth.credentials import AnonymousCredentials

                project = os.environ.get("GOOGLE_CLOUD_PROJECT") or EMULATOR_PROJECT
                client = storage.Client(project=project, credentials=AnonymousCredentials())
            else:
                client = storage.Client()
            adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=MAX_POOL_CONNECTIONS)
            for scheme in ("http://", "https://"):
                client._http.mount(scheme, adapter)
            _clients[cache_key] = client
        return client


def translate(exc: Exception, url: str, action: str) -> StorageError:
    """The one-line StorageError for a google-cloud-storage failure; transient ones are marked for retries."""
    detail = " ".join(str(exc).split())
    if isinstance(exc, DataCorruption | MediaDataCorruption):
        return ChecksumMismatch(f"{url}: checksum mismatch while trying to {action} ({detail}): run again")
    if isinstance(exc, api_exceptions.NotFound):
        return ObjectNotFound(f"{url}: no such object: check the key, or upload it first")
    if isinstance(exc, api_exceptions.Forbidden | api_exceptions.Unauthorized):
        return StorageError(
            f"{url}: cannot {action}: access denied ({detail}): check the credentials "
            "(GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth application-default login`) and the bucket's permissions"
        )
    if isinstance(exc, google.auth.exceptions.DefaultCredentialsError):
        return StorageError(
            f"{url}: no Google credentials: set GOOGLE_APPLICATION_CREDENTIALS or run "
            "`gcloud auth application-default login`"
        )
    if isinstance(exc, requests.exceptions.Timeout | urllib3.exceptions.TimeoutError) or (
            isinstance(exc, requests.exceptions.ConnectionError) and "timed out" in detail):
        # No byte for the timeout (requests reports one mid-body as a ConnectionError).
        return StalledRequest(f"{url}: cannot {action}: stalled: {type(exc).__name__}: {detail}")
    if isinstance(exc, _TRANSIENT):
        return TransientStorageError(f"{url}: cannot {action}: {type(exc).__name__}: {detail}")
    if (isinstance(exc, InvalidResponse | MediaInvalidResponse) and exc.response is not None
            and exc.response.status_code >= 500):
        return TransientStorageError(f"{url}: cannot {action}: HTTP {exc.response.status_code}: {detail}")
    return StorageError(f"{url}: cannot {action}: {type(exc).__name__}: {detail}")


class GcsStore(ObjectStore):
    """Objects under gs://bucket/prefix."""

    scheme = "gs"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.bucket_name, prefix = split_bucket_url(self.url, "gs")
        self.keys = BucketKeys(self.url, prefix)
        try:
            self.client = gcs_client()
        except google.auth.exceptions.GoogleAuthError as exc:
            raise translate(exc, self.url, "connect") from None
        self.bucket = self.client.bucket(self.bucket_name)
        # Seconds a request may wait to connect, or for its next byte (requests' (connect, read) timeout).
        self.timeout = DEFAULT_TIMEOUT_S

    @property
    def _one_try(self) -> dict[str, Any]:
        """Each library call: one attempt (the engine retries), bounded by the timeout."""
        return {"retry": None, "timeout": self.timeout}

    def with_stall_timeout(self, seconds: float) -> GcsStore:
        bounded = GcsStore(self.url)
        bounded.timeout = seconds
        return bounded

    def _calling(self, key: str, action: str) -> AbstractContextManager[None]:
        return translating(_CLIENT_ERRORS, lambda exc: self._translate(exc, key, action))

    def _translate(self, exc: BaseException, key: str, action: str) -> StorageError:
        if isinstance(exc, api_exceptions.NotFound) and not self._bucket_exists():
            return StorageError(
                f"{self.url_for(key)}: bucket '{self.bucket_name}' does not exist: create it or fix the URL"
            )
        return translate(exc, self.url_for(key), action)

    def _bucket_exists(self) -> bool:
        # A 404 does not say whether the object or its bucket is missing; only the bucket's own lookup does.
        with self._calling("", "look up the bucket"):
            return bool(self.bucket.exists(**self._one_try))

    def _blob(self, key: str) -> storage.Blob:
        return self.bucket.blob(self.keys.name(key))

    def _info(self, key: str, blob: storage.Blob) -> ObjectInfo:
        # The generation changes with every write of the object: the version token the engine's cache needs.
        etag = str(blob.generation) if blob.generation is not None else blob.etag
        mtime = blob.updated.timestamp() if blob.updated is not None else None
        checksum = f"{CRC32C}:{blob.crc32c}" if blob.crc32c else None
        return ObjectInfo(key, int(blob.size or 0), etag, mtime, checksum)

    # -- reads -------------------------------------------------------------------------------------

    def child(self, prefix: str) -> GcsStore:
        return GcsStore(self.url_for(prefix.strip("/")))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self._calling(prefix, "list"):
            found = [self._info(key, blob) for key, blob in self.keys.objects(self.client.list_blobs(
                self.bucket, prefix=self.keys.search_prefix(prefix), **self._one_try))]
        return iter(sorted(found, key=lambda info: info.key))

    def head(self, key: str) -> ObjectInfo | None:
        with self._calling(key, "stat"):
            blob = self.bucket.get_blob(self.keys.name(key), **self._one_try)
        return None if blob is None else self._info(key, blob)

    def presigned_get(self, key: str, expires_s: float) -> str | None:
        """A V4 signed URL, where the client's credentials hold a key that signs (a service account's); None for
        others (a user's login, the metadata server's token, the emulator's anonymous client)."""
        from google.auth.credentials import Signing

        if not isinstance(self.client._credentials, Signing):
            return None
        with self._calling(key, "sign a URL for"):
            return str(self._blob(key).generate_signed_url(version="v4", expiration=timedelta(seconds=expires_s),
                                                           method="GET"))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if nothing_to_read(self.url_for(key), start, length):
            return b""
        with self._calling(key, f"read bytes {start}-{start + length - 1}"):
            try:
                # A range has no checksum of its own: the engine verifies the whole file as it is written.
                data: bytes = self._blob(key).download_as_bytes(
                    start=start, end=start + length - 1, checksum=None, raw_download=True, **self._one_try
                )
            except api_exceptions.RequestRangeNotSatisfiable:
                return b""  # start at or past the end: no bytes there
        return data

    def get_bytes(self, key: str) -> bytes:
        with self._calling(key, "read"):
            data: bytes = self._blob(key).download_as_bytes(checksum="crc32c", raw_download=True, **self._one_try)
        return data

    def get_file(self, key: str, path: Path) -> ObjectInfo:
        blob = self._blob(key)
        path = Path(path)
        temp = path.with_name(f".{path.name}.trainpipe-tmp")
        with os_errors_named(str(path), "write"):
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                with self._calling(key, "read"):
                    blob.download_to_filename(str(temp), checksum="crc32c", raw_download=True, **self._one_try)
                os.replace(temp, path)
            finally:
                temp.unlink(missing_ok=True)
        return self._info(key, blob)

    # -- writes ------------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        blob = self._blob(key)
        with self._calling(key, "write"):
            blob.upload_from_string(data, content_type="application/octet-stream", checksum="crc32c", **self._one_try)
        return self._info(key, blob)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        blob = self._blob(key)
        with self._calling(key, "create"):
            try:
                blob.upload_from_string(data, content_type="application/octet-stream", checksum="crc32c",
                                        if_generation_match=0, **self._one_try)
            except api_exceptions.PreconditionFailed:  # 412: a generation exists, i.e. the object does
                return False
        return True

    def put_file(self, path: Path, key: str) -> ObjectInfo:
        path = Path(path)
        # A chunk size makes the upload resumable, in chunks: a large file is never sent in one request.
        blob = self.bucket.blob(self.keys.name(key), chunk_size=UPLOAD_CHUNK_SIZE)
        with os_errors_named(str(path), "read"):
            if not path.is_file():
                raise StorageError(f"{path}: no such local file: check the path before uploading it")
            with self._calling(key, "write"):
                blob.upload_from_filename(
                    str(path), content_type="application/octet-stream", checksum="crc32c", **self._one_try
                )
        return self._info(key, blob)

    def delete(self, key: str) -> None:
        try:
            with self._calling(key, "delete"):
                self._blob(key).delete(**self._one_try)
        except ObjectNotFound:
            return

    # -- whole files through transfer_manager (infra.storage.native.NativeTransfers) ------------------------

    def files_in_flight(self, config: TransferConfig) -> int:
        # transfer_manager's requests run in Python threads under the GIL (each large file on config.workers more of
        # them): beyond the python engine's parallelism, more files at once only contend (the emulator, 0.5 GB:
        # 171-201 MB/s with 64 files in flight, 210-217 with 16).
        return config.workers

    def start_fetch(self, key: str, path: Path, size: int, expected: Checksum | None, job: FileJob
                    ) -> Threaded[Checksum | None]:
        # transfer_manager blocks the thread it runs on until the file is complete.
        return Threaded(job.background(partial(self._fetch_file, key, path, size, expected, job)))

    def _fetch_file(self, key: str, path: Path, size: int, expected: Checksum | None, job: FileJob
                    ) -> Checksum | None:
        url, config = self.url_for(key), job.config
        if size <= config.part_size:
            blob = self._blob(key)
            # One request; the library checks the bytes against the crc32c the response carries.
            fetch = partial(blob.download_to_filename, str(path), checksum="crc32c", raw_download=True, **self._one_try)
        else:
            with self._calling(key, "stat"):
                found = self.bucket.get_blob(self.keys.name(key), **self._one_try)
            if found is None:
                raise ObjectNotFound(f"{url}: no such object: check the key, or upload it first")
            blob = found
            # Ranged chunks in parallel; their CRC32Cs join into the object's and are checked against it.
            fetch = partial(transfer_manager.download_chunks_concurrently, blob, str(path),
                            chunk_size=config.part_size, worker_type=transfer_manager.THREAD,
                            max_workers=config.workers, crc32c_checksum=True,
                            download_kwargs={"raw_download": True, **self._one_try})
        call_with_retries(lambda: self._call(key, "read", fetch), f"GET {url}", config.retry, job.cancel)
        job.on_bytes(size)
        stored = Checksum(CRC32C, blob.crc32c) if blob.crc32c else None
        if expected is None or stored is None:
            return stored
        if expected.algorithm != CRC32C:
            return None  # the engine checks the file against expected's own algorithm
        check(stored, expected, url)
        return expected

    def send_file(self, path: Path, key: str, size: int, job: FileJob) -> Checksum:
        url, config = self.url_for(key), job.config
        emulator = os.environ.get("STORAGE_EMULATOR_HOST") or None
        if size > config.multipart_threshold and emulator not in _xml_multipart_refused:
            blob = self._blob(key)
            send = partial(transfer_manager.upload_chunks_concurrently, str(path), blob,
                           content_type="application/octet-stream", chunk_size=config.part_size,
                           worker_type=transfer_manager.THREAD, max_workers=config.workers, checksum="crc32c",
                           **self._one_try)
            try:
                call_with_retries(lambda: self._call(key, "write", send), f"PUT {url}", config.retry, job.cancel)
                with self._calling(key, "stat"):
                    blob.reload(**self._one_try)
            except _XmlMultipartMissing:
                with _clients_lock:
                    first = emulator not in _xml_multipart_refused
                    _xml_multipart_refused.add(emulator)
                if first:
                    log.warning("%s has no XML multipart upload (the GCS emulator has none): files over %d MiB go "
                                "up as resumable uploads", emulator or "the GCS endpoint",
                                config.multipart_threshold >> 20)
                return self.send_file(path, key, size, job)
        else:
            blob = self.bucket.blob(self.keys.name(key), chunk_size=UPLOAD_CHUNK_SIZE)
            send = partial(blob.upload_from_filename, str(path), content_type="application/octet-stream",
                           checksum="crc32c", **self._one_try)
            call_with_retries(lambda: self._call(key, "write", send), f"PUT {url}", config.retry, job.cancel)
        job.on_bytes(size)
        if blob.size is not None and int(blob.size) != size:
            raise StorageError(f"{url}: stored {blob.size} bytes of {path}'s {size}: upload it again")
        return Checksum(CRC32C, blob.crc32c) if blob.crc32c else checksum_file(path, CRC32C)

    def _call(self, key: str, action: str, call: Callable[[], object]) -> None:
        try:
            with self._calling(key, action):
                call()
        except StorageError as exc:
            cause = exc.original
            response = getattr(cause, "response", None)
            if isinstance(cause, InvalidResponse | MediaInvalidResponse) and response is not None and (
                    response.status_code in (404, 405, 501) and "uploads" in str(getattr(response, "url", ""))):
                raise _XmlMultipartMissing() from cause
            raise


class _XmlMultipartMissing(Exception):
    """The server has no XML multipart upload (the GCS emulator answers 501)."""
