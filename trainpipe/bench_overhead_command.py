"""`trainpipe bench overhead CONFIG`: how much of a run is not training, piece by piece."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trainpipe.bench_command import bench_app


@bench_app.command("overhead")
def overhead(
    config: Annotated[Path, typer.Argument(help="job config YAML, run as `trainpipe run` runs it")],
    target_s: Annotated[float | None, typer.Option(help="say whether the overhead stays within this")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the split as JSON here")] = None,
) -> None:
    """Run the job once and split its wall time: before the flow, each phase, start-up, steps, after."""
    from bench.overhead import OverheadBenchError, run_overhead_bench
    from infra.spec import ConfigError

    try:
        report = run_overhead_bench(config, target_s, echo=typer.echo)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except OverheadBenchError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(report.table())
    if json_out is not None:
        json_out.write_text(report.to_json())
        typer.echo(f"wrote {json_out}")
