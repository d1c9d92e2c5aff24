"""Object storage behind one interface: open_store(url) picks the backend from the URL's scheme.

Callers never branch on the scheme; a backend joins by adding one line to BACKENDS. Backends are
imported on first use so a node that only reads file:// never needs boto3 or google-cloud-storage.
Storage is a bottom layer: it may import the standard library, its clients (boto3, awscrt, google-cloud-storage)
itself and infra.errors, never compute, the job, the node agent or Prefect (tests/test_layering.py holds it to that).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from infra.storage.base import ChecksumMismatch, ObjectInfo, ObjectNotFound, ObjectStore, StorageError

__all__ = [
    "BACKENDS",
    "ChecksumMismatch",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "StorageError",
    "as_url",
    "open_store",
    "store_url",
]

# scheme -> "module:ClassName" of its ObjectStore, constructed with the full URL.
BACKENDS: dict[str, str] = {
    "file": "infra.storage.local:FileStore",
    "s3": "infra.storage.s3:S3Store",
    "gs": "infra.storage.gcs:GcsStore",
    "az": "infra.storage.azure:AzureBlobStore",
    "http": "infra.storage.http:HttpStore",
}


def _supported() -> str:
    names = [f"{scheme}://" for scheme in BACKENDS]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def as_url(location: str) -> str:
    """A store URL as it is; a plain local path (no '://') as file:// of its absolute path (relative to the cwd)."""
    return location if "://" in location else "file://" + str(Path(location).expanduser().resolve())


def store_url(value: str) -> str:
    """A spec's store location as a URL: a URL whose scheme a backend serves (without a trailing '/'), or a plain
    local path as file:// (as_url); ValueError naming the schemes for any other scheme."""
    if "://" in value:
        scheme = value.split("://", 1)[0]
        # BACKENDS is the list: a backend added there is accepted here with no second list to keep in step.
        if scheme not in BACKENDS:
            raise ValueError(f"unknown scheme '{scheme}://': use one of " + ", ".join(f"{s}://" for s in BACKENDS))
        return value.rstrip("/")
    return as_url(value)


def open_store(url: str) -> ObjectStore:
    """The store rooted at url (a plain local path: see as_url)."""
    url = as_url(url)
    scheme = url.split("://", 1)[0]
    target = BACKENDS.get(scheme)
    if target is None:
        raise StorageError(f"unknown scheme '{scheme}://' in '{url}': use {_supported()}")
    module_name, class_name = target.split(":")
    try:
        backend = getattr(importlib.import_module(module_name), class_name)
    except ImportError as exc:
        raise StorageError(
            f"{url}: the {scheme}:// backend cannot load ({exc}): install its dependencies (pip install trainpipe)"
        ) from exc
    store: ObjectStore = backend(url)
    return store
