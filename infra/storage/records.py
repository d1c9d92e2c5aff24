"""What the transfer engine is told and what it answers: its tuning, the files to move, and their results."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from infra.storage.checksum import SHA256, Checksum
from infra.storage.retry import DEFAULT_RETRY, RetryPolicy

ENGINES = ("native", "python")
MIB = 1 << 20


@dataclass(frozen=True)
class TransferConfig:
    """How the engine moves bytes: one object for every tuning knob (as s3transfer's TransferConfig).

    engine "native" hands whole files to the store's own engine where it has one (awscrt's S3 client,
    google-cloud-storage's transfer_manager): no byte passes through Python. "python" moves ranged parts through
    the ObjectStore interface on the engine's own worker pool (the only path for file://). The defaults were chosen
    by `trainpipe bench transfer` on a 2-core machine against `rclone serve s3` (README: Storage).
    """

    workers: int = 16  # python engine: parts in flight
    files_in_flight: int = 64  # native engine: files handed to the store's engine at once (it bounds its own memory)
    part_size: int = 8 * MIB  # bytes per ranged GET / multipart part
    max_inflight_bytes: int = 256 * MIB  # python engine: part bytes held in memory at once
    retry: RetryPolicy = field(default=DEFAULT_RETRY)
    engine: str = "native"
    multipart_threshold: int = 64 * MIB  # native uploads larger than this go in parts
    throughput_target_gbps: float = 10.0  # native S3: how many connections the CRT opens
    # native S3: at most this many connections per CPU the process may run on. Each connection holds a fresh part
    # buffer the kernel must fault in and zero: the CRT's own count for the target (~30) cost 20% more client CPU per
    # GB than 8 on a 2-core machine (rclone serve s3, 0.6 GB: 1.32 vs 1.10 cpu-s/GB) and moved no byte faster.
    connections_per_cpu: int = 4
    memory_limit: int = 1024 * MIB  # native S3: the CRT's buffer pool (its smallest allowed)
    direct_io: bool = True  # native S3 downloads: O_DIRECT writes (the fsync before rename then costs no writeback)
    # A request that moves no byte for this long is stalled: cancelled and retried. It must cover one part's time at
    # the slowest share of the link a request gets (part_size / (link rate / requests in flight)).
    stall_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("workers", "files_in_flight", "part_size", "max_inflight_bytes", "multipart_threshold",
                     "memory_limit", "connections_per_cpu"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s={self.stall_timeout_s}: must be more than 0 seconds")
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r}: use one of {', '.join(ENGINES)}")

    def but(self, **changes: object) -> TransferConfig:
        """A copy with some knobs changed: DEFAULT_CONFIG.but(workers=4)."""
        return replace(self, **changes)  # type: ignore[arg-type]


DEFAULT_CONFIG = TransferConfig()


@dataclass(frozen=True)
class FileJob:
    """What a store's native engine gets with each file: the tuning, where to count the bytes it moves, the
    event that says the transfer failed elsewhere (stop and raise), and the transfer's workers, for an engine that
    can only wait for a file by blocking a thread."""

    config: TransferConfig
    on_bytes: Callable[[int], None]
    cancel: threading.Event
    background: Callable[[Callable[[], Any]], Future[Any]]


@dataclass(frozen=True)
class FileSpec:
    """One object to move; its expected size and checksum when known (e.g. from a manifest).

    crc is a tagged checksum (infra.storage.checksum: "crc64nvme:<base64>" or "crc32c:<base64>"); sha256 (hex)
    is what manifests written before the CRCs carry. A CRC is checked when both are given. Without a size the
    engine asks the store for it (HEAD), and for the object's checksum and version (etag) with it; with a size
    (a listing's) and no checksum, the bytes are held to the checksum the store returns with them (native engine)
    and a local copy is trusted by the etag the listing gave.
    """

    key: str
    size: int | None = None
    sha256: str | None = None
    crc: str | None = None
    etag: str | None = None

    def __post_init__(self) -> None:
        if self.crc is not None:
            Checksum.parse(self.crc)

    @property
    def expected(self) -> Checksum | None:
        if self.crc is not None:
            return Checksum.parse(self.crc)
        return Checksum(SHA256, self.sha256) if self.sha256 is not None else None


@dataclass(frozen=True)
class FileResult:
    """One file moved (or skipped as already valid), with the checksum it was verified or sent with."""

    key: str
    size: int
    crc: str | None  # tagged; None when a download was verified by a legacy sha256 alone, or had nothing to check
    sha256: str | None
    skipped: bool

    @classmethod
    def of(cls, key: str, size: int, checksum: Checksum | None, skipped: bool) -> FileResult:
        """checksum None: a download that neither the caller nor the store gave a checksum for (its size and the
        store's version were all there was to hold it to)."""
        if checksum is None:
            return cls(key, size, None, None, skipped)
        if checksum.algorithm == SHA256:
            return cls(key, size, None, checksum.value, skipped)
        return cls(key, size, str(checksum), None, skipped)


@dataclass(frozen=True)
class TransferResult:
    files: list[FileResult]
    seconds: float
    engine: str = "python"  # the engine that moved the bytes: "native" or "python"

    @property
    def bytes_moved(self) -> int:
        return sum(f.size for f in self.files if not f.skipped)

    @property
    def bytes_skipped(self) -> int:
        return sum(f.size for f in self.files if f.skipped)

    @property
    def files_skipped(self) -> int:
        return sum(1 for f in self.files if f.skipped)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_moved / 1e6 / self.seconds if self.seconds > 0 else 0.0
