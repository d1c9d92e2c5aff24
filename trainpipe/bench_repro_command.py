"""`trainpipe bench repro`: the study's table on an emulated netns cluster (root), with the predictor's estimates."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from trainpipe.bench_common import CkptEvery, JsonTable, print_report, write_out
from trainpipe.errors import exit_2_on

if TYPE_CHECKING:
    from infra.job.spec import JobSpec


def _run_retrain(job: JobSpec, run_id: str) -> dict[str, Any]:
    """The retrain flow, as `trainpipe run` runs it; a failed run still has its summary, which the caller reads."""
    from flows.retrain import retrain
    from infra.job.summary import load_summary
    from infra.workspace import runs_dir

    try:
        retrain(job, run_id)
    except Exception as exc:  # the flow logged its traceback; the summary says what failed
        typer.echo(f"run {run_id} failed: {type(exc).__name__}: {exc}", err=True)
    path = runs_dir() / run_id / "summary.json"
    return load_summary(path) if path.is_file() else {"status": "failed", "error": f"no summary at {path}"}


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

    # Prefect's 20 s default for starting its in-process server is too short on a busy 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    config = ReproConfig(slow_mbit=slow_mbit, fast_mbit=fast_mbit, steps=steps, ckpt_every=every, workdir=workdir)
    report = run_repro(config, _run_retrain, echo=typer.echo)
    print_report(report, json_out)
    if chart is not None:  # drawing the chart takes a while: only when asked
        write_out(chart, repro_chart_png(report))
