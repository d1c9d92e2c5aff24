"""`trainpipe bench dataset`: plan, validation and staging figures of a team's own dataset on a local S3 server."""

from __future__ import annotations

from typing import Annotated

import typer

from trainpipe.bench_common import JsonFigures, Workdir, write_out


def dataset(
    small_files: Annotated[int, typer.Option(min=1, help="small objects to plan and stage")] = 5000,
    large_mb: Annotated[int, typer.Option(min=4, help="MB of large objects to stage (4 objects)")] = 256,
    table_mb: Annotated[int, typer.Option(min=1, help="MB of Parquet + CSV + JSONL tables to validate")] = 128,
    sample_rows: Annotated[int, typer.Option(min=1, help="rows per file that sample validation reads")] = 1000,
    json_out: JsonFigures = None,
    workdir: Workdir = None,
) -> None:
    """Plan time for N objects, GX validation s/GB (full and sample) and staging MB/s with bytes reused."""
    from bench.dataset import DatasetBenchConfig, run_dataset_benchmark

    report = run_dataset_benchmark(DatasetBenchConfig(small_files, large_mb, table_mb, sample_rows, workdir),
                                   echo=typer.echo)
    write_out(json_out, report.to_json())
