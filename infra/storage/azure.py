"""The az:// object store on azure-storage-blob: az://container/prefix in one storage account.

The account comes from the standard environment (azure_account.py): AZURE_STORAGE_CONNECTION_STRING, else
AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY or an identity (DefaultAzureCredential: a managed identity on a VM,
the az CLI's login, a service principal's variables).

Large files go through the python engine as blocks: start_multipart names an upload, every part is a block staged in
parallel on the engine's bounded pool (stage_block, its Content-MD5 checked by the service), and the commit of the
block list makes the object visible, whole. Downloads are the engine's ranged reads. The object's CRC64NVME (the
engine's checksum, the one S3 keeps) is written with it as blob metadata, so listings, HEADs and whole-object reads
carry and check it as S3's and GCS's do.

The SDK's own retries are off (retry_total=0): the transfer engine retries each request with logged backoff, so
every failure here is either marked transient (throttling, 5xx, dropped connections; StalledRequest for a request
that moved no byte for the read timeout) or is one line naming the object and the fix.
"""

from __future__ import annotations

import base64
import threading
import uuid
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.storage.blob import BlobBlock, BlobClient, BlobProperties, ContainerClient

from infra.storage.azure_account import NO_ACCOUNT, service_client
from infra.storage.base import ChecksumMismatch, ObjectInfo, ObjectNotFound, ObjectStore, StorageError
from infra.storage.checksum import CRC64NVME, Checksum, Crc, PartCrcs, check, checksum_bytes, checksum_file
from infra.storage.cloud import BucketKeys, TransientStorageError, nothing_to_read, split_bucket_url, translating
from infra.storage.files import os_errors_named, write_all, write_atomically
from infra.storage.stall import StalledRequest

READ_TIMEOUT_S = 60.0  # control calls; a transfer's requests get its stall bound (with_stall_timeout)
CHECKSUM_METADATA = "trainpipe_crc64nvme"  # blob metadata: the object's CRC64NVME, base64 as S3 reports it
_META_HEADER = "x-ms-meta-"
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_CLIENT_ERRORS = (AzureError, ValueError, ConnectionError, TimeoutError)


def translate(exc: BaseException, url: str, container: str, action: str) -> StorageError:
    """The one-line StorageError for an azure-storage-blob failure; transient ones are marked for retries."""
    detail = " ".join(str(exc).split("\n")[0].split())
    response = getattr(exc, "response", None)
    # The SDK's own calls parse the service's error code; a generated operation's leave it in the header.
    code = str(getattr(exc, "error_code", "") or (response.headers.get("x-ms-error-code") if response else "") or "")
    status = int(getattr(response, "status_code", 0) or getattr(exc, "status_code", 0) or 0)
    if code == "ContainerNotFound":
        return StorageError(f"{url}: container '{container}' does not exist: create it or fix the URL")
    if isinstance(exc, ResourceNotFoundError) or code == "BlobNotFound":
        return ObjectNotFound(f"{url}: no such object: check the key, or upload it first")
    if code in ("Md5Mismatch", "Crc64Mismatch"):
        return ChecksumMismatch(f"{url}: checksum mismatch while trying to {action} ({detail}): run again")
    if isinstance(exc, ClientAuthenticationError) or status == 403:
        return StorageError(f"{url}: cannot {action}: access denied ({code or detail}): check the credentials "
                            "(AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY or the identity's role on the "
                            "account) and the container's permissions")
    if type(exc).__name__ == "CredentialUnavailableError":  # azure.identity's: loaded only where it is used
        return StorageError(f"{url}: no Azure credentials ({detail}): {NO_ACCOUNT}")
    if isinstance(exc, ServiceRequestError | ServiceResponseError | TimeoutError | ConnectionError) and (
            "timed out" in detail.lower() or "timeout" in type(exc).__name__.lower()):
        # No byte for the read timeout (requests reports one mid-body as a connection error saying so).
        return StalledRequest(f"{url}: cannot {action}: stalled: {type(exc).__name__}: {detail}")
    if isinstance(exc, ServiceRequestError | ServiceResponseError | ConnectionError | TimeoutError) or (
            status in _TRANSIENT_STATUS or code in ("ServerBusy", "OperationTimedOut", "InternalError")):
        return TransientStorageError(f"{url}: cannot {action}: {type(exc).__name__}: {detail}")
    if isinstance(exc, HttpResponseError) and exc.response is None:  # a body cut short (IncompleteReadError)
        return TransientStorageError(f"{url}: cannot {action}: {type(exc).__name__}: {detail}")
    return StorageError(f"{url}: cannot {action}: {type(exc).__name__}: {code + ': ' if code else ''}{detail}")


def _block_id(upload_id: str, number: int) -> str:
    # Every block id of one blob must have the same length: the upload's id and a fixed-width part number.
    return base64.b64encode(f"{upload_id}-{number:06d}".encode()).decode()


def _metadata_of(headers: Mapping[str, str]) -> dict[str, str]:
    """The blob's metadata in a response's headers (x-ms-meta-<name>)."""
    return {name[len(_META_HEADER):]: value for name, value in headers.items()
            if name.lower().startswith(_META_HEADER)}


def _stored_checksum(metadata: dict[str, str] | None, url: str) -> Checksum | None:
    # Metadata names are case-insensitive to the service, which may return them in another case.
    for name, value in (metadata or {}).items():
        if name.lower() == CHECKSUM_METADATA:
            try:
                return Checksum.parse(f"{CRC64NVME}:{value}")
            except ValueError:
                raise StorageError(f"{url}: its {CHECKSUM_METADATA} metadata {value!r} is no CRC64NVME: remove the "
                                   "metadata, or upload the object again") from None
    return None


class _Blocks:
    """The blocks one upload staged: their CRCs, joined at the commit into the CRC the object is stored with."""

    def __init__(self) -> None:
        self.crcs = PartCrcs(CRC64NVME)
        self._ends: dict[int, int] = {}  # offset -> end of the block staged there (a retried block replaces it)
        self._lock = threading.Lock()

    def add(self, offset: int, data: bytes) -> None:
        self.crcs.add(offset, data)
        with self._lock:
            self._ends[offset] = offset + len(data)

    def checksum(self, url: str, blocks: int) -> Checksum:
        """The CRC of the object these blocks make, once they tile it: each starting where the one before ended."""
        with self._lock:
            ends = sorted(self._ends.items())
        position = 0
        for offset, end in ends:
            if offset != position:
                raise StorageError(f"{url}: the staged blocks do not tile the object (one starts at {offset}, the one "
                                   f"before ends at {position}): upload it again")
            position = end
        if len(ends) != blocks:
            raise StorageError(f"{url}: {blocks} blocks to commit but {len(ends)} were staged: upload it again")
        return self.crcs.total(position)


class AzureBlobStore(ObjectStore):
    """Objects under az://container/prefix in the environment's storage account."""

    scheme = "az"
    min_part_size = 1  # a block may be any size up to 4000 MiB

    def __init__(self, url: str, read_timeout_s: float = READ_TIMEOUT_S) -> None:
        super().__init__(url)
        self.container_name, prefix = split_bucket_url(self.url, "az")
        self.keys = BucketKeys(self.url, prefix)
        self.read_timeout_s = read_timeout_s
        self._container: ContainerClient | None = None
        self._uploads: dict[str, _Blocks] = {}  # by upload id
        self._uploads_lock = threading.Lock()

    @property
    def container(self) -> ContainerClient:
        """The container's client, made on first use (the account's credentials are looked up then)."""
        if self._container is None:
            with self._calling("", "connect"):
                self._container = service_client(self.read_timeout_s).get_container_client(self.container_name)
        return self._container

    def with_stall_timeout(self, seconds: float) -> AzureBlobStore:
        return AzureBlobStore(self.url, seconds)

    def _calling(self, key: str, action: str) -> AbstractContextManager[None]:
        return translating(_CLIENT_ERRORS,
                           lambda exc: translate(exc, self.url_for(key), self.container_name, action))

    def _blob(self, key: str) -> BlobClient:
        return self.container.get_blob_client(self.keys.name(key))

    def _info(self, key: str, properties: BlobProperties) -> ObjectInfo:
        checksum = _stored_checksum(properties.metadata, self.url_for(key))
        modified = properties.last_modified.timestamp() if properties.last_modified is not None else None
        etag = properties.etag.strip('"') if properties.etag else None
        return ObjectInfo(key, int(properties.size or 0), etag, modified, str(checksum) if checksum else None)

    # -- reads -------------------------------------------------------------------------------------

    def child(self, prefix: str) -> AzureBlobStore:
        return AzureBlobStore(self.url_for(prefix.strip("/")), self.read_timeout_s)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self._calling(prefix, "list"):
            found = [self._info(key, blob) for key, blob in self.keys.objects(self.container.list_blobs(
                name_starts_with=self.keys.search_prefix(prefix) or None, include=["metadata"]))]
        return iter(sorted(found, key=lambda info: info.key))

    def head(self, key: str) -> ObjectInfo | None:
        try:
            with self._calling(key, "stat"):
                return self._info(key, self._blob(key).get_blob_properties())
        except ObjectNotFound:
            return None

    def presigned_get(self, key: str, expires_s: float) -> str | None:
        """A read-only SAS for the one blob: signed with the account key, or with a user delegation key where an
        Azure AD identity reaches the account; None when the credential is a SAS already (it cannot sign another)."""
        from azure.core.credentials import TokenCredential
        from azure.storage.blob import BlobSasPermissions, generate_blob_sas

        blob = self._blob(key)
        now = datetime.now(UTC)
        expiry = now + timedelta(seconds=expires_s)
        signing: dict[str, Any]
        credential = blob.credential
        with self._calling(key, "sign a URL for"):
            if account_key := getattr(credential, "account_key", None):
                signing = {"account_key": account_key}
            elif isinstance(credential, TokenCredential):
                # Backdated a little: the service refuses a key whose start is ahead of its own clock.
                delegation = service_client(self.read_timeout_s).get_user_delegation_key(
                    now - timedelta(minutes=5), expiry)
                signing = {"user_delegation_key": delegation}
            else:
                return None
            sas = generate_blob_sas(account_name=blob.account_name, container_name=self.container_name,
                                    blob_name=blob.blob_name, permission=BlobSasPermissions(read=True), expiry=expiry,
                                    **signing)
        return f"{blob.url.split('?', 1)[0]}?{sas}"

    def _download(self, key: str, byte_range: str | None) -> tuple[Iterator[bytes], Mapping[str, str]]:
        """One GET of the blob (or a range of it): its body, streamed, and the response's headers.

        The service's Get Blob itself, not download_blob: the SDK's downloader retries a body that fails mid-read
        (three times, a second apart, unlogged), where the engine must see the failure to retry it with its backoff,
        its log line and its stall bound."""
        blob = self._blob(key)
        body, headers = blob._client.blob.download(  # the one operation under download_blob
            range=byte_range, cls=lambda response, body, _headers: (body, response.http_response.headers))
        return body, headers

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if nothing_to_read(self.url_for(key), start, length):
            return b""
        with self._calling(key, f"read bytes {start}-{start + length - 1}"):
            try:
                # A range has no checksum of its own: the engine verifies the whole file as it is written.
                body, _ = self._download(key, f"bytes={start}-{start + length - 1}")
                return b"".join(body)
            except HttpResponseError as exc:
                if exc.status_code == 416:  # start at or past the end: no bytes there
                    return b""
                raise

    def get_bytes(self, key: str) -> bytes:
        with self._calling(key, "read"):
            body, headers = self._download(key, None)
            data = b"".join(body)
        self._check_whole(key, headers, checksum_bytes(data), len(data))
        return data

    def _check_whole(self, key: str, headers: Mapping[str, str], actual: Checksum, size: int) -> None:
        """A whole object read: held to its length and to the CRC it was stored with, where it has one."""
        expected = int(headers.get("Content-Length") or 0)
        if size != expected:
            raise TransientStorageError(f"{self.url_for(key)}: got {size} of {expected} bytes: the connection was "
                                        "cut")
        stored = _stored_checksum(_metadata_of(headers), self.url_for(key))
        if stored is not None:
            check(actual, stored, self.url_for(key))

    def get_file(self, key: str, path: Path) -> ObjectInfo:
        path = Path(path)
        crc = Crc(CRC64NVME)
        with self._calling(key, "read"):
            body, headers = self._download(key, None)

            def fill(fd: int) -> None:
                for chunk in body:
                    crc.update(chunk)
                    write_all(fd, chunk)

            with os_errors_named(str(path), "write"):
                written = write_atomically(path, fill)
        try:
            self._check_whole(key, headers, crc.checksum(), written.st_size)
        except StorageError:
            path.unlink(missing_ok=True)
            raise
        modified = headers.get("Last-Modified")
        return ObjectInfo(key, written.st_size, (headers.get("ETag") or "").strip('"') or None,
                          parsedate_to_datetime(modified).timestamp() if modified else None,
                          str(crc.checksum()))

    # -- writes ------------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        with self._calling(key, "write"):
            # validate_content: the request carries the bytes' MD5, which the service checks.
            reply = self._blob(key).upload_blob(data, length=len(data), overwrite=True, validate_content=True,
                                                metadata=self._metadata(checksum_bytes(data)), max_concurrency=1)
        return self._written(key, len(data), reply)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create key with data only where no object has that key (If-None-Match: *); False when one exists."""
        try:
            with self._calling(key, "create"):
                # overwrite=False: the SDK sends If-None-Match: *, and the service refuses an existing blob.
                self._blob(key).upload_blob(data, length=len(data), overwrite=False, validate_content=True,
                                            metadata=self._metadata(checksum_bytes(data)), max_concurrency=1)
        except StorageError as exc:
            cause = exc.original
            if isinstance(cause, ResourceExistsError) or (
                    isinstance(cause, HttpResponseError) and cause.status_code in (409, 412)):
                return False
            raise
        return True

    def put_file(self, path: Path, key: str) -> ObjectInfo:
        path = Path(path)
        with os_errors_named(str(path), "read"):
            if not path.is_file():
                raise StorageError(f"{path}: no such local file: check the path before uploading it")
            checksum = checksum_file(path)
            size = path.stat().st_size
            with open(path, "rb") as body, self._calling(key, "write"):
                reply = self._blob(key).upload_blob(body, length=size, overwrite=True, validate_content=True,
                                                    metadata=self._metadata(checksum), max_concurrency=1)
        return self._written(key, size, reply)

    def _metadata(self, checksum: Checksum) -> dict[str, str]:
        return {CHECKSUM_METADATA: checksum.value}

    def _written(self, key: str, size: int, reply: dict[str, Any]) -> ObjectInfo:
        etag = str(reply.get("etag") or "").strip('"') or None
        modified = reply.get("last_modified")
        return ObjectInfo(key, size, etag, modified.timestamp() if modified is not None else None)

    def delete(self, key: str) -> None:
        try:
            with self._calling(key, "delete"):
                self._blob(key).delete_blob()
        except ObjectNotFound:
            return

    # -- block uploads (infra.storage.parts.MultipartUploads) ----------------------------------------

    def start_multipart(self, key: str) -> str:
        # Blocks are staged on the blob itself and need no upload to be opened: the id only names this upload's.
        upload_id = uuid.uuid4().hex
        with self._uploads_lock:
            self._uploads[upload_id] = _Blocks()
        return upload_id

    def put_part(self, key: str, upload_id: str, number: int, offset: int, data: bytes) -> str:
        block_id = _block_id(upload_id, number)
        with self._calling(key, f"upload block {number}"):
            # validate_content: the block's Content-MD5, checked by the service before it keeps the block.
            self._blob(key).stage_block(block_id, data, length=len(data), validate_content=True)
        self._blocks(key, upload_id).add(offset, data)
        return block_id

    def _blocks(self, key: str, upload_id: str) -> _Blocks:
        with self._uploads_lock:
            blocks = self._uploads.get(upload_id)
        if blocks is None:
            raise StorageError(f"{self.url_for(key)}: upload {upload_id} was not started by this store: start it "
                               "with start_multipart")
        return blocks

    def finish_multipart(self, key: str, upload_id: str, tags: list[str]) -> ObjectInfo:
        checksum = self._blocks(key, upload_id).checksum(self.url_for(key), len(tags))
        with self._calling(key, "commit the block list"):
            blob = self._blob(key)
            # The CRC goes with the commit: the object is never visible without it.
            blob.commit_block_list([BlobBlock(block_id=tag) for tag in tags], metadata=self._metadata(checksum))
            properties = blob.get_blob_properties()
        with self._uploads_lock:
            self._uploads.pop(upload_id, None)
        return self._info(key, properties)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """The staged blocks of an upload never committed are dropped by the service (after a week); nothing names
        them to delete sooner."""
        with self._uploads_lock:
            self._uploads.pop(upload_id, None)
