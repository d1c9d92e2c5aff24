"""`trainpipe bench cluster CONFIG`: launch the job's cluster, measure it as the verify stage does, tear it down.

Plain Python: no Prefect server is started. It measures whatever cluster.verify.bench says (asking for the bench is
the point); the rest of cluster.verify sets how much to measure and the fraction a figure must reach. The cluster is
torn down whatever happens (SIGTERM included); exit 1 when a figure misses what the job pays for or a measurement
fails, 2 on a bad config or a launch that fails.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from pathlib import Path
from typing import Annotated

import typer

from trainpipe.bench_common import write_out


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Python's default SIGTERM ends the process without running finally: the cluster would outlive it.
    raise SystemExit(128 + signum)


def cluster(
    config: Annotated[Path, typer.Argument(help="job config YAML: its cluster section is launched and measured")],
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the figures and verdict here")] = None,
) -> None:
    """TCP between nodes, all-reduce over the training backend and every node's disk, against the job's floors."""
    # Imported here, not at the top: infra.job.plan brings pandas, which `trainpipe --help` need not wait for.
    from infra.analysis.clusterbench import BenchError, bench_cluster, render_table
    from infra.compute.access.remote import RemoteError
    from infra.compute.catalog import CatalogError
    from infra.compute.providers import LaunchError, launch_cluster, terminate_cluster
    from infra.job.environment import training_environment
    from infra.job.plan import cluster_name_for
    from infra.job.spec import ConfigError, load_job

    try:
        job = load_job(config)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    bench_id = f"bench-{job.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    name = cluster_name_for(bench_id)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        typer.echo(f"launching {name} on {job.cluster.provider}: {job.cluster.nodes} nodes")
        launched = launch_cluster(job.cluster, name, bench_id)
        # The all-reduce in the job's training environment: its torch and NCCL are what training will use.
        result = bench_cluster(launched, job.cluster, say=typer.echo, everything=True,
                               environment=lambda node: training_environment(job, launched, node))
    except (LaunchError, CatalogError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except (BenchError, RemoteError) as exc:
        typer.echo(f"error: cluster bench failed: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        alive = terminate_cluster(job.cluster.provider, name).nodes_left
        typer.echo(f"tore down {name}: {alive} nodes left running")
    typer.echo(render_table(result.measurement))
    typer.echo(result.verdict.render())
    write_out(json_out, json.dumps(result.to_dict(), indent=2))
    if not result.verdict.ok:
        raise typer.Exit(1)
