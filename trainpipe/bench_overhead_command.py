"""`trainpipe bench overhead CONFIG`: how much of a run is not training, piece by piece."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trainpipe.bench_common import print_report
from trainpipe.errors import exit_2_on, exit_on


@exit_2_on("infra.job.spec:ConfigError")
@exit_on(1, "bench.overhead:OverheadBenchError")
def overhead(
    config: Annotated[Path, typer.Argument(help="job config YAML, run as `trainpipe run` runs it")],
    target_s: Annotated[float | None, typer.Option(help="say whether the overhead stays within this")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the split as JSON here")] = None,
) -> None:
    """Run the job once and split its wall time: before the flow, each phase, start-up, steps, after."""
    from bench.overhead import run_overhead_bench

    report = run_overhead_bench(config, target_s, echo=typer.echo)
    print_report(report, json_out)
