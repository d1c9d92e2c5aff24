"""Staging a run's dataset snapshot onto nodes for real: the node agent (`python -m infra.node stage`) in its own
process against a real S3 server (`rclone serve s3`), its data dir, its object cache and data-files.txt on disk.

Nothing is mocked. Each "node" is a workdir; a second run on the same machine is a new workdir with the same cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from infra.dataset.assign import assign
from infra.dataset.snapshot import DatasetSnapshot, save_snapshot, take_snapshot
from infra.dataset.stagecache import ObjectCache
from infra.node.events import Event, NodeEvent, parse
from infra.node.protocol import StageRequest
from infra.storage import ObjectStore, open_store
from infra.storage.transfer import TransferConfig, upload

MB = 1 << 20


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)


def put_dataset(store: ObjectStore, source: Path, files: dict[str, bytes]) -> None:
    """Upload the files with the transfer engine: anything over 5 MB goes up as a multipart upload."""
    write_tree(source, files)
    upload(source, sorted(files), store, TransferConfig(workers=32, part_size=5 * MB))


def freeze(store: ObjectStore, checkpoints: str, snapshot: DatasetSnapshot | None = None) -> str:
    """Snapshot the dataset as plan does and keep it with the run's checkpoints; returns the snapshot's URL."""
    return save_snapshot(open_store(checkpoints), snapshot or take_snapshot(store))


def stage(snapshot_url: str, workdir: Path, cache: Path, *, rank: int = 0, nodes: int = 1,
          shard: str = "replicate") -> subprocess.CompletedProcess[str]:
    request = StageRequest(snapshot=snapshot_url, rank=rank, nodes=nodes, shard=shard, dest=str(workdir / "data"),
                           workdir=str(workdir), cache=str(cache), run="run-1", workers=16)
    return subprocess.run(request.command_line(sys.executable), cwd=REPO, env=request.environment(os.environ),
                          capture_output=True, text=True, timeout=300)


def staged_event(result: subprocess.CompletedProcess[str]) -> Event:
    assert result.returncode == 0, result.stderr[-3000:]
    events = [event for event in map(parse, result.stdout.splitlines()) if event and event.kind is NodeEvent.STAGED]
    assert len(events) == 1, result.stdout[-2000:]
    return events[0]


def failure_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed node command ends with (its other stderr lines are its log)."""
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines()
             if line.strip() and not line.startswith(("INFO ", "WARNING ", "DEBUG "))]
    assert len(lines) == 1, result.stderr
    return lines[0]


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_5000_small_files_and_a_multipart_file_stage_exactly_and_a_second_run_reuses_every_byte(
        s3_url: str, tmp_path: Path) -> None:
    files = {f"part-{i // 500:02d}/row-{i:05d}.jsonl": f'{{"i": {i}}}\n'.encode() * (1 + i % 7) for i in range(5000)}
    files["big/model-input.bin"] = os.urandom(21 * MB)  # 5 parts up, 3 parts of the engine's 8 MB down
    store = open_store(f"{s3_url}/dataset")
    put_dataset(store, tmp_path / "source", files)
    snapshot_url = freeze(store, f"{s3_url}/ckpt/run-1")
    total = sum(len(data) for data in files.values())
    cache = tmp_path / "dataset-cache"

    first = staged_event(stage(snapshot_url, tmp_path / "run-1", cache))
    assert (first["files"], first["bytes"], first["skipped_bytes"], first["node_bytes"]) == (5001, total, 0, total)
    assert tree(tmp_path / "run-1" / "data") == files, "the data dir is not exactly the dataset"
    listed = (tmp_path / "run-1" / "data-files.txt").read_text().splitlines()
    assert listed == sorted(files)

    # The next run on this machine: a new cluster (new data dir), the same cache.
    second = staged_event(stage(snapshot_url, tmp_path / "run-2", cache))
    assert (second["bytes"], second["skipped_files"], second["skipped_bytes"]) == (0, 5001, total)
    assert tree(tmp_path / "run-2" / "data") == files
    # Reused means linked, not copied: the data dir costs no space beyond the cache.
    big = tmp_path / "run-2" / "data" / "big" / "model-input.bin"
    assert big.stat().st_nlink == 3, "the cached object should be linked from both data dirs"


def _small_dataset(s3_url: str, tmp_path: Path) -> tuple[ObjectStore, dict[str, bytes]]:
    files = {"a/one.csv": b"x,y\n1,2\n", "a/two.csv": b"x,y\n3,4\n", "b/three.jsonl": b'{"x": 5}\n',
             "large.bin": os.urandom(9 * MB)}
    store = open_store(f"{s3_url}/dataset")
    put_dataset(store, tmp_path / "source", files)
    return store, files


def test_an_object_overwritten_after_plan_fails_staging_with_one_line_naming_it(s3_url: str, tmp_path: Path) -> None:
    store, _ = _small_dataset(s3_url, tmp_path)
    snapshot_url = freeze(store, f"{s3_url}/ckpt/run-1")
    store.put_bytes("a/two.csv", b"x,y\n9,9\n")  # same size, other bytes: a new ETag

    line = failure_line(stage(snapshot_url, tmp_path / "node", tmp_path / "cache"))

    assert line.startswith(f"dataset changed since run-1's snapshot: {store.url}/a/two.csv changed (etag ")
    assert "start a new run" in line
    assert not (tmp_path / "node" / "data-files.txt").exists(), "a failed stage must not hand the node a file list"
    assert not any((tmp_path / "node" / "data").rglob("*")), "nothing is staged from a changed dataset"


@pytest.mark.parametrize("key", ["a/one.csv", "large.bin"], ids=["one-request", "engine-parts"])
def test_bytes_that_differ_from_the_snapshot_while_staging_are_refused(s3_url: str, tmp_path: Path,
                                                                       key: str) -> None:
    """The object changes after the stage's listing check (same size and ETag as the snapshot, other bytes): what
    arrives is verified against the snapshot's checksum, whichever path fetched it."""
    store, _ = _small_dataset(s3_url, tmp_path)
    snapshot = take_snapshot(store)
    wrong = "md5:" + "0" * 32
    tampered = snapshot.model_copy(update={"files": tuple(
        f.model_copy(update={"checksum": wrong}) if f.key == key else f for f in snapshot.files)})
    line = failure_line(stage(freeze(store, f"{s3_url}/ckpt/run-1", tampered), tmp_path / "node", tmp_path / "cache"))

    assert line.startswith(f"{store.url}/{key}: ") and "differs from the run's snapshot" in line, line
    assert not (tmp_path / "cache" / "objects" / ObjectCache.name(wrong)).exists()


def test_split_over_3_nodes_is_disjoint_complete_and_balanced(s3_url: str, tmp_path: Path) -> None:
    sizes = [3 * MB, 2 * MB, 1 * MB, 700_000, 500_000, 400_000, 300_000, 200_000, 100_000, 50_000, 10_000, 1]
    files = {f"shards/shard-{i:03d}.tar": os.urandom(size) for i, size in enumerate(sizes)}
    store = open_store(f"{s3_url}/dataset")
    put_dataset(store, tmp_path / "source", files)
    snapshot_url = freeze(store, f"{s3_url}/ckpt/run-1")

    held: list[dict[str, bytes]] = []
    for rank in range(3):
        workdir = tmp_path / f"node-{rank}"
        event = staged_event(stage(snapshot_url, workdir, tmp_path / f"cache-{rank}", rank=rank, nodes=3,
                                   shard="split"))
        share = tree(workdir / "data")
        assert (workdir / "data-files.txt").read_text().splitlines() == sorted(share)
        assert event["node_bytes"] == sum(len(data) for data in share.values())
        held.append(share)

    keys = [set(share) for share in held]
    assert not (keys[0] & keys[1] or keys[0] & keys[2] or keys[1] & keys[2]), "a file went to two nodes"
    assert {k: v for share in held for k, v in share.items()} == files, "the union is not the dataset"
    loads = [sum(len(data) for data in share.values()) for share in held]
    assert max(loads) - min(loads) <= max(sizes), loads


def test_split_balances_within_one_file_for_any_sizes() -> None:
    """The greedy split's bound, over many random size mixes (the staging test above shows it on real nodes)."""
    import random

    from infra.dataset.snapshot import SnapshotFile

    rng = random.Random(7)
    for trial in range(200):
        count, nodes = rng.randint(3, 60), rng.randint(2, 8)
        if count < nodes:
            continue
        files = [SnapshotFile(key=f"f{i}", size=int(rng.paretovariate(1.2) * 1000), etag=None,
                              checksum=f"md5:{i:032x}") for i in range(count)]
        shares = assign(files, "split", nodes)
        loads = [sum(f.size for f in share) for share in shares]
        assert sorted(f.key for share in shares for f in share) == sorted(f.key for f in files), trial
        assert max(loads) - min(loads) <= max(f.size for f in files), (trial, loads)


def test_a_stage_resumes_from_what_it_fetched_and_mirrors_exactly(s3_url: str, tmp_path: Path) -> None:
    """An interrupted stage left a whole file (and a damaged one) in the cache's incoming dir, and an older run left
    other files in the data dir: the rerun keeps the whole file, fetches the damaged one again and leaves the data
    dir holding exactly the dataset."""
    store, files = _small_dataset(s3_url, tmp_path)
    snapshot_url = freeze(store, f"{s3_url}/ckpt/run-1")
    cache = tmp_path / "cache"
    write_tree(cache / "incoming", {"large.bin": files["large.bin"], "a/one.csv": b"x,y\n0,0\n"})
    write_tree(tmp_path / "node" / "data", {"stale/old.parquet": b"old", ".trainpipe-verified.json": b"{}"})

    event = staged_event(stage(snapshot_url, tmp_path / "node", cache))

    assert event["skipped_files"] == 1 and event["skipped_bytes"] == len(files["large.bin"])
    assert event["bytes"] == sum(len(data) for data in files.values()) - len(files["large.bin"])
    assert tree(tmp_path / "node" / "data") == files


def test_a_cached_object_written_to_since_is_fetched_again(s3_url: str, tmp_path: Path) -> None:
    store, files = _small_dataset(s3_url, tmp_path)
    snapshot_url = freeze(store, f"{s3_url}/ckpt/run-1")
    cache = tmp_path / "cache"
    staged_event(stage(snapshot_url, tmp_path / "run-1", cache))
    damaged = tmp_path / "run-1" / "data" / "a" / "one.csv"  # a job that wrote to its data (root ignores 0444)
    damaged.chmod(0o644)
    damaged.write_bytes(b"x,y\n7,7\n")

    event = staged_event(stage(snapshot_url, tmp_path / "run-2", cache))

    assert event["bytes"] == len(files["a/one.csv"]) and event["skipped_files"] == len(files) - 1
    assert tree(tmp_path / "run-2" / "data") == files
    index = json.loads((cache / "index.json").read_text())["objects"]
    assert len(index) == len(files)
