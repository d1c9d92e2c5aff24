"""What a dataset prefix holds: every object's key, size, version (etag) and the checksum its store keeps, if any.

The store's own checksum is what staging verifies against, so the orchestrator never has to read the bytes itself:
S3's ETag is the MD5 of a single-part upload (a multipart ETag, '<md5>-<parts>', is not a checksum of the bytes),
and GCS keeps an MD5 (not for composite objects) and a CRC32C of every object. Azure keeps the Content-MD5 of an
object written in one request (and of one whose writer set it). A file:// store keeps none.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any

from infra.storage.base import ObjectStore
from infra.storage.retry import call_with_retries

_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")
CHECKSUM_ALGORITHMS = ("md5", "crc32c", "sha256")


@dataclass(frozen=True)
class Listed:
    key: str
    size: int
    etag: str | None
    checksum: str | None  # "<algorithm>:<hex>" the store keeps for the object, None where it keeps none


def _hex(b64: str | None) -> str | None:
    return base64.b64decode(b64).hex() if b64 else None


def _gcs_listing(store: Any) -> list[Listed]:
    """A GcsStore's objects with their checksums: its ObjectInfo carries none, the listing's blobs do."""
    import google.api_core.exceptions
    import google.auth.exceptions
    import requests

    from infra.storage.gcs import translate

    found = []
    try:
        blobs = store.client.list_blobs(store.bucket, prefix=store.keys.search_prefix(""), retry=None)  # lazy: pages
        for key, blob in store.keys.objects(blobs):
            md5, crc = _hex(blob.md5_hash), _hex(blob.crc32c)
            checksum = f"md5:{md5}" if md5 else f"crc32c:{crc}" if crc else None
            found.append(Listed(key, int(blob.size or 0), str(blob.generation), checksum))
    except (google.api_core.exceptions.GoogleAPIError, google.auth.exceptions.GoogleAuthError,
            requests.exceptions.RequestException, ConnectionError, TimeoutError) as exc:
        raise translate(exc, store.url, "list") from exc
    return sorted(found, key=lambda listed: listed.key)


def _azure_listing(store: Any) -> list[Listed]:
    """An AzureBlobStore's objects with their Content-MD5s: its ObjectInfo carries the CRC64NVME trainpipe records,
    which a snapshot does not take; the listing's blobs carry the MD5 too."""
    from azure.core.exceptions import AzureError

    from infra.storage.azure import translate

    found = []
    try:
        blobs = store.container.list_blobs(name_starts_with=store.keys.search_prefix("") or None)  # lazy: pages
        for key, blob in store.keys.objects(blobs):
            md5 = blob.content_settings.content_md5
            found.append(Listed(key, int(blob.size or 0), (blob.etag or "").strip('"') or None,
                                f"md5:{bytes(md5).hex()}" if md5 else None))
    except (AzureError, ConnectionError, TimeoutError) as exc:
        raise translate(exc, store.url, store.container_name, "list") from exc
    return sorted(found, key=lambda listed: listed.key)


def list_prefix(store: ObjectStore) -> list[Listed]:
    """Every object under the store's root, in key order (the listing retried when it fails transiently)."""
    return call_with_retries(lambda: _listing(store), f"LIST {store.url}")


def _listing(store: ObjectStore) -> list[Listed]:
    if store.scheme == "gs":
        return _gcs_listing(store)
    if store.scheme == "az":
        return _azure_listing(store)
    listed = []
    for info in store.list():
        etag = (info.etag or "").lower()
        checksum = f"md5:{etag}" if store.scheme == "s3" and _MD5_ETAG.match(etag) else None
        listed.append(Listed(info.key, info.size, info.etag, checksum))
    return listed
