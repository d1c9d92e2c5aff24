"""S3's calls around a copy's bytes through awscrt's S3 client: listing, HEAD and the multipart upload's create,
complete and abort, without botocore (importing it and building its client cost ~0.3 s of `trainpipe cp`'s start,
more than s5cmd's whole run of a small copy).

A ListObjectsV2 page is one signed GET (`encoding-type=url`, so any key survives XML), parsed with the standard
library and decoded as botocore does (`unquote_plus`: S3 encodes a space as '+' and a '+' as '%2B'); pages follow
the continuation token. Errors come back as the CRT's (or, for an error S3 sends inside a 200 reply to a completion,
as ErrorReply); the store turns them into its one-line ones.
"""

from __future__ import annotations

import io
import threading
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, unquote_plus

from awscrt import http, s3

from infra.storage.checksum import CRC32C, CRC64NVME
from infra.storage.crt_traffic import TRAFFIC
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


class ErrorReply(Exception):
    """An S3 error in the body of a 200 reply (CompleteMultipartUpload may answer so once it has begun)."""

    def __init__(self, code: str, status: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.status, self.message = code, status, message


def _call(client: s3.S3Client, request: http.HttpRequest, operation: str, stall_timeout_s: float, what: str,
          cancel: threading.Event | None = None) -> tuple[Headers, bytes]:
    """One request, its response headers and body; a failure is the CRT's (an S3ResponseError for a server's
    error reply), a request that moves no byte for the bound a StalledRequest, one cancelled Cancelled."""
    headers, body = Headers(), bytearray()
    # Judged with the CRT's connections, like a file's parts: a HEAD after each PUT waits in the CRT's queue behind
    # the other files' parts and shows no byte of its own while the link is busy (a 6 GB upload with 8 connections
    # retried 6 such HEADs as stalled).
    watch = StallWatch(stall_timeout_s, link=TRAFFIC.idle_s)

    def on_body(chunk: bytes, **kwargs: Any) -> None:
        watch.moved()
        body.extend(chunk)

    request_ = client.make_request(type=s3.S3RequestType.DEFAULT, operation_name=operation, request=request,
                                   on_headers=headers, on_body=on_body)
    wait(request_, cancel or threading.Event(), watch, what)
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


def head_object(client: s3.S3Client, endpoint: Endpoint, bucket: str, name: str, stall_timeout_s: float, what: str,
                cancel: threading.Event | None = None) -> Listed:
    """The object's size, version, time and full-object checksum (when the store keeps one): a callback's worth
    of Python instead of a botocore call's (an upload asks this once per file the store did not echo a CRC for)."""
    request = http.HttpRequest("HEAD", endpoint.path(bucket, name), http.HttpHeaders(
        [("Host", endpoint.host(bucket)), ("x-amz-checksum-mode", "ENABLED")]))
    headers, _ = _call(client, request, "HeadObject", stall_timeout_s, what, cancel)
    values = headers.values
    checksum = None
    if values.get("x-amz-checksum-type", "FULL_OBJECT") != "COMPOSITE":
        checksum = next((str(found) for found in map(headers.checksum, _HEAD_CHECKSUMS) if found is not None), None)
    modified = values.get("last-modified")
    return Listed(name, int(values.get("content-length", 0)), _etag(values.get("etag")),
                  _http_time(modified) if modified else None, checksum)


_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def _http_time(text: str) -> float:
    """An HTTP date (\"Sun, 06 Nov 1994 08:49:37 GMT\", what S3 sends) as a timestamp; any other form through
    email.utils, imported only then (with the socket module it pulls in, ~20 ms of `trainpipe cp`'s start)."""
    parts = text.split()
    if len(parts) == 6 and parts[5] == "GMT" and parts[2] in _MONTHS:
        try:
            hour, minute, second = map(int, parts[4].split(":"))
            return datetime(int(parts[3]), _MONTHS.index(parts[2]) + 1, int(parts[1]), hour, minute, second,
                            tzinfo=UTC).timestamp()
        except ValueError:
            pass
    from email.utils import parsedate_to_datetime

    return parsedate_to_datetime(text).timestamp()


def get_object(client: s3.S3Client, endpoint: Endpoint, bucket: str, name: str, stall_timeout_s: float, what: str
               ) -> tuple[bytes, int]:
    """A small object's bytes in one request, and the length the server announced (a cut body is shorter): what a
    snapshot or a manifest is read with, without botocore's import and client in the reader's start."""
    request = http.HttpRequest("GET", endpoint.path(bucket, name), http.HttpHeaders([("Host", endpoint.host(bucket))]))
    headers, body = _call(client, request, "GetObject", stall_timeout_s, what)
    return body, int(headers.values.get("content-length", len(body)))


def _request(method: str, endpoint: Endpoint, bucket: str, name: str, query: str, headers: list[tuple[str, str]],
             body: bytes = b"") -> http.HttpRequest:
    return http.HttpRequest(method, f"{endpoint.path(bucket, name)}?{query}", http.HttpHeaders(
        [("Host", endpoint.host(bucket)), ("Content-Length", str(len(body))), *headers]), io.BytesIO(body))


def create_multipart(client: s3.S3Client, endpoint: Endpoint, bucket: str, name: str, full_object_crc: bool,
                     stall_timeout_s: float, what: str) -> str:
    """Start a multipart upload (whose object keeps a full-object CRC64NVME, if asked); its upload id."""
    headers = [("x-amz-checksum-algorithm", "CRC64NVME"), ("x-amz-checksum-type", "FULL_OBJECT")]
    request = _request("POST", endpoint, bucket, name, "uploads", headers if full_object_crc else [])
    _, body = _call(client, request, "CreateMultipartUpload", stall_timeout_s, what)
    # S3 answers <InitiateMultipartUploadResult>, rclone <InitiateMultipartUpload>: the id is what matters.
    upload_id = _text(ET.fromstring(body), "UploadId")
    if not upload_id:
        raise ErrorReply("NoUploadId", 200, f"the reply to CreateMultipartUpload names no upload: {body[:200]!r}")
    return upload_id


def complete_multipart(client: s3.S3Client, endpoint: Endpoint, bucket: str, name: str, upload_id: str,
                       etags: list[str], crc_b64: str | None, stall_timeout_s: float, what: str) -> None:
    """Join the parts (ETags in order) into the object; with crc_b64, the store checks the whole object's
    CRC64NVME against it."""
    root = ET.Element("CompleteMultipartUpload", xmlns="http://s3.amazonaws.com/doc/2006-03-01/")
    for number, etag in enumerate(etags, start=1):
        part = ET.SubElement(root, "Part")
        ET.SubElement(part, "ETag").text = etag
        ET.SubElement(part, "PartNumber").text = str(number)
    headers = [("Content-Type", "application/xml")]
    if crc_b64 is not None:
        headers += [("x-amz-checksum-crc64nvme", crc_b64), ("x-amz-checksum-type", "FULL_OBJECT")]
    request = _request("POST", endpoint, bucket, name, _query({"uploadId": upload_id}), headers,
                       ET.tostring(root, encoding="utf-8", xml_declaration=True))
    _, body = _call(client, request, "CompleteMultipartUpload", stall_timeout_s, what)
    reply = ET.fromstring(body) if body.strip() else None
    if reply is not None and _local(reply.tag) == "Error":
        raise ErrorReply(_text(reply, "Code") or "InternalError", 200, _text(reply, "Message") or "")


def abort_multipart(client: s3.S3Client, endpoint: Endpoint, bucket: str, name: str, upload_id: str,
                    stall_timeout_s: float, what: str) -> None:
    request = _request("DELETE", endpoint, bucket, name, _query({"uploadId": upload_id}), [])
    _call(client, request, "AbortMultipartUpload", stall_timeout_s, what)
