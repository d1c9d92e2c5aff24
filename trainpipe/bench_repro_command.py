"""`trainpipe bench repro`: the study's table on an emulated netns cluster (root), with the predictor's estimates."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trainpipe.bench_common import CkptEvery, JsonTable, print_report, run_retrain, write_out
from trainpipe.errors import exit_2_on


@exit_2_on("bench.repro:ReproError")
def repro(
    slow_mbit: Annotated[float, typer.Option(min=1, help="link rate of configuration (a), Mbit/s")] = 100.0,
    fast_mbit: Annotated[float, typer.Option(min=1, help="link rate of configurations (b) and (c), Mbit/s")] = 1000.0,
    steps: Annotated[int, typer.Option(min=10, help="training steps per configuration")] = 60,
    every: CkptEvery = 20,
    json_out: JsonTable = None,
    chart: Annotated[Path | None, typer.Option(help="write the chart (PNG) here")] = Path("repro.png"),
    workdir: Annotated[Path | None, typer.Option(help="scratch dir for the store (default: system temp)")] = None,
) -> None:
    """Slow links + remote store, fast links + remote store, fast links + local disk: the study's table, scaled down."""
    from bench.repro import ReproConfig, run_repro
    from bench.repro_chart import repro_chart_png

    config = ReproConfig(slow_mbit=slow_mbit, fast_mbit=fast_mbit, steps=steps, ckpt_every=every, workdir=workdir)
    report = run_repro(config, run_retrain, echo=typer.echo)
    print_report(report, json_out)
    if chart is not None:  # drawing the chart takes a while: only when asked
        write_out(chart, repro_chart_png(report))
