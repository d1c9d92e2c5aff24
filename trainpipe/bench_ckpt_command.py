"""`trainpipe bench ckpt`: training stall per checkpoint, synchronous vs async save + background sync."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from trainpipe.bench_common import CkptEvery, JsonFigures, write_out
from trainpipe.errors import exit_2_on


@exit_2_on("bench.checkpoint:BenchError")
def ckpt(
    d_model: Annotated[int, typer.Option(min=8, help="model width")] = 512,
    n_layers: Annotated[int, typer.Option(min=1, help="transformer blocks")] = 6,
    n_heads: Annotated[int, typer.Option(min=1, help="attention heads (must divide --d-model)")] = 8,
    steps: Annotated[int, typer.Option(min=2, help="training steps per mode")] = 24,
    every: CkptEvery = 6,
    json_out: JsonFigures = None,
    workdir: Annotated[Path | None, typer.Option(help="scratch dir (default: system temp)")] = None,
) -> None:
    """Train the bundled model with a checkpoint ≥ 200 MB every N steps, once sync and once async, and compare."""
    from bench.checkpoint import BenchConfig, run_benchmark
    from bench.trainer_flags import ModelShape

    if d_model % n_heads:
        typer.echo(f"error: --n-heads {n_heads} must divide --d-model {d_model}", err=True)
        raise typer.Exit(2)
    result = run_benchmark(BenchConfig(ModelShape(d_model, n_layers, n_heads), steps=steps,
                                       ckpt_every=every), workdir)
    typer.echo(result.render())
    write_out(json_out, json.dumps(result.to_dict(), indent=2))
