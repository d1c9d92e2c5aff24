"""Checksums written "<algorithm>:<hex>": of local files (staging verifies against the snapshot) and of objects
whose store keeps none (computed once, at plan, and kept in the snapshot)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

from infra.storage.base import ObjectStore
from infra.storage.retry import call_with_retries

_CHUNK = 8 << 20


class _Hasher(Protocol):
    def update(self, data: bytes, /) -> object: ...
    def hexdigest(self) -> str: ...


class _Crc32c:
    def __init__(self) -> None:
        import google_crc32c  # with google-cloud-storage: only GCS objects carry CRC32Cs

        self._checksum = google_crc32c.Checksum()

    def update(self, data: bytes) -> None:
        self._checksum.update(data)

    def hexdigest(self) -> str:
        return bytes(self._checksum.digest()).hex()


def hasher(checksum: str) -> _Hasher:
    algorithm = checksum.partition(":")[0]
    if algorithm == "crc32c":
        return _Crc32c()
    if algorithm in ("md5", "sha256"):
        return hashlib.new(algorithm)
    raise ValueError(f"unknown checksum algorithm in {checksum!r}: expected md5, crc32c or sha256")


def file_matches(path: Path, checksum: str) -> bool:
    """Whether the local file has this checksum (its algorithm is the checksum's own)."""
    digest = hasher(checksum)
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return f"{checksum.partition(':')[0]}:{digest.hexdigest()}" == checksum


def object_sha256(store: ObjectStore, key: str, size: int) -> str:
    """sha256 of an object, read in bounded ranged GETs (each retried when it fails transiently)."""
    return object_checksum(store, key, size, "sha256")


def object_checksum(store: ObjectStore, key: str, size: int, algorithm: str) -> str:
    """"<algorithm>:<hex>" of an object (md5, crc32c, sha256 or another hashlib algorithm), read in bounded ranged
    GETs, each retried when it fails transiently."""
    digest = hasher(f"{algorithm}:") if algorithm in ("md5", "crc32c", "sha256") else hashlib.new(algorithm)
    offset = 0
    while offset < size:
        length = min(_CHUNK, size - offset)
        data = call_with_retries(lambda start=offset, n=length: store.get_range(key, start, n),
                                 f"GET {store.url_for(key)} bytes {offset}-{offset + length - 1}")
        if not data:
            break
        digest.update(data)
        offset += len(data)
    return f"{algorithm}:{digest.hexdigest()}"
