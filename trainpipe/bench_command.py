"""`trainpipe bench …`: measurements of this machine's I/O paths.

The group registers every subcommand here; the command modules import only trainpipe.bench_common, never this
module, so the imports run one way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trainpipe import (
    bench_ckpt_command,
    bench_cluster_command,
    bench_dataset_command,
    bench_overhead_command,
    bench_repro_command,
    bench_scale_command,
    bench_staging_command,
)
from trainpipe.bench_common import JsonTable, print_report

bench_app = typer.Typer(no_args_is_help=True, help="Measure transfer throughput against other tools.")


@bench_app.command("transfer")
def transfer(
    size_gb: Annotated[float, typer.Option(min=0.001, help="dataset size for the S3 runs, in GB")] = 2.0,
    repeats: Annotated[int, typer.Option(min=1, help="runs of each client; the best and median are reported")] = 3,
    gcs_size_gb: Annotated[float, typer.Option(min=0.0, help="dataset size for the GCS emulator runs (0: skip)")] = 0.5,
    azure_size_gb: Annotated[float, typer.Option(min=0.0, help="dataset size for the Azurite runs (0: skip)")] = 0.5,
    clients: Annotated[
        str | None, typer.Option(help="comma-separated subset of: trainpipe,s5cmd,aws,boto3 (default: all)")
    ] = None,
    engines: Annotated[str, typer.Option(help="comma-separated trainpipe engines to run: native,python")] = (
        "native,python"
    ),
    json_out: JsonTable = None,
    workdir: Annotated[Path | None, typer.Option(help="where the temp dataset goes (default: the system temp)")] = None,
) -> None:
    """Download and upload MB/s and client/server CPU per GB of trainpipe's engines vs s5cmd, aws s3 cp, boto3 and
    the disk on a local S3 server, vs transfer_manager on the GCS emulator and vs AzCopy on Azurite."""
    from bench.transfer import ENGINES, BenchConfig, run_benchmark

    chosen = [name.strip() for name in clients.split(",")] if clients else None
    engine_list = tuple(name.strip() for name in engines.split(","))
    if not engine_list or any(name not in ENGINES for name in engine_list):
        raise typer.BadParameter(f"{engines!r}: use one or more of {','.join(ENGINES)}", param_hint="--engines")
    report = run_benchmark(BenchConfig(size_gb, repeats, gcs_size_gb, chosen, workdir, engine_list, azure_size_gb),
                           echo=typer.echo)
    print_report(report, json_out)



# `trainpipe bench --help` lists the commands in the order they are registered in: transfer first, then these.
bench_app.command("ckpt")(bench_ckpt_command.ckpt)
bench_app.command("cluster")(bench_cluster_command.cluster)
bench_app.command("dataset")(bench_dataset_command.dataset)
bench_app.command("overhead")(bench_overhead_command.overhead)
bench_app.command("scale")(bench_scale_command.scale)
bench_app.command("repro")(bench_repro_command.repro)
bench_app.command("staging")(bench_staging_command.staging)
