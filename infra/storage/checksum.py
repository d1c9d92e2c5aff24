"""Checksums of objects and local files: CRC64NVME (S3's full-object CRC) and CRC32C (GCS's), tagged with their
algorithm, plus sha256 for manifests written before the CRCs.

A checksum travels as one string, `<algorithm>:<value>`: `crc64nvme:<base64>` and `crc32c:<base64>` hold the
big-endian CRC base64-encoded exactly as S3 (`x-amz-checksum-*`) and GCS (`crc32c`) report it, so a value read
from a store compares with a manifest's as text; `sha256:<hex>` is the legacy whole-file digest. CRCs are computed
by awscrt in C with the GIL released, and CRCs of consecutive parts join into the CRC of the whole (`Crc.extend`):
a file moved in parallel parts is checked without reading it twice.

    from infra.storage.checksum import Checksum, checksum_file
    tag = str(checksum_file(path))                    # "crc64nvme:AbC...=" for a manifest or snapshot
    checksum_file(path, Checksum.parse(tag).algorithm) == Checksum.parse(tag)
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from awscrt import checksums

from infra.storage.base import ChecksumMismatch

CRC64NVME = "crc64nvme"
CRC32C = "crc32c"
SHA256 = "sha256"
DEFAULT_ALGORITHM = CRC64NVME
# What a tagged checksum looks like (for record fields: manifests, snapshots, node records).
TAGGED_CHECKSUM = r"^(crc64nvme:[A-Za-z0-9+/]{11}=|crc32c:[A-Za-z0-9+/]{6}==|sha256:[0-9a-f]{64})$"

_CHUNK = 4 << 20  # large reads: fewer syscalls and CRC calls per byte
# algorithm -> (bytes of the CRC, crc(data, previous), combine(crc_a, crc_b, length_of_b))
_CRCS: dict[str, tuple[int, Callable[[bytes, int], int], Callable[[int, int, int], int]]] = {
    CRC64NVME: (8, checksums.crc64nvme, checksums.combine_crc64nvme),
    CRC32C: (4, checksums.crc32c, checksums.combine_crc32c),
}


@dataclass(frozen=True)
class Checksum:
    """One checksum: its algorithm and its value as the stores write it (base64 for CRCs, hex for sha256)."""

    algorithm: str
    value: str

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.value}"

    @classmethod
    def parse(cls, text: str) -> Checksum:
        """A tagged checksum; a CRC may also be given in hex (as `<algorithm>:<hex>` records write it)."""
        algorithm, _, value = text.partition(":")
        if algorithm in _CRCS:
            width = _CRCS[algorithm][0]
            if len(value) == 2 * width and _is_hex(value):
                return cls(algorithm, base64.b64encode(bytes.fromhex(value)).decode())
            try:
                if len(base64.b64decode(value, validate=True)) == width:
                    return cls(algorithm, value)
            except binascii.Error:
                pass
        elif algorithm == SHA256 and len(value) == 64 and _is_hex(value):
            return cls(algorithm, value)
        raise ValueError(
            f"invalid checksum {text!r}: use crc64nvme:<base64 of 8 bytes>, crc32c:<base64 of 4 bytes> (or either "
            "in hex) or sha256:<64 hex digits>"
        )

    @classmethod
    def of_crc(cls, algorithm: str, crc: int) -> Checksum:
        width = _CRCS[algorithm][0]
        return cls(algorithm, base64.b64encode(crc.to_bytes(width, "big")).decode())

    @property
    def digest(self) -> bytes:
        """The raw bytes: what S3 and the CRT take base64-encoded (`b64`)."""
        return bytes.fromhex(self.value) if self.algorithm == SHA256 else base64.b64decode(self.value)

    @property
    def b64(self) -> str:
        return base64.b64encode(self.digest).decode()

    @property
    def hex(self) -> str:
        return self.digest.hex()


def _is_hex(value: str) -> bool:
    return all(c in "0123456789abcdef" for c in value)


def checksum_or_none(text: str | None) -> Checksum | None:
    return None if text is None else Checksum.parse(text)


class Crc:
    """A running CRC: update() with the bytes that follow, or extend() with the CRC of the bytes that follow."""

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM) -> None:
        if algorithm not in _CRCS:
            raise ValueError(f"{algorithm}: not a CRC this engine computes: use {CRC64NVME} or {CRC32C}")
        self.algorithm = algorithm
        _, self._update, self._combine = _CRCS[algorithm]
        self.value = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self.value = self._update(data, self.value)  # type: ignore[arg-type] - awscrt takes any buffer

    def extend(self, crc: int, length: int) -> None:
        self.value = self._combine(self.value, crc, length)

    def checksum(self) -> Checksum:
        return Checksum.of_crc(self.algorithm, self.value)


class PartCrcs:
    """CRCs of a file's parts, recorded in any order by any thread, joined in offset order at the end."""

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM) -> None:
        self.algorithm = algorithm
        self._parts: dict[int, tuple[int, int]] = {}  # offset -> (length, crc)
        self._lock = threading.Lock()

    def add(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        part = Crc(self.algorithm)
        part.update(data)
        self.add_crc(offset, len(data), part.value)

    def add_crc(self, offset: int, length: int, crc: int) -> None:
        with self._lock:
            self._parts[offset] = (length, crc)

    def total(self, size: int) -> Checksum:
        whole = Crc(self.algorithm)
        position = 0
        with self._lock:
            while position < size:
                if position not in self._parts:
                    raise RuntimeError(f"no part at offset {position} of {size} bytes: every part must be done first")
                length, crc = self._parts[position]
                whole.extend(crc, length)
                position += length
        return whole.checksum()


def checksum_bytes(data: bytes | bytearray | memoryview, algorithm: str = DEFAULT_ALGORITHM) -> Checksum:
    if algorithm == SHA256:
        return Checksum(SHA256, hashlib.sha256(data).hexdigest())
    crc = Crc(algorithm)
    crc.update(data)
    return crc.checksum()


def checksum_of_ranges(chunks: Iterable[bytes], algorithm: str = DEFAULT_ALGORITHM) -> Checksum:
    """The checksum of consecutive chunks (e.g. ranged reads of an object), without holding them all."""
    if algorithm == SHA256:
        digest = hashlib.sha256()
        for chunk in chunks:
            digest.update(chunk)
        return Checksum(SHA256, digest.hexdigest())
    crc = Crc(algorithm)
    for chunk in chunks:
        crc.update(chunk)
    return crc.checksum()


def checksum_file(path: Path, algorithm: str = DEFAULT_ALGORITHM, *, direct: bool = False) -> Checksum:
    """The checksum of a local file, read once in large chunks (the CRC runs without the GIL).

    direct reads with O_DIRECT, for a file just written that way (the native engine's downloads): its bytes are
    not in the page cache, and the disk then writes them straight into the buffer instead of through the cache
    and a copy. Where the filesystem has no O_DIRECT the file is read as any other.
    """
    if algorithm == SHA256:
        return Checksum(SHA256, sha256_file(path))
    crc = Crc(algorithm)
    buffer = _read_buffer()
    fd = _open_for_reading(path, direct)
    try:
        while count := os.readv(fd, [buffer]):
            crc.update(buffer[:count])
    finally:
        os.close(fd)
    return crc.checksum()


_buffers = threading.local()


def _read_buffer() -> memoryview:
    """This thread's read buffer: page-aligned (as O_DIRECT requires) and made once, not faulted in per file."""
    buffer: memoryview | None = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = memoryview(mmap.mmap(-1, _CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
    return buffer


def _open_for_reading(path: Path, direct: bool) -> int:
    flags = os.O_RDONLY | os.O_CLOEXEC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT (tmpfs)
                raise
    return os.open(path, flags)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def check(actual: Checksum, expected: Checksum, url: str) -> None:
    """Raise ChecksumMismatch naming url when the two differ (both of expected's algorithm)."""
    if actual != expected:
        raise ChecksumMismatch(
            f"{url}: {expected.algorithm} {actual.value} does not match the expected {expected.value}: "
            "the object or its manifest is corrupt: re-upload the object or fix the manifest"
        )


class PrefixHasher:
    """sha256 of a file of known size whose parts are written in any order, by any thread.

    Only for manifests that still carry sha256 (a CRC needs no ordering: PartCrcs). Each part reports itself once
    it is on disk; the contiguous prefix is hashed as soon as it grows, reading it back through fd (from the page
    cache: the bytes were just written or read), so no part is held in memory waiting for its predecessors.
    """

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self.size = size
        self._hash = hashlib.sha256()
        self._hashed_to = 0
        self._done: dict[int, int] = {}  # offset -> length of parts written beyond the hashed prefix
        self._hashing = False
        self._lock = threading.Lock()

    def part_done(self, offset: int, length: int, data: bytes | memoryview | None = None) -> bool:
        """Record a written part; True exactly once: for the call after which the whole file is hashed.

        data, the part's bytes, lets the part that extends the prefix be hashed without reading it back.
        """
        with self._lock:
            direct = data is not None and not self._hashing and offset == self._hashed_to
            if not direct:
                self._done[offset] = length
                if self._hashing:
                    return False  # the thread hashing now will pick this part up
            self._hashing = True
        if direct:
            self._hash.update(data)  # type: ignore[arg-type] - direct implies data is not None
            with self._lock:
                self._hashed_to = offset + length
                if self._hashed_to == self.size:
                    self._hashing = False
                    return True
        while True:
            with self._lock:
                start = end = self._hashed_to
                while end in self._done:
                    end += self._done.pop(end)
                if end == start:
                    self._hashing = False
                    return False
            self._hash_range(start, end)
            with self._lock:
                self._hashed_to = end
                if end == self.size:
                    self._hashing = False
                    return True

    def _hash_range(self, start: int, end: int) -> None:
        position = start
        while position < end:
            chunk = os.pread(self._fd, min(_CHUNK, end - position), position)
            if not chunk:
                raise OSError(f"file shrank while hashing: expected {end} bytes, found {position}")
            self._hash.update(chunk)
            position += len(chunk)

    def hexdigest(self) -> str:
        if self._hashed_to != self.size:
            raise RuntimeError(f"hashed {self._hashed_to} of {self.size} bytes: every part must be done first")
        return self._hash.hexdigest()
