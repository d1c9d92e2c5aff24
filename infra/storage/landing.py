"""Where a downloaded object lands: written into <dest>.part, checked, made durable, then renamed to dest.

Both engines land files the same way, so a destination never holds a file under its final name that was not
verified, and no partial file survives a failure under either name.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from infra.storage.base import StorageError
from infra.storage.checksum import Checksum, check, checksum_file
from infra.storage.files import os_errors_named
from infra.storage.records import FileResult
from infra.storage.verified import VerifiedFiles

PART_SUFFIX = ".part"


class Landing:
    def __init__(
        self, url: str, key: str, dest: Path, size: int, etag: str | None, verified: VerifiedFiles
    ) -> None:
        self.url, self.key, self.dest, self.size, self.etag, self.verified = url, key, dest, size, etag, verified
        self.part_path = dest.with_name(dest.name + PART_SUFFIX)
        self.result: FileResult | None = None

    def prepare(self) -> None:
        """Make the directory the file lands in."""
        with os_errors_named(str(self.part_path), "create"):
            self.dest.parent.mkdir(parents=True, exist_ok=True)

    def create(self) -> int:
        """A preallocated <dest>.part, open for parts written at their offsets (the python engine)."""
        self.prepare()
        with os_errors_named(str(self.part_path), "create"):
            fd = os.open(self.part_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
            os.ftruncate(fd, self.size)
        return fd

    def finish(
        self, expected: Checksum | None, actual: Checksum | None, fd: int = -1, *, direct_io: bool = False
    ) -> FileResult:
        """Check the complete .part, make it durable and give it its final name; fd (when given) is closed.

        actual is the checksum the bytes were verified with while they arrived. When nothing checked them yet the
        file is read once to check it against expected (with O_DIRECT when it was written so); with no expected
        checksum either there is nothing to hold the bytes to, so they are not read again (as no copy tool does):
        the size was checked, and the verified state keeps the object's version (etag) for a rerun to trust.
        """
        with os_errors_named(str(self.part_path), "finish"):
            if fd < 0:
                fd = os.open(self.part_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                # Stamp the file one second in the past: a later write, even within the same clock tick as this
                # download, then always changes mtime, so the verified state can never trust a modified file.
                past_ns = time.time_ns() - 1_000_000_000
                os.utime(fd, ns=(past_ns, past_ns))
                os.fsync(fd)  # the final name must never point at data a crash can lose
                written = os.fstat(fd)
            finally:
                os.close(fd)
            if written.st_size != self.size:
                raise StorageError(
                    f"{self.url}: {written.st_size} bytes arrived where {self.size} were expected: "
                    "the object changed, or the manifest is wrong: fix it and run again"
                )
            if expected is not None:
                if actual is None:
                    actual = checksum_file(self.part_path, expected.algorithm, direct=direct_io)
                check(actual, expected, self.url)
            os.replace(self.part_path, self.dest)
        self.verified.record(self.key, written, None if actual is None else str(actual), self.etag)
        self.result = FileResult.of(self.key, self.size, actual, skipped=False)
        return self.result

    def discard(self) -> None:
        """After a failure: no partial file is left behind, under either name."""
        if self.result is None:
            self.part_path.unlink(missing_ok=True)
