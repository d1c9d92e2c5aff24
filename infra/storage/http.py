"""The http:// object store, read-only: any HTTP server that serves a directory by path with Range requests (a peer
node's `rclone serve http`). A peer is one more endpoint the transfer engine speaks to: the engine's ranged parts
(parts.py) read it as they read any store, and every byte is checked against the caller's checksum as a store's is.

Credentials are HTTP basic auth from the environment (TRAINPIPE_PEER_USER, TRAINPIPE_PEER_PASS), never the URL: a
URL travels in command lines and logs. Connection failures and 5xx are transient (the engine retries them); 401/403
name the credentials; 404 is an object that is not there (yet).
"""

from __future__ import annotations

import base64
import email.utils
import http.client
import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit

from infra.storage.base import ObjectInfo, ObjectNotFound, ObjectStore, StorageError
from infra.storage.cloud import TransientStorageError, nothing_to_read
from infra.storage.files import write_all, write_atomically

USER_ENV = "TRAINPIPE_PEER_USER"
PASS_ENV = "TRAINPIPE_PEER_PASS"
TIMEOUT_S = 30.0


class HttpStore(ObjectStore):
    scheme = "http"

    def __init__(self, url: str, timeout_s: float = TIMEOUT_S) -> None:
        super().__init__(url)
        parts = urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname:
            raise StorageError(f"{url}: not an http:// URL: use http://host:port/prefix")
        if parts.username or parts.password:
            raise StorageError(f"{url}: credentials in the URL: set {USER_ENV} and {PASS_ENV} instead")
        self._host, self._port = parts.hostname, parts.port or 80
        self._prefix = parts.path.strip("/")
        self._timeout_s = timeout_s

    def with_stall_timeout(self, seconds: float) -> HttpStore:
        return HttpStore(self.url, timeout_s=seconds)

    def child(self, prefix: str) -> HttpStore:
        return HttpStore(self.url_for(prefix.strip("/")), self._timeout_s)

    def _request(self, method: str, key: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str],
                                                                                            bytes]:
        path = "/" + quote("/".join(part for part in (self._prefix, key) if part))
        sent = dict(headers or {})
        user, password = os.environ.get(USER_ENV), os.environ.get(PASS_ENV)
        if user is not None and password is not None:
            sent["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        try:
            connection.request(method, path, headers=sent)
            reply = connection.getresponse()
            body = reply.read()
        except (OSError, http.client.HTTPException) as exc:
            raise TransientStorageError(f"{method} {self.url_for(key)}: {type(exc).__name__}: {exc}") from exc
        finally:
            connection.close()
        if reply.status in (401, 403):
            raise StorageError(f"{method} {self.url_for(key)}: {reply.status} {reply.reason}: the server refused the "
                               f"credentials in {USER_ENV}/{PASS_ENV}")
        if reply.status >= 500:
            raise TransientStorageError(f"{method} {self.url_for(key)}: {reply.status} {reply.reason}")
        return reply.status, {name.lower(): value for name, value in reply.getheaders()}, body

    def _not_found(self, key: str) -> ObjectNotFound:
        return ObjectNotFound(f"{self.url_for(key)}: not found")

    def head(self, key: str) -> ObjectInfo | None:
        status, headers, _ = self._request("HEAD", key)
        if status == 404:
            return None
        if status != 200:
            raise StorageError(f"HEAD {self.url_for(key)}: unexpected status {status}")
        modified = headers.get("last-modified")
        return ObjectInfo(key, int(headers["content-length"]), headers.get("etag"),
                          email.utils.parsedate_to_datetime(modified).timestamp() if modified else None)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if nothing_to_read(self.url_for(key), start, length):
            return b""
        status, _, body = self._request("GET", key, {"Range": f"bytes={start}-{start + length - 1}"})
        if status == 404:
            raise self._not_found(key)
        if status == 416:  # the range starts at or past the end
            return b""
        if status not in (200, 206):
            raise StorageError(f"GET {self.url_for(key)}: unexpected status {status}")
        return body if status == 206 else body[start:start + length]

    def get_bytes(self, key: str) -> bytes:
        status, _, body = self._request("GET", key)
        if status == 404:
            raise self._not_found(key)
        if status != 200:
            raise StorageError(f"GET {self.url_for(key)}: unexpected status {status}")
        return body

    def get_file(self, key: str, path: Path) -> ObjectInfo:
        data = self.get_bytes(key)
        write_atomically(path, lambda fd: write_all(fd, data))
        return ObjectInfo(key, len(data))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        raise StorageError(f"{self.url}: an http:// store cannot be listed: name the keys to read")

    def _read_only(self, key: str) -> StorageError:
        return StorageError(f"{self.url_for(key)}: an http:// store is read-only: write to an s3://, gs:// or "
                            "file:// store")

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        raise self._read_only(key)

    def put_file(self, path: Path, key: str) -> ObjectInfo:
        raise self._read_only(key)

    def delete(self, key: str) -> None:
        raise self._read_only(key)

