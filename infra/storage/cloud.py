"""What the bucket-based backends (s3://, gs://) share: URL parsing, key mapping and error translation."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

from infra.storage.base import StorageError


class _Named(Protocol):
    @property
    def name(self) -> str: ...


NamedT = TypeVar("NamedT", bound=_Named)  # an entry of a bucket listing (a blob), which names its object

# Lowercase letters, digits, '.', '-' and '_' (GCS), 3-63 characters: both S3 and GCS accept this set.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")


class TransientStorageError(StorageError):
    """A failure worth retrying (throttling, a dropped connection, a 5xx): infra.errors.is_transient says yes."""

    transient = True


def split_bucket_url(url: str, scheme: str) -> tuple[str, str]:
    """(bucket, prefix) of scheme://bucket[/prefix]; the prefix has no leading or trailing '/'."""
    head = f"{scheme}://"
    if not url.startswith(head):
        raise StorageError(f"{url}: not a {head} URL: use {head}bucket/prefix")
    bucket, _, prefix = url.removeprefix(head).partition("/")
    if not _BUCKET.match(bucket):
        raise StorageError(
            f"{url}: invalid bucket name {bucket!r}: use {head}bucket/prefix with a 3-63 character lowercase bucket"
        )
    return bucket, prefix.strip("/")


@contextmanager
def translating(errors: tuple[type[BaseException], ...], translate: Callable[[BaseException], StorageError]
                ) -> Iterator[None]:
    """A client library's errors (of the given types) raised inside, as the store's one-line StorageError; errors
    the store raised itself pass through as they are. The library's error is the StorageError's `original`, not its
    cause: a logged traceback would print the cause's message, request URL and signature included."""
    try:
        yield
    except StorageError:
        raise
    except errors as exc:
        error = translate(exc)
        error.original = exc
        raise error from None


def nothing_to_read(url: str, start: int, length: int) -> bool:
    """True for an empty range (no request needed); a negative start or length is the caller's mistake."""
    if start < 0 or length < 0:
        raise StorageError(f"{url}: invalid range start={start} length={length}: both must be >= 0")
    return length == 0


class BucketKeys:
    """Maps store keys (relative to the store's root) to object names in the bucket, and back."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.root = f"{prefix}/" if prefix else ""

    def name(self, key: str) -> str:
        if not key or key.startswith("/") or "\x00" in key:
            raise StorageError(f"{self.url}: invalid key {key!r}: use a non-empty relative '/'-separated key")
        return self.root + key

    def search_prefix(self, prefix: str) -> str:
        return self.root + prefix

    def key(self, name: str) -> str:
        return name[len(self.root):]

    def objects(self, listed: Iterable[NamedT]) -> Iterator[tuple[str, NamedT]]:
        """(key, entry) of each entry of a bucket listing under the root that is an object ("folder" placeholders,
        names ending in '/', are not)."""
        for entry in listed:
            key = self.key(entry.name)
            if key and not key.endswith("/"):
                yield key, entry
