"""The object-store contract and engine round trip, checked the same way against every cloud backend."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from test_storage_file import ODD_KEYS

from infra.storage import ObjectNotFound, ObjectStore
from infra.storage.checksum import CACHE_NAME
from infra.storage.transfer import FileSpec, RetryPolicy, download, upload

FAST_RETRY = RetryPolicy(attempts=4, base_s=0.01, max_s=0.05)


def check_object_contract(store: ObjectStore) -> None:
    """Puts, gets, ranges, listing and deletes of odd keys, an empty object and prefixes that hold nothing."""
    assert list(store.list()) == [] and list(store.list("nothing/")) == []
    for key in ODD_KEYS:
        info = store.put_bytes(key, key.encode() * 3)
        assert info.key == key and info.size == len(key.encode()) * 3
        assert store.get_bytes(key) == key.encode() * 3
        head = store.head(key)
        assert head is not None and head.size == info.size and head.etag
    store.put_bytes("nested/deeper/empty", b"")
    assert store.get_bytes("nested/deeper/empty") == b"" and store.get_range("nested/deeper/empty", 0, 5) == b""
    assert [i.key for i in store.list()] == sorted([*ODD_KEYS, "nested/deeper/empty"])
    assert [i.key for i in store.list("nested/")] == ["nested/deeper/empty"]
    assert [i.key for i in store.list("nest")] == ["nested/deeper/empty"]
    store.put_bytes("range", bytes(range(10)))
    assert store.get_range("range", 2, 3) == bytes([2, 3, 4])
    assert store.get_range("range", 8, 5) == bytes([8, 9])
    assert store.get_range("range", 10, 5) == b""
    assert [i.key for i in store.child("nested").list()] == ["deeper/empty"]
    assert store.head("missing") is None
    with pytest.raises(ObjectNotFound, match="missing: no such object"):
        store.get_bytes("missing")
    store.delete("range")
    store.delete("range")  # idempotent
    assert store.head("range") is None
    store.check_writable()


def engine_files(part: int) -> dict[str, int]:
    """Sizes that exercise the engine: empty, tiny, odd keys, several parts with a tail, an exact multiple."""
    sizes = {"empty.bin": 0, "a/b/c/tiny": 1, "big/several parts+tail.bin": 3 * part + 1234, "big/exact.bin": 2 * part}
    sizes |= {key: 100 + len(key) for key in ODD_KEYS}
    return sizes


def write_tree(root: Path, sizes: dict[str, int]) -> dict[str, str]:
    """Random files under root; returns each one's sha256."""
    digests = {}
    for rel, size in sizes.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = os.urandom(size)
        path.write_bytes(data)
        digests[rel] = hashlib.sha256(data).hexdigest()
    return digests


def check_engine_round_trip(store: ObjectStore, tmp_path: Path, part: int) -> None:
    """Upload a tree in parts, download it verified, then repair a partially written local copy."""
    sizes = engine_files(part)
    digests = write_tree(tmp_path / "src", sizes)
    sent = upload(tmp_path / "src", sorted(sizes), store, workers=4, part_size=part, retry=FAST_RETRY)
    assert {f.key: f.sha256 for f in sent.files} == digests
    assert {i.key: i.size for i in store.list()} == sizes

    specs = [FileSpec(key, sizes[key], digests[key]) for key in sorted(sizes)]
    got = download(store, specs, tmp_path / "dest", workers=4, part_size=part, retry=FAST_RETRY)
    assert got.bytes_moved == sum(sizes.values())
    for rel in sizes:
        assert (tmp_path / "dest" / rel).read_bytes() == (tmp_path / "src" / rel).read_bytes()

    # A partially written local file (a crash mid-copy) is fetched again; the intact ones are skipped.
    broken = tmp_path / "dest" / "big/several parts+tail.bin"
    with open(broken, "r+b") as file:
        file.truncate(part)
    again = download(store, specs, tmp_path / "dest", workers=4, part_size=part, retry=FAST_RETRY)
    assert [f.key for f in again.files if not f.skipped] == ["big/several parts+tail.bin"]
    assert broken.read_bytes() == (tmp_path / "src" / "big/several parts+tail.bin").read_bytes()
    assert sorted(p.name for p in (tmp_path / "dest").iterdir() if p.is_file()) == [CACHE_NAME, "empty.bin"]
