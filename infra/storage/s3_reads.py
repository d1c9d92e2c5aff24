"""S3 listing and HEAD through awscrt's S3 client: the reads a copy needs before its bytes move, without botocore
(importing it and building its client cost ~0.3 s of `trainpipe cp`'s start, more than s5cmd's whole run of a
small copy).

A ListObjectsV2 page is one signed GET (`encoding-type=url`, so any key survives XML), parsed with the standard
library and decoded as botocore does (`unquote_plus`: S3 encodes a space as '+' and a '+' as '%2B'); pages follow
the continuation token. Errors come back as the CRT's; the store turns them into its one-line ones.
"""

from __future__ import annotations

import threading
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote, unquote_plus

from awscrt import http, s3

from infra.storage.checksum import CRC32C, CRC64NVME
from infra.storage.s3_native import Endpoint, Headers, wait
from infra.storage.stall import StallWatch

PAGE_SIZE = 1000  # S3's largest page
# The full-object checksums a HEAD may report that the engine can check (a multipart object's COMPOSITE ones,
# "<base64>-<parts>", are not of the whole object).
_HEAD_CHECKSUMS = (CRC64NVME, CRC32C)


@dataclass(frozen=True)
class Listed:
    """One object as the store reports it: its full name in the bucket, size, version and time."""

    name: str
    size: int
    etag: str | None
    modified: float | None
    checksum: str | None = None


def _query(params: dict[str, str]) -> str:
    return "&".join(f"{quote(name, safe='-_.~')}={quote(value, safe='-_.~')}" for name, value in params.items())


def _call(client: s3.S3Client, request: http.HttpRequest, operation: str, stall_timeout_s: float, what: str
          ) -> tuple[Headers, bytes]:
    """One request, its response headers and body; a failure is the CRT's (an S3ResponseError for a server's
    error reply), a request that moves no byte for the bound a StalledRequest."""
    headers, body = Headers(), bytearray()
    watch = StallWatch(stall_timeout_s)

    def on_body(chunk: bytes, **kwargs: Any) -> None:
        watch.moved()
        body.extend(chunk)

    request_ = client.make_request(type=s3.S3RequestType.DEFAULT, operation_name=operation, request=request,
                                   on_headers=headers, on_body=on_body)
    wait(request_, threading.Event(), watch, what)
    return headers, bytes(body)


def _local(tag: str) -> str:
    return tag.rpartition("}")[2]  # the element's name without S3's XML namespace


def _text(element: ET.Element, name: str) -> str | None:
    for child in element:
        if _local(child.tag) == name:
            return child.text or ""
    return None


def _modified(text: str | None) -> float | None:
    return datetime.fromisoformat(text).timestamp() if text else None


def _etag(text: str | None) -> str | None:
    return text.strip('"') if text else None


def list_objects(client: s3.S3Client, endpoint: Endpoint, bucket: str, prefix: str, stall_timeout_s: float,
                 what: str, page_size: int = PAGE_SIZE) -> list[Listed]:
    """Every object whose name starts with prefix, in the order the server lists them."""
    found: list[Listed] = []
    token: str | None = None
    while True:
        params = {"list-type": "2", "encoding-type": "url", "max-keys": str(page_size), "prefix": prefix}
        if token is not None:
            params["continuation-token"] = token
        request = http.HttpRequest("GET", f"{endpoint.path(bucket, '')}?{_query(params)}",
                                   http.HttpHeaders([("Host", endpoint.host(bucket))]))
        _, body = _call(client, request, "ListObjectsV2", stall_timeout_s, what)
        page = ET.fromstring(body)
        decode = unquote_plus if _text(page, "EncodingType") == "url" else str
        for item in page:
            if _local(item.tag) == "Contents":
                found.append(Listed(decode(_text(item, "Key") or ""), int(_text(item, "Size") or 0),
                                    _etag(_text(item, "ETag")), _modified(_text(item, "LastModified"))))
        token = _text(page, "NextContinuationToken")
        if _text(page, "IsTruncated") != "true" or not token:
            return found


def head_object(client: s3.S3Client, endpoint: Endpoint, bucket: str, name: str, stall_timeout_s: float, what: str
                ) -> Listed:
    """The object's size, version, time and full-object checksum (when the store keeps one)."""
    request = http.HttpRequest("HEAD", endpoint.path(bucket, name), http.HttpHeaders(
        [("Host", endpoint.host(bucket)), ("x-amz-checksum-mode", "ENABLED")]))
    headers, _ = _call(client, request, "HeadObject", stall_timeout_s, what)
    values = headers.values
    checksum = None
    if values.get("x-amz-checksum-type", "FULL_OBJECT") != "COMPOSITE":
        checksum = next((str(found) for found in map(headers.checksum, _HEAD_CHECKSUMS) if found is not None), None)
    modified = values.get("last-modified")
    return Listed(name, int(values.get("content-length", 0)), _etag(values.get("etag")),
                  parsedate_to_datetime(modified).timestamp() if modified else None, checksum)
