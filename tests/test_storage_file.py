"""FileStore and open_store against real directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infra.storage import ObjectNotFound, ObjectStore, StorageError, open_store
from infra.storage.files import TEMP_SUFFIX, write_all, write_atomically
from infra.storage.local import FileStore

ODD_KEYS = ["with space/a b.bin", "ünï/cödé-✓.txt", "plus+sign/a+b=c.dat"]


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    # The root does not exist yet: the store must create it on the first put.
    return FileStore(f"file://{tmp_path}/root")


def keys(store: ObjectStore, prefix: str = "") -> list[str]:
    return [info.key for info in store.list(prefix)]


def test_missing_root_reads_as_empty(store: FileStore) -> None:
    assert keys(store) == []
    assert store.head("nothing") is None
    assert not store.root.exists()
    with pytest.raises(ObjectNotFound, match=f"{store.url}/nothing: no such object"):
        store.get_bytes("nothing")
    with pytest.raises(ObjectNotFound):
        store.get_range("nothing", 0, 1)


@pytest.mark.parametrize("key", ODD_KEYS)
def test_odd_keys_round_trip(store: FileStore, key: str) -> None:
    info = store.put_bytes(key, key.encode() * 3)
    assert info.key == key and info.size == len(key.encode()) * 3
    assert store.get_bytes(key) == key.encode() * 3
    assert keys(store) == [key]
    assert store.head(key) == info


def test_list_is_recursive_sorted_and_prefix_filtered(store: FileStore) -> None:
    for key in ["b/2", "a/x/1", "a-c", "a/y", "shard-1", "shards/1", "shx"]:
        store.put_bytes(key, b"x")
    # '-' sorts before '/', so plain key order (not directory order) is what S3 returns.
    assert keys(store) == ["a-c", "a/x/1", "a/y", "b/2", "shard-1", "shards/1", "shx"]
    assert keys(store, "a/") == ["a/x/1", "a/y"]
    assert keys(store, "a") == ["a-c", "a/x/1", "a/y"]
    assert keys(store, "shard") == ["shard-1", "shards/1"]
    assert keys(store, "a/x/") == ["a/x/1"]
    assert keys(store, "nope/") == []


def test_get_range(store: FileStore) -> None:
    store.put_bytes("k", bytes(range(10)))
    assert store.get_range("k", 2, 3) == bytes([2, 3, 4])
    assert store.get_range("k", 8, 5) == bytes([8, 9])
    assert store.get_range("k", 10, 5) == b""
    assert store.get_range("k", 50, 5) == b""
    assert store.get_range("k", 0, 0) == b""
    with pytest.raises(StorageError, match="invalid range"):
        store.get_range("k", -1, 2)


def test_empty_object(store: FileStore, tmp_path: Path) -> None:
    info = store.put_bytes("empty", b"")
    assert info.size == 0 and store.head("empty") == info
    assert store.get_bytes("empty") == b""
    assert store.get_range("empty", 0, 10) == b""
    local = tmp_path / "out" / "empty"
    assert store.get_file("empty", local).size == 0
    assert local.read_bytes() == b""


def test_overwrite_changes_etag(store: FileStore) -> None:
    first = store.put_bytes("k", b"one")
    second = store.put_bytes("k", b"two!")
    assert store.get_bytes("k") == b"two!"
    assert first.etag != second.etag
    assert store.head("k") == second


def test_files_round_trip(store: FileStore, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    info = store.put_file(src, "deep/er/obj.bin")
    assert info.size == 300_000
    dest = tmp_path / "dl" / "sub" / "obj.bin"
    assert store.get_file("deep/er/obj.bin", dest) == store.head("deep/er/obj.bin")
    assert dest.read_bytes() == src.read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == ["obj.bin"]  # no temp file left beside it
    with pytest.raises(ObjectNotFound, match="missing"):
        store.get_file("missing", tmp_path / "never")
    assert not (tmp_path / "never").exists()
    with pytest.raises(StorageError, match=f"{tmp_path}/absent: no such local file"):
        store.put_file(tmp_path / "absent", "k")


def test_prefix_is_not_an_object(store: FileStore) -> None:
    store.put_bytes("dir/obj", b"x")
    assert store.head("dir") is None
    with pytest.raises(ObjectNotFound, match="prefix"):
        store.get_bytes("dir")
    store.delete("dir")  # a prefix is no object: nothing to delete
    assert keys(store) == ["dir/obj"]


def test_delete_is_idempotent_and_prunes_empty_directories(store: FileStore) -> None:
    store.put_bytes("a/b/c", b"1")
    store.put_bytes("a/d", b"2")
    store.delete("a/b/c")
    store.delete("a/b/c")
    store.delete("never/was")
    assert keys(store) == ["a/d"]
    assert not (store.root / "a" / "b").exists()
    assert store.delete_prefix("a/") == 1
    assert keys(store) == [] and store.root.is_dir() and not any(store.root.iterdir())


def test_child_is_rooted_below(store: FileStore) -> None:
    store.put_bytes("run-1/step-5/x", b"x")
    child = store.child("run-1/")
    assert child.url == f"{store.url}/run-1"
    assert keys(child) == ["step-5/x"]
    assert child.get_bytes("step-5/x") == b"x"
    with pytest.raises(StorageError, match="invalid key"):
        store.child("../up")


def test_put_is_atomic(store: FileStore) -> None:
    store.put_bytes("k", b"old")
    seen: list[tuple[list[str], bytes]] = []

    def fill_halfway_then_look(fd: int) -> None:
        write_all(fd, b"new-half-")
        seen.append((keys(store), store.get_bytes("k")))
        write_all(fd, b"and-the-rest")

    write_atomically(store.root / "k", fill_halfway_then_look)
    assert seen == [(["k"], b"old")]  # mid-write: the temp file is invisible, the old object intact
    assert store.get_bytes("k") == b"new-half-and-the-rest"
    assert [p.name for p in store.root.iterdir()] == ["k"]


def test_failed_write_leaves_old_object_and_no_temp(store: FileStore) -> None:
    store.put_bytes("k", b"old")

    def fail(fd: int) -> None:
        write_all(fd, b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_atomically(store.root / "k", fail)
    assert store.get_bytes("k") == b"old"
    assert not any(p.name.endswith(TEMP_SUFFIX) for p in store.root.iterdir())


@pytest.mark.parametrize("bad", ["../escape", "/abs/key", "a/../../x", "a//b", "./a", "", f"x{TEMP_SUFFIX}"])
def test_keys_that_escape_are_rejected(store: FileStore, bad: str) -> None:
    with pytest.raises(StorageError, match="invalid key"):
        store.put_bytes(bad, b"x")
    with pytest.raises(StorageError, match="invalid key"):
        store.head(bad)
    assert not (store.root.parent / "escape").exists()


def test_os_errors_become_one_line_storage_errors(store: FileStore) -> None:
    store.put_bytes("a", b"x")
    with pytest.raises(
        StorageError, match=r"^file://.*/root/a/b: cannot write \(.*\): a parent of this key is an object"
    ):
        store.put_bytes("a/b", b"y")


def test_unwritable_root_names_url_and_fix() -> None:
    # /proc refuses new entries even to root, so this runs the same as root (CI) and as a user.
    store = FileStore("file:///proc/trainpipe-unwritable")
    with pytest.raises(StorageError, match=r"^file:///proc/trainpipe-unwritable/k: cannot write \(.+\): check"):
        store.put_bytes("k", b"x")
    with pytest.raises(StorageError, match="trainpipe-write-probe: cannot write"):
        store.check_writable()


def test_check_writable_creates_root_and_cleans_up(store: FileStore) -> None:
    store.check_writable()
    assert store.root.is_dir() and keys(store) == []


def test_open_store_by_url_and_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    by_url = open_store(f"file://{tmp_path}/data/")
    assert isinstance(by_url, FileStore) and by_url.url == f"file://{tmp_path}/data"
    monkeypatch.chdir(tmp_path)
    by_path = open_store("data")
    assert isinstance(by_path, FileStore) and by_path.url == f"file://{tmp_path}/data"
    by_url.put_bytes("k", b"v")
    assert by_path.get_bytes("k") == b"v"


def test_open_store_rejects_unknown_scheme_and_relative_file_url() -> None:
    with pytest.raises(StorageError, match=r"^unknown scheme 'ftp://' in 'ftp://x/y': use file://"):
        open_store("ftp://x/y")
    with pytest.raises(StorageError, match="needs an absolute path"):
        open_store("file://relative/dir")
