"""The dataset's part of a plan on real stores: snapshots of file://, gs:// and az:// prefixes (checksums computed
once or kept by the store), gs:// and az:// snapshots staged by the node agent, per-node disk against the catalog's
NVMe, and the dataset config's own errors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from test_dataset_stage import freeze, stage, staged_event, tree

from infra.dataset import snapshot as snapshots
from infra.dataset.snapshot import take_snapshot
from infra.job.plan import PlanError, cluster_candidates, fit_on_disks
from infra.job.spec import ConfigError, parse_job
from infra.storage import open_store


def test_a_store_without_checksums_gets_sha256_computed_once(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    files = {"a.csv": b"x\n1\n", "deep/b.jsonl": b'{"x": 2}\n', "skip.tmp": b"scratch"}
    store = open_store(f"file://{tmp_path}/data")
    for key, data in files.items():
        store.put_bytes(key, data)
    monkeypatch.setattr(snapshots, "_computed", {})

    snapshot = take_snapshot(store, exclude=("*.tmp",))

    assert [(f.key, f.checksum, f.computed) for f in snapshot.files] == [
        (key, f"sha256:{hashlib.sha256(files[key]).hexdigest()}", True) for key in ("a.csv", "deep/b.jsonl")]
    reads = []
    original = store.get_range
    monkeypatch.setattr(store, "get_range", lambda *a: reads.append(a) or original(*a))
    assert take_snapshot(store, exclude=("*.tmp",)).files == snapshot.files
    assert reads == [], "an unchanged object's checksum is not computed twice in one process"


def test_gcs_keeps_checksums_and_a_gcs_snapshot_stages_exactly(gs_url: str, tmp_path: Path) -> None:
    files = {"tables/a.csv": b"x,y\n1,2\n", "images/cat.jpg": bytes(range(256)) * 40}
    store = open_store(f"{gs_url}/dataset")
    for key, data in files.items():
        store.put_bytes(key, data)

    snapshot = take_snapshot(store)

    assert all(not f.computed and f.checksum.split(":")[0] in ("md5", "crc32c") for f in snapshot.files), snapshot
    url = freeze(store, f"{gs_url}/ckpt/run-1", snapshot)
    staged_event(stage(url, tmp_path / "node", tmp_path / "cache"))
    assert tree(tmp_path / "node" / "data") == files


def test_azure_keeps_md5s_and_an_azure_snapshot_stages_exactly(az_url: str, tmp_path: Path) -> None:
    """Objects written in one request keep the service's Content-MD5, which the snapshot takes; one written in blocks
    keeps none, so its sha256 is computed once. Either way the node stages exactly the bytes."""
    files = {"tables/a.csv": b"x,y\n1,2\n", "images/cat.jpg": bytes(range(256)) * 40}
    store = open_store(f"{az_url}/dataset")
    for key, data in files.items():
        store.put_bytes(key, data)
    blocks = bytes(range(251)) * 9000
    upload_id = store.start_multipart("big.bin")  # type: ignore[attr-defined]
    tags = [store.put_part("big.bin", upload_id, n + 1, offset, blocks[offset:offset + (1 << 20)])  # type: ignore
            for n, offset in enumerate(range(0, len(blocks), 1 << 20))]
    store.finish_multipart("big.bin", upload_id, tags)  # type: ignore[attr-defined]
    files["big.bin"] = blocks

    snapshot = take_snapshot(store)

    kept = {f.key: (f.checksum.split(":")[0], f.computed) for f in snapshot.files}
    assert kept == {"tables/a.csv": ("md5", False), "images/cat.jpg": ("md5", False), "big.bin": ("sha256", True)}
    url = freeze(store, f"{az_url}/ckpt/run-1", snapshot)
    staged_event(stage(url, tmp_path / "node", tmp_path / "cache"))
    assert tree(tmp_path / "node" / "data") == files


def _aws_job(nodes: int = 2) -> object:
    return parse_job({"cluster": {"provider": "aws", "nodes": nodes, "local_nvme": True},
                      "dataset": {"url": "s3://bucket/data"}, "checkpoints": {"url": "s3://bucket/ckpt"},
                      "training": {"command": ["-m", "trainer.train"]}})


def test_the_catalogs_nvme_bounds_what_a_node_may_hold_at_plan() -> None:
    job = _aws_job()
    found = cluster_candidates(job)  # type: ignore[arg-type]
    disks = sorted({c.local_nvme_bytes for c in found})
    assert len(disks) >= 2, "the shipped catalog should offer types with different NVMe sizes"

    fitting = fit_on_disks(job, (disks[0] + 1, disks[0] + 1), found)  # type: ignore[arg-type]
    assert fitting and all(c.local_nvme_bytes > disks[0] for c in fitting)

    with pytest.raises(PlanError) as caught:
        fit_on_disks(job, (disks[-1] + 10**9,), found)  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith(f"dataset: a node would hold {(disks[-1] + 10**9) / 1e9:,.2f} GB but the largest local "
                              f"NVMe among the {len(found)} candidates")
    assert f"is {disks[-1] / 1e9:,.2f} GB: use dataset.shard: split" in message


@pytest.mark.parametrize(
    ("dataset", "expected"),
    [
        ({"validation": "manifest"}, "dataset.validation: unknown validation 'manifest': use 'full' or 'sample'"),
        ({"shard": "stripe"}, "dataset.shard: Input should be 'replicate' or 'split'"),
        ({"include": [""]}, "dataset.include: an empty glob selects nothing: remove it"),
        ({"sample_rows": 0}, "dataset.sample_rows: Input should be greater than or equal to 1"),
    ],
)
def test_dataset_config_errors_name_the_field(dataset: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_job({"dataset": {"url": "s3://b/d", **dataset}, "checkpoints": {"url": "s3://b/c"}}, source="job.yaml")
    assert expected in str(caught.value)
