"""`trainpipe bench …`: measurements of this machine's I/O paths. Other modules add their commands to bench_app."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Protocol

import typer

bench_app = typer.Typer(no_args_is_help=True, help="Measure transfer throughput against other tools.")


class Report(Protocol):
    def table(self) -> str: ...

    def to_json(self) -> str: ...


def print_report(report: Report, json_out: Path | None) -> None:
    """A bench's table on stdout, and the same figures as JSON where --json asks."""
    typer.echo(report.table())
    if json_out is not None:
        json_out.write_text(report.to_json())
        typer.echo(f"wrote {json_out}")


@bench_app.command("transfer")
def transfer(
    size_gb: Annotated[float, typer.Option(min=0.001, help="dataset size for the S3 runs, in GB")] = 2.0,
    repeats: Annotated[int, typer.Option(min=1, help="runs of each client; the best and median are reported")] = 3,
    gcs_size_gb: Annotated[float, typer.Option(min=0.0, help="dataset size for the GCS emulator runs (0: skip)")] = 0.5,
    clients: Annotated[
        str | None, typer.Option(help="comma-separated subset of: trainpipe,s5cmd,aws,boto3 (default: all)")
    ] = None,
    engines: Annotated[str, typer.Option(help="comma-separated trainpipe engines to run: native,python")] = (
        "native,python"
    ),
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the table as JSON here")] = None,
    workdir: Annotated[Path | None, typer.Option(help="where the temp dataset goes (default: the system temp)")] = None,
) -> None:
    """Download and upload MB/s and client/server CPU per GB of trainpipe's engines vs s5cmd, aws s3 cp, boto3 and
    the disk on a local S3 server, and vs transfer_manager on the GCS emulator."""
    from bench.transfer import ENGINES, BenchConfig, run_benchmark

    chosen = [name.strip() for name in clients.split(",")] if clients else None
    engine_list = tuple(name.strip() for name in engines.split(","))
    if not engine_list or any(name not in ENGINES for name in engine_list):
        raise typer.BadParameter(f"{engines!r}: use one or more of {','.join(ENGINES)}", param_hint="--engines")
    report = run_benchmark(BenchConfig(size_gb, repeats, gcs_size_gb, chosen, workdir, engine_list), echo=typer.echo)
    print_report(report, json_out)


# Each registers its `bench` subcommand on bench_app.
from trainpipe import (  # noqa: E402, F401
    bench_ckpt_command,
    bench_cluster_command,
    bench_dataset_command,
    bench_overhead_command,
    bench_repro_command,
)
