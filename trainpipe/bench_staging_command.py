"""`trainpipe bench staging`: store bytes and staging wall time, fan-out off against on, on netns clusters."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trainpipe.bench_common import JsonTable, Workdir, node_counts, print_report, run_retrain
from trainpipe.errors import exit_2_on


@exit_2_on("bench.staging:StagingBenchError", "bench.recovery:RecoveryBenchError")
def staging(
    nodes: Annotated[str, typer.Option(help="cluster sizes to stage on, comma-separated")] = "2,4",
    size_mb: Annotated[int, typer.Option(min=1, help="MB of the replicated dataset (8 files)")] = 1024,
    store_mbit: Annotated[float, typer.Option(min=1, help="the store's link, Mbit/s")] = 400.0,
    node_mbit: Annotated[float, typer.Option(min=1, help="every node's link, Mbit/s")] = 2000.0,
    workers: Annotated[int, typer.Option(min=1, help="each stager's parallel transfers")] = 4,
    json_out: JsonTable = None,
    workdir: Workdir = None,
    staging_runs: Annotated[bool, typer.Option("--staging/--no-staging", help="stage with fan-out off and on")] = True,
    recovery: Annotated[bool, typer.Option("--recovery/--no-recovery",
                                           help="recover from one node's preemption by each path")] = True,
    recovery_nodes: Annotated[int, typer.Option(min=2, help="the recovery's cluster size")] = 4,
    recovery_paths: Annotated[str, typer.Option(help="recovery.replace paths to run: nodes (replace-one), cluster "
                                                "(the whole relaunch)")] = "cluster,nodes",
    recovery_dataset_mb: Annotated[int, typer.Option(min=1, help="MB of the recovery job's dataset")] = 512,
    recovery_json: Annotated[Path | None, typer.Option(help="also write the recovery table as JSON here")] = None,
) -> None:
    """Stage one replicated dataset on a netns cluster per node count with fan-out off, then on (root only):
    bytes the store sent (counted at its interface) and wall time; every node's files are verified. Then one node of
    a cluster preempted mid-training, recovered by the whole relaunch and by replace-one: detection → resumed and
    the store's bytes of each."""
    from bench.recovery import RecoveryBenchConfig, run_recovery_benchmark
    from bench.staging import StagingBenchConfig, run_staging_benchmark

    config = StagingBenchConfig(node_counts(nodes), size_mb, store_mbit, node_mbit, workers, workdir)
    recovery_config = RecoveryBenchConfig(nodes=recovery_nodes, paths=tuple(recovery_paths.split(",")),
                                          dataset_mb=recovery_dataset_mb, store_mbit=store_mbit, node_mbit=node_mbit,
                                          workdir=workdir)
    if recovery and (why := recovery_config.problem()) is not None:  # before the staging half's minutes
        raise typer.BadParameter(why, param_hint="--recovery-nodes / --recovery-paths")
    if staging_runs:
        print_report(run_staging_benchmark(config, echo=typer.echo), json_out)
    if recovery:
        print_report(run_recovery_benchmark(recovery_config, run_retrain, echo=typer.echo), recovery_json)
