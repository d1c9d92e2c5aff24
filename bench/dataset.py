"""The dataset benchmark: plan, validation and staging of a team's own dataset on a local S3 server
(`rclone serve s3`, the test suite's), each against a peer measured in the same run.

- plan: snapshotting N small objects (list, select, checksums) and the whole dataset plan, against a bare listing;
- validation: Great Expectations over Parquet, CSV and JSONL tables, full and sample, in seconds per GB of table,
  against reading the same rows into DataFrames without GX;
- staging: the node agent's first stage (MB/s) against the transfer engine downloading the same objects, and a
  second run on the same machine (bytes reused, seconds).
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from bench.transfer import _test_servers
from infra.dataset.assign import assign
from infra.dataset.expectations import load_expectations
from infra.dataset.formats import detect_formats, read_rows
from infra.dataset.gate import validate_files
from infra.dataset.planning import plan_dataset
from infra.dataset.snapshot import take_snapshot
from infra.dataset.spec import DatasetSpec
from infra.dataset.stagecache import ObjectCache
from infra.node.stage import stage
from infra.storage import open_store
from infra.storage.transfer import DEFAULT_CONFIG, FileSpec, download, upload

SUITE = [
    {"type": "expect_column_values_to_be_between", "column": "age", "min_value": 0, "max_value": 120},
    {"type": "expect_column_values_to_not_be_null", "column": "email"},
    {"type": "expect_column_values_to_match_regex", "column": "email", "regex": "^[^@]+@[^@]+$"},
    {"type": "expect_column_values_to_be_unique", "column": "id"},
    {"type": "expect_table_columns_to_match_set", "column_set": ["id", "age", "score", "email"]},
]


@dataclass(frozen=True)
class DatasetBenchConfig:
    small_files: int = 5000
    large_mb: int = 256  # in 4 objects, each staged in several parts
    table_mb: int = 128  # Parquet + CSV + JSONL together, in 8 files each
    sample_rows: int = 1000
    workdir: Path | None = None


@dataclass
class DatasetBenchReport:
    figures: dict[str, Any] = field(default_factory=dict)

    def lines(self) -> list[str]:
        f = self.figures
        return [
            f"plan, {f['objects']:,} objects: snapshot {f['snapshot_s']:.2f} s, whole dataset plan {f['plan_s']:.2f} s "
            f"(bare listing {f['list_s']:.2f} s: plan is {f['plan_s'] / f['list_s']:.1f}× a listing)",
            f"validation, {f['table_gb']:.3f} GB of tables ({f['table_rows']:,} rows, {f['expectations']} "
            f"expectations): full {f['full_s_per_gb']:.0f} s/GB (reading the rows alone: {f['read_s_per_gb']:.0f} "
            f"s/GB, GX is {f['full_s_per_gb'] / f['read_s_per_gb']:.1f}×), sample of {f['sample_rows']:,} rows/file "
            f"{f['sample_s_per_gb']:.1f} s/GB reading {f['sample_read_fraction']:.2%} of the bytes",
            f"staging, {f['stage_files']:,} files, {f['stage_mb']:,.0f} MB: first run {f['stage_mb_per_s']:.0f} MB/s "
            f"({f['stage_s']:.1f} s; the transfer engine alone on the same objects {f['engine_mb_per_s']:.0f} MB/s, "
            f"{f['stage_mb_per_s'] / f['engine_mb_per_s']:.2f}×), second run reused {f['reused_mb']:,.0f} MB "
            f"({f['reused_fraction']:.0%}) in {f['second_s']:.1f} s",
        ]

    def to_json(self) -> str:
        return json.dumps(self.figures, indent=2)


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


def _tables(total_bytes: int) -> dict[str, bytes]:
    """8 files per format of a people table; rows chosen so all 24 come to about total_bytes."""
    rows = max(1000, total_bytes // 24 // 40)
    rng = np.random.default_rng(0)
    out: dict[str, bytes] = {}
    for part in range(8):
        ids = np.arange(part * rows, (part + 1) * rows)
        frame = pd.DataFrame({"id": ids, "age": rng.integers(0, 100, rows), "score": rng.random(rows),
                              "email": [f"user{i}@example.org" for i in ids]})
        parquet = io.BytesIO()
        frame.to_parquet(parquet, row_group_size=50_000)
        out[f"part-{part}.parquet"] = parquet.getvalue()
        out[f"part-{part}.csv"] = frame.to_csv(index=False).encode()
        out[f"part-{part}.jsonl"] = frame.to_json(orient="records", lines=True).encode()
    return out


def _put(store: Any, scratch: Path, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        (scratch / key).parent.mkdir(parents=True, exist_ok=True)
        (scratch / key).write_bytes(data)
    upload(scratch, sorted(files), store, DEFAULT_CONFIG.but(workers=32))


def run_dataset_benchmark(config: DatasetBenchConfig, echo: Callable[[str], None] = print) -> DatasetBenchReport:
    servers = _test_servers()
    report = DatasetBenchReport()
    f = report.figures
    with tempfile.TemporaryDirectory(prefix="trainpipe-bench-dataset-", dir=config.workdir) as temp:
        scratch = Path(temp)
        with servers.rclone_s3(scratch / "s3") as server:
            os.environ.update(server.env())
            bucket = server.make_bucket("bench-dataset")
            echo(f"writing {config.small_files:,} small objects and {config.large_mb} MB of large ones")
            small = {f"small/part-{i // 500:03d}/{i:06d}.json": os.urandom(256 + i % 768)
                     for i in range(config.small_files)}
            large = {f"large/shard-{i}.tar": os.urandom(config.large_mb * (1 << 20) // 4) for i in range(4)}
            store = open_store(f"{bucket}/staged")
            _put(store, scratch / "src-staged", small | large)

            list(store.list())  # rclone's first listing of a new tree warms its caches: time the next one
            listing, f["list_s"] = _timed(lambda: list(store.list()))
            f["objects"] = len(listing)
            snapshot, f["snapshot_s"] = _timed(lambda: take_snapshot(store))
            spec = DatasetSpec(url=store.url)
            _, f["plan_s"] = _timed(lambda: plan_dataset(spec, 2, f"{bucket}/ckpt/bench", "bench"))
            echo(f"plan: {f['plan_s']:.2f} s for {f['objects']:,} objects")

            mine = assign(snapshot.files, "replicate", 1)[0]
            f["stage_files"], f["stage_mb"] = len(mine), snapshot.bytes / 1e6
            with ObjectCache(scratch / "cache") as cache:
                _, f["stage_s"] = _timed(lambda: stage(snapshot, mine, scratch / "run-1", cache, run="bench",
                                                           workers=16))
            f["stage_mb_per_s"] = f["stage_mb"] / f["stage_s"]
            with ObjectCache(scratch / "cache") as cache:
                second, f["second_s"] = _timed(lambda: stage(snapshot, mine, scratch / "run-2", cache, run="bench",
                                                             workers=16))
            f["reused_mb"] = second["skipped_bytes"] / 1e6
            f["reused_fraction"] = second["skipped_bytes"] / snapshot.bytes
            specs = [FileSpec(file.key, file.size) for file in mine]
            engine = download(store, specs, scratch / "engine", DEFAULT_CONFIG.but(workers=16))
            f["engine_mb_per_s"] = engine.bytes_moved / 1e6 / engine.seconds
            echo(f"staging: {f['stage_mb_per_s']:.0f} MB/s (engine {f['engine_mb_per_s']:.0f} MB/s)")

            tables = _tables(config.table_mb << 20)
            table_store = open_store(f"{bucket}/tables")
            _put(table_store, scratch / "src-tables", tables)
            files = [(key, len(data)) for key, data in tables.items()]
            formats = detect_formats(table_store, list(tables))
            suite = load_expectations(SUITE)
            f["expectations"], f["sample_rows"] = len(suite), config.sample_rows
            f["table_gb"] = sum(size for _, size in files) / 1e9
            full, full_s = _timed(lambda: validate_files(table_store, files, formats, suite, "full", 0))
            assert full.ok, full.failure_message()
            sample, sample_s = _timed(lambda: validate_files(table_store, files, formats, suite, "sample",
                                                             config.sample_rows))
            _, read_s = _timed(lambda: [read_rows(table_store, key, size, formats[key], None) for key, size in files])
            f["table_rows"] = full.rows
            f["full_s_per_gb"] = full_s / f["table_gb"]
            f["read_s_per_gb"] = read_s / f["table_gb"]
            f["sample_s_per_gb"] = sample_s / f["table_gb"]
            f["sample_read_fraction"] = sample.bytes_read / sample.bytes_total
    for line in report.lines():
        echo(line)
    return report
