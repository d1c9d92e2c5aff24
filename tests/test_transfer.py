"""The transfer engine against real file:// stores and real files, with faults injected into the store."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest

from infra.storage import ChecksumMismatch, ObjectInfo, ObjectNotFound, StorageError
from infra.storage.checksum import (
    CRC32C,
    Checksum,
    PartCrcs,
    PrefixHasher,
    checksum_bytes,
    checksum_file,
    checksum_of_ranges,
)
from infra.storage.local import FileStore
from infra.storage.transfer import (
    FileResult,
    FileSpec,
    MultipartUploads,
    Progress,
    RetryPolicy,
    TransferConfig,
    download,
    is_transient,
    upload,
)
from infra.storage.verified import VerifiedFiles

PART = 64 << 10
FAST_RETRY = RetryPolicy(attempts=3, base_s=0.01, max_s=0.05)
CONFIG = TransferConfig(workers=2, part_size=PART, retry=FAST_RETRY)

# Many small files, an empty one, one of several parts with a short tail, and one of exactly four parts.
SIZES = {f"small/{i:02d}.bin": 100 + 37 * i for i in range(24)}
SIZES |= {"empty.bin": 0, "big/several parts.bin": 3 * PART + 1234, "big/exact+4.bin": 4 * PART, "ünï/tiny": 1}


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def crc_of(data: bytes) -> str:
    return str(checksum_bytes(data))


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    store = FileStore(f"file://{tmp_path}/store")
    for key, size in SIZES.items():
        store.put_bytes(key, os.urandom(size))
    return store


def manifest(store: FileStore) -> list[FileSpec]:
    return [FileSpec(info.key, info.size, crc=crc_of(store.get_bytes(info.key))) for info in store.list()]


def fetch(store: FileStore, specs: list[FileSpec], dest: Path, **kwargs: object) -> list[FileResult]:
    return download(store, specs, dest, CONFIG, **kwargs).files  # type: ignore[arg-type]


def state_file(dest: Path) -> Path:
    """Where the engine remembers what it verified under dest: outside dest (the test session's cache dir)."""
    return VerifiedFiles(dest).path


def local_files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def assert_no_transfer_threads() -> None:
    assert not [t.name for t in threading.enumerate() if t.name.startswith("trainpipe-transfer")]


# -- download ---------------------------------------------------------------------------------------


def test_download_moves_everything_verified(store: FileStore, tmp_path: Path) -> None:
    specs = manifest(store)
    seen: list[Progress] = []
    result = download(store, specs, tmp_path / "dest", CONFIG, progress=seen.append)
    assert [f.key for f in result.files] == [s.key for s in specs]
    assert {f.key: f.crc for f in result.files} == {s.key: s.crc for s in specs}
    assert result.bytes_moved == sum(SIZES.values()) and result.files_skipped == 0 and result.engine == "python"
    for spec in specs:
        assert (tmp_path / "dest" / spec.key).read_bytes() == store.get_bytes(spec.key)
    # Exactly the objects: no .part left, and what was verified is remembered outside the destination.
    assert local_files(tmp_path / "dest") == sorted(SIZES)
    assert state_file(tmp_path / "dest").is_file() and not state_file(tmp_path / "dest").is_relative_to(tmp_path)
    final = seen[-1]
    assert (
        (final.bytes_done, final.files_done)
        == (final.bytes_total, final.files_total)
        == (sum(SIZES.values()), len(SIZES))
    )
    assert final.eta_s == 0.0 and final.mb_per_s > 0
    assert_no_transfer_threads()


def test_sizes_and_checksums_unknown_use_head(store: FileStore, tmp_path: Path) -> None:
    specs = [FileSpec(key) for key in SIZES]
    first = fetch(store, specs, tmp_path / "dest")
    assert {f.key: f.size for f in first} == SIZES
    assert {f.key: f.crc for f in first} == {s.key: s.crc for s in manifest(store)}
    # The etag proves the local copies current: nothing moves again.
    again = download(store, specs, tmp_path / "dest", CONFIG)
    assert again.bytes_moved == 0 and again.files_skipped == len(SIZES)
    # A changed object (new etag) is fetched again even with no checksum to compare.
    store.put_bytes("ünï/tiny", b"Z")
    third = download(store, specs, tmp_path / "dest", CONFIG)
    assert [f.key for f in third.files if not f.skipped] == ["ünï/tiny"]
    assert (tmp_path / "dest" / "ünï/tiny").read_bytes() == b"Z"


def test_second_run_skips_valid_files(store: FileStore, tmp_path: Path) -> None:
    specs = manifest(store)
    fetch(store, specs, tmp_path / "dest")
    again = download(store, specs, tmp_path / "dest", CONFIG)
    assert again.bytes_moved == 0 and again.files_skipped == len(SIZES)
    assert again.bytes_skipped == sum(SIZES.values())
    assert {f.key: f.crc for f in again.files} == {s.key: s.crc for s in specs}
    # Without the verified state the files are read and checked instead, and still not fetched.
    state_file(tmp_path / "dest").unlink()
    assert download(store, specs, tmp_path / "dest", CONFIG).bytes_moved == 0


def test_state_dir_is_the_callers_choice(store: FileStore, tmp_path: Path) -> None:
    specs = manifest(store)
    fetch(store, specs, tmp_path / "dest", state_dir=tmp_path / "state")
    assert [p.name for p in (tmp_path / "state").iterdir()] == [state_file(tmp_path / "dest").name]
    assert not state_file(tmp_path / "dest").exists()
    assert download(store, specs, tmp_path / "dest", CONFIG, state_dir=tmp_path / "state").files_skipped == len(SIZES)


def test_legacy_sha256_manifest_still_verifies(store: FileStore, tmp_path: Path) -> None:
    legacy = [FileSpec(info.key, info.size, sha256_of(store.get_bytes(info.key))) for info in store.list()]
    result = fetch(store, legacy, tmp_path / "dest")
    assert {f.key: f.sha256 for f in result} == {s.key: s.sha256 for s in legacy}
    assert download(store, legacy, tmp_path / "dest", CONFIG).files_skipped == len(SIZES)
    key = "big/several parts.bin"
    with pytest.raises(ChecksumMismatch, match=rf"{key}: sha256 \w+ does not match the expected 0+:"):
        fetch(store, [FileSpec(key, SIZES[key], "0" * 64)], tmp_path / "other")


def test_unreadable_cache_is_ignored_with_a_warning(
    store: FileStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    specs = manifest(store)
    fetch(store, specs, tmp_path / "dest")
    state_file(tmp_path / "dest").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="infra.storage.verified"):
        again = download(store, specs, tmp_path / "dest", CONFIG)
    assert again.files_skipped == len(SIZES)
    assert f"{state_file(tmp_path / 'dest')} is unreadable" in caplog.text


def test_corrupted_local_file_is_fetched_again(store: FileStore, tmp_path: Path) -> None:
    specs = manifest(store)
    fetch(store, specs, tmp_path / "dest")
    victim = tmp_path / "dest" / "big/several parts.bin"
    with open(victim, "r+b") as file:  # same size, one byte flipped, right after the download
        file.seek(PART + 7)
        byte = file.read(1)
        file.seek(PART + 7)
        file.write(bytes([byte[0] ^ 0xFF]))
    again = download(store, specs, tmp_path / "dest", CONFIG)
    assert [f.key for f in again.files if not f.skipped] == ["big/several parts.bin"]
    assert victim.read_bytes() == store.get_bytes("big/several parts.bin")


def test_wrong_checksum_raises_and_leaves_no_file(store: FileStore, tmp_path: Path) -> None:
    key = "big/several parts.bin"
    wrong = Checksum.of_crc("crc64nvme", 12345)
    specs = [FileSpec(key, SIZES[key], crc=str(wrong))]
    with pytest.raises(ChecksumMismatch) as caught:
        fetch(store, specs, tmp_path / "dest")
    message = str(caught.value)
    assert store.url_for(key) in message and wrong.value in message
    assert Checksum.parse(crc_of(store.get_bytes(key))).value in message and "\n" not in message
    assert local_files(tmp_path / "dest") == []
    assert_no_transfer_threads()


def test_wrong_expected_size_is_reported(store: FileStore, tmp_path: Path) -> None:
    key = "big/exact+4.bin"
    sha = crc_of(store.get_bytes(key))
    # With size and checksum known nothing asks the store for the size: the reads themselves notice.
    with pytest.raises(
        StorageError, match=r"more bytes at offset \d+ where \d+ were expected \(object of 262143 bytes\)"
    ):
        fetch(store, [FileSpec(key, SIZES[key] - 1, crc=sha)], tmp_path / "a")
    with pytest.raises(StorageError, match=r"0 bytes at offset 262144 where 1 were expected \(object of 262145 b"):
        fetch(store, [FileSpec(key, SIZES[key] + 1, None)], tmp_path / "b")
    with pytest.raises(StorageError, match=r"bytes at offset .* where \d+ were expected"):
        fetch(store, [FileSpec(key, SIZES[key] + 1, crc=sha)], tmp_path / "c")
    assert local_files(tmp_path / "a") == local_files(tmp_path / "c") == []


def test_missing_object_and_unsafe_key(store: FileStore, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound, match=f"{store.url}/nope: no such object"):
        fetch(store, [FileSpec("nope")], tmp_path / "dest")
    with pytest.raises(StorageError, match=r"unsafe key '\.\./outside'"):
        fetch(store, [FileSpec("../outside", 1, None)], tmp_path / "dest")
    with pytest.raises(StorageError, match="listed twice"):
        fetch(store, [FileSpec("empty.bin"), FileSpec("empty.bin")], tmp_path / "dest")
    assert not (tmp_path / "outside").exists()


class FlakyStore(FileStore):
    """A real FileStore whose get_range fails once, transiently, for the chosen part offsets of each key."""

    def __init__(self, url: str, flaky_offsets: set[int]) -> None:
        super().__init__(url)
        self.flaky_offsets = flaky_offsets
        self.failed: set[tuple[str, int]] = set()
        self.calls: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self._lock:
            self.calls.append((key, start))
            first_time = (key, start) not in self.failed
            if start in self.flaky_offsets and first_time:
                self.failed.add((key, start))
                raise ConnectionResetError(f"connection reset while reading {key}")
        return super().get_range(key, start, length)


def test_transient_failures_are_retried_per_part(
    store: FileStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    flaky = FlakyStore(store.url, flaky_offsets={PART, 3 * PART})
    with caplog.at_level(logging.WARNING, logger="infra.storage.retry"):
        result = fetch(flaky, manifest(store), tmp_path / "dest")
    assert len(result) == len(SIZES)
    # Exactly the failed parts were asked twice; no whole file was restarted.
    retried = sorted(call for call in set(flaky.calls) if flaky.calls.count(call) > 1)
    assert retried == sorted(flaky.failed)
    assert flaky.failed == {("big/several parts.bin", PART), ("big/several parts.bin", 3 * PART)} | {
        ("big/exact+4.bin", PART),
        ("big/exact+4.bin", 3 * PART),
    }
    retry_logs = [r.getMessage() for r in caplog.records if "retry 1/2" in r.getMessage()]
    assert len(retry_logs) == 4 and all("ConnectionResetError" in line for line in retry_logs)
    assert (tmp_path / "dest" / "big/exact+4.bin").read_bytes() == store.get_bytes("big/exact+4.bin")


class BrokenStore(FileStore):
    """A real FileStore where one key always fails: permanently, or transiently forever."""

    def __init__(self, url: str, key: str, error: Exception) -> None:
        super().__init__(url)
        self.key, self.error = key, error

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if key == self.key and start > 0:
            raise self.error
        return super().get_range(key, start, length)


def test_permanent_error_surfaces_and_cleans_up(store: FileStore, tmp_path: Path) -> None:
    broken = BrokenStore(store.url, "big/several parts.bin", PermissionError("access denied by policy"))
    with pytest.raises(PermissionError, match="access denied by policy"):
        fetch(broken, manifest(store), tmp_path / "dest")
    leftovers = local_files(tmp_path / "dest")
    assert not [name for name in leftovers if name.endswith(".part") or name.startswith("big/several")]
    assert_no_transfer_threads()
    # What did finish is remembered: the rerun fetches only the rest.
    rerun = download(store, manifest(store), tmp_path / "dest", CONFIG)
    assert rerun.files_skipped == len(leftovers)


def test_transient_error_that_never_ends_gives_up(store: FileStore, tmp_path: Path) -> None:
    broken = BrokenStore(store.url, "big/exact+4.bin", TimeoutError("read timed out"))
    with pytest.raises(
        StorageError, match=r"exact\+4\.bin bytes \d+-\d+: failed 3 times, last with TimeoutError: read timed out"
    ):
        fetch(broken, manifest(store), tmp_path / "dest")
    assert_no_transfer_threads()


class ThrottledStore(FileStore):
    """A real FileStore that records how many bytes are being read at once."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.in_flight = self.peak = 0
        self._lock = threading.Lock()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self._lock:
            self.in_flight += length
            self.peak = max(self.peak, self.in_flight)
        try:
            time.sleep(0.005)
            return super().get_range(key, start, length)
        finally:
            with self._lock:
                self.in_flight -= length


def test_in_flight_bytes_are_bounded(store: FileStore, tmp_path: Path) -> None:
    throttled = ThrottledStore(store.url)
    keys = ["big/several parts.bin", "big/exact+4.bin"]
    specs = [s for s in manifest(store) if s.key in keys]
    result = download(throttled, specs, tmp_path / "dest", CONFIG.but(workers=4, max_inflight_bytes=2 * PART + 1))
    assert result.bytes_moved == sum(SIZES[key] for key in keys)
    # Two parts at most (the last part of a file asks one extra byte to detect a longer object).
    assert PART < throttled.peak <= 2 * PART + 2


def test_progress_callback_errors_reach_the_caller(store: FileStore, tmp_path: Path) -> None:
    def refuse(progress: Progress) -> None:
        raise RuntimeError("dashboard is down")

    with pytest.raises(RuntimeError, match="dashboard is down"):
        # The final report is the one guaranteed call; it runs after every file is in place.
        fetch(store, manifest(store), tmp_path / "dest", progress=refuse)
    assert_no_transfer_threads()


# -- upload -----------------------------------------------------------------------------------------


@pytest.fixture
def src(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    for rel, size in SIZES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(os.urandom(size))
    return root


def test_upload_to_file_store(src: Path, tmp_path: Path) -> None:
    dest = FileStore(f"file://{tmp_path}/up")
    seen: list[Progress] = []
    result = upload(src, list(SIZES), dest, CONFIG, progress=seen.append)
    assert {f.key: f.crc for f in result.files} == {rel: str(checksum_file(src / rel)) for rel in SIZES}
    assert {info.key: info.size for info in dest.list()} == SIZES
    for rel in SIZES:
        assert dest.get_bytes(rel) == (src / rel).read_bytes()
    assert result.bytes_moved == sum(SIZES.values()) and seen[-1].bytes_done == seen[-1].bytes_total
    with pytest.raises(StorageError, match=f"{src}/absent: no such local file"):
        upload(src, ["absent"], dest)


class MultipartDirStore(FileStore):
    """A real FileStore that also takes multipart uploads: parts land in a side directory, finish joins them."""

    min_part_size = 1

    def __init__(self, url: str, parts_dir: Path, fail_part: int | None = None) -> None:
        super().__init__(url)
        self.parts_dir, self.fail_part = parts_dir, fail_part

    def start_multipart(self, key: str) -> str:
        upload_id = uuid.uuid4().hex
        (self.parts_dir / upload_id).mkdir(parents=True)
        return upload_id

    def put_part(self, key: str, upload_id: str, number: int, offset: int, data: bytes) -> str:
        if number == self.fail_part:
            raise PermissionError(f"part {number} of {key} refused")
        (self.parts_dir / upload_id / f"{number:05d}-{offset}").write_bytes(data)
        return hashlib.md5(data).hexdigest()

    def finish_multipart(self, key: str, upload_id: str, tags: list[str]) -> ObjectInfo:
        parts = [p.read_bytes() for p in sorted((self.parts_dir / upload_id).iterdir())]
        if tags != [hashlib.md5(part).hexdigest() for part in parts]:
            raise StorageError(f"{self.url_for(key)}: part tags do not match the uploaded parts")
        info = self.put_bytes(key, b"".join(parts))
        shutil.rmtree(self.parts_dir / upload_id)
        return info

    def abort_multipart(self, key: str, upload_id: str) -> None:
        if (self.parts_dir / upload_id).exists():
            shutil.rmtree(self.parts_dir / upload_id)


def test_multipart_upload(src: Path, tmp_path: Path) -> None:
    dest = MultipartDirStore(f"file://{tmp_path}/up", tmp_path / "parts")
    assert isinstance(dest, MultipartUploads)
    result = upload(src, list(SIZES), dest, CONFIG)
    assert {f.key: f.crc for f in result.files} == {rel: str(checksum_file(src / rel)) for rel in SIZES}
    for rel in SIZES:
        assert dest.get_bytes(rel) == (src / rel).read_bytes()
    assert not any((tmp_path / "parts").iterdir())


def test_failed_multipart_upload_is_aborted(src: Path, tmp_path: Path) -> None:
    dest = MultipartDirStore(f"file://{tmp_path}/up", tmp_path / "parts", fail_part=3)
    with pytest.raises(PermissionError, match=r"part 3 of big/.* refused"):
        upload(src, ["big/several parts.bin", "big/exact+4.bin"], dest, CONFIG)
    assert not any((tmp_path / "parts").iterdir())
    assert [info.key for info in dest.list("big/")] == []
    assert_no_transfer_threads()


# -- helpers ----------------------------------------------------------------------------------------


def test_is_transient() -> None:
    class Throttled(Exception):
        transient = True

    assert is_transient(ConnectionResetError()) and is_transient(TimeoutError()) and is_transient(Throttled())
    assert not is_transient(PermissionError()) and not is_transient(ValueError())
    assert not is_transient(ObjectNotFound("x"))


def test_argument_errors(store: FileStore, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="workers=0: must be at least 1"):
        TransferConfig(workers=0)
    with pytest.raises(ValueError, match="connections_per_cpu=0: must be at least 1"):
        TransferConfig(connections_per_cpu=0)
    with pytest.raises(ValueError, match="engine='rust': use one of native, python"):
        CONFIG.but(engine="rust")
    with pytest.raises(ValueError, match=r"^invalid checksum 'crc64nvme:xyz': use crc64nvme:<base64 of 8 bytes>"):
        FileSpec("k", 1, crc="crc64nvme:xyz")
    assert download(store, [], tmp_path / "empty").files == []
    assert local_files(tmp_path / "empty") == []


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 1, 0, 2], [1, 0, 3, 2]], ids=["in-order", "reversed", "pairs"])
@pytest.mark.parametrize("with_data", [True, False], ids=["from-buffer", "read-back"])
def test_prefix_hasher_gives_the_file_sha256_whatever_the_order_of_parts(
    tmp_path: Path, order: list[int], with_data: bool
) -> None:
    content = os.urandom(4 * 1000 + 17)
    bounds = [(0, 1000), (1000, 1000), (2000, 1000), (3000, 1017)]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, len(content))
        hasher = PrefixHasher(fd, len(content))
        finished = []
        for index in order:
            offset, length = bounds[index]
            part = content[offset:offset + length]
            os.pwrite(fd, part, offset)
            finished.append(hasher.part_done(offset, length, part if with_data else None))
    finally:
        os.close(fd)
    assert finished.count(True) == 1 and finished[-1], "exactly the last part completes the hash"
    assert hasher.hexdigest() == hashlib.sha256(content).hexdigest()


@pytest.mark.parametrize("algorithm", ["crc64nvme", CRC32C])
def test_part_crcs_join_into_the_whole_files_crc_in_any_order(algorithm: str) -> None:
    content = os.urandom(5 * 1000 + 17)
    bounds = [(0, 1000), (1000, 3000), (4000, 1), (4001, 1016), (5017, 0)]
    crcs = PartCrcs(algorithm)
    for offset, length in reversed(bounds):
        crcs.add(offset, content[offset:offset + length])
    whole = checksum_bytes(content, algorithm)
    assert crcs.total(len(content)) == whole == Checksum.parse(str(whole)) == Checksum.parse(f"{algorithm}:{whole.hex}")
    assert checksum_of_ranges([content[:7], content[7:]], algorithm) == whole
    with pytest.raises(RuntimeError, match="no part at offset 0"):
        PartCrcs(algorithm).total(1)
