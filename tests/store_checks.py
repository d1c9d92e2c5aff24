"""The object-store contract and engine round trip, checked the same way against every cloud backend."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from test_storage_file import ODD_KEYS

from infra.storage import ObjectNotFound, ObjectStore
from infra.storage.checksum import Checksum, checksum_bytes, checksum_file
from infra.storage.transfer import FileSpec, RetryPolicy, TransferConfig, download, upload

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
    """Sizes that exercise the engine: empty, tiny, odd keys, nested prefixes, several parts with a tail, an exact
    multiple of the part size, and a file of many parts."""
    sizes = {"empty.bin": 0, "a/b/c/tiny": 1, "big/several parts+tail.bin": 3 * part + 1234, "big/exact.bin": 2 * part,
             "big/many parts.bin": 9 * part + 1}
    sizes |= {key: 100 + len(key) for key in ODD_KEYS}
    return sizes


def write_tree(root: Path, sizes: dict[str, int]) -> dict[str, str]:
    """Random files under root; returns each one's CRC64NVME (tagged)."""
    crcs = {}
    for rel, size in sizes.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = os.urandom(size)
        path.write_bytes(data)
        crcs[rel] = str(checksum_bytes(data))
    return crcs


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root, by its path relative to root."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def check_engine_round_trip(
    store: ObjectStore, tmp_path: Path, config: TransferConfig, add_prefix_marker: Callable[[str], None] | None = None
) -> None:
    """Upload a tree, download it (by listing, and by manifest) verified, then repair a partially written copy.

    add_prefix_marker(name) puts a 0-byte "directory" object (a key ending in '/') the way consoles do: it is no
    file, and the copy must not have it.
    """
    sizes = engine_files(config.part_size)
    write_tree(tmp_path / "src", sizes)
    sent = upload(tmp_path / "src", sorted(sizes), store, config)
    assert sent.engine == config.engine
    uploaded = {f.key: f.crc or "" for f in sent.files}
    for key, crc in uploaded.items():  # the CRC of each file's own bytes (CRC64NVME; CRC32C for GCS's own engine)
        assert Checksum.parse(crc) == checksum_file(tmp_path / "src" / key, Checksum.parse(crc).algorithm), key
    if add_prefix_marker is not None:
        add_prefix_marker("a/b/")
    listed = list(store.list())
    assert {i.key: i.size for i in listed} == sizes

    # As `cp -r` does: keys and sizes from the listing, the checksum from the store (or computed).
    by_listing = download(store, [FileSpec(i.key, i.size) for i in listed], tmp_path / "listed", config)
    assert by_listing.bytes_moved == sum(sizes.values()) and by_listing.engine == config.engine
    assert tree(tmp_path / "listed") == tree(tmp_path / "src")

    specs = [FileSpec(key, sizes[key], crc=uploaded[key]) for key in sorted(sizes)]
    got = download(store, specs, tmp_path / "dest", config)
    assert got.bytes_moved == sum(sizes.values())
    assert tree(tmp_path / "dest") == tree(tmp_path / "src")

    # A partially written local file (a crash mid-copy) is fetched again; the intact ones are skipped.
    broken = tmp_path / "dest" / "big/several parts+tail.bin"
    with open(broken, "r+b") as file:
        file.truncate(config.part_size)
    again = download(store, specs, tmp_path / "dest", config)
    assert [f.key for f in again.files if not f.skipped] == ["big/several parts+tail.bin"]
    assert tree(tmp_path / "dest") == tree(tmp_path / "src")
