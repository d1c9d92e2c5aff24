"""`trainpipe bench overhead CONFIG`: how much of a run is not training, piece by piece."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from infra.job.spec import ConfigError
from trainpipe.bench_command import bench_app, print_report
from trainpipe.errors import exit_2_on


@bench_app.command("overhead")
@exit_2_on(ConfigError)
def overhead(
    config: Annotated[Path, typer.Argument(help="job config YAML, run as `trainpipe run` runs it")],
    target_s: Annotated[float | None, typer.Option(help="say whether the overhead stays within this")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the split as JSON here")] = None,
) -> None:
    """Run the job once and split its wall time: before the flow, each phase, start-up, steps, after."""
    from bench.overhead import OverheadBenchError, run_overhead_bench

    try:
        report = run_overhead_bench(config, target_s, echo=typer.echo)
    except OverheadBenchError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    print_report(report, json_out)
