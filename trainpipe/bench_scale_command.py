"""`trainpipe bench scale`: the orchestrator's own cost (CPU, threads, fds, API calls, log records) per node count."""

from __future__ import annotations

from typing import Annotated

import typer

from trainpipe.bench_common import JsonTable, Workdir, node_counts, print_report, run_retrain
from trainpipe.errors import exit_on


@exit_on(1, "bench.scale:ScaleBenchError")
def scale(
    nodes: Annotated[str, typer.Option(help="node counts to run, comma-separated")] = "2,4,8,16",
    json_out: JsonTable = None,
    workdir: Workdir = None,
) -> None:
    """Run one light job on N local nodes for each N and measure the orchestrator itself: CPU seconds, peak threads
    and open fds, Prefect API calls and log records, time to first step and wall time; and which of them grows
    faster than N."""
    from bench.scale import run_scale_benchmark

    report = run_scale_benchmark(node_counts(nodes), run_retrain, workdir, echo=typer.echo)
    print_report(report, json_out)
