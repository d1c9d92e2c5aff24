"""Cluster benchmarks: launch a cluster for measuring only, measure its network, collectives and disks, publish."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from infra.analysis import clusterbench
from infra.analysis.clusterbench import BenchResult
from infra.compute.providers import Cluster, launch_cluster
from infra.compute.spec import ClusterSpec
from tasks.node_output import node_line_sink
from tasks.policy import TRANSIENT_RETRIES


@task(name="launch-bench-cluster", **TRANSIENT_RETRIES)
def launch_bench_cluster(spec: ClusterSpec, cluster_name: str, bench_id: str) -> Cluster:
    cluster = launch_cluster(spec, cluster_name, bench_id)
    get_run_logger().info("launched %s for benchmarks: %s", cluster.name, ", ".join(n.name for n in cluster.nodes))
    return cluster


@task(name="measure-cluster", **TRANSIENT_RETRIES)
def measure_cluster(cluster: Cluster, spec: ClusterSpec) -> BenchResult:
    """TCP between nodes, all-reduce over the training backend, every node's disk; held to the floors and catalog."""
    logger = get_run_logger()
    return clusterbench.bench_cluster(cluster, spec, everything=True,
                                      sink_for=lambda label: node_line_sink(logger, label),
                                      say=lambda message: logger.info("cluster bench: %s", message))


def _markdown(bench_id: str, result: BenchResult, nodes_left: int) -> str:
    measurement, verdict = result.measurement, result.verdict
    lines = [f"# Cluster bench `{bench_id}`", "",
             f"* {measurement.nodes} nodes, instance type `{measurement.instance_type}`"
             + (f" (catalog `{result.catalog_key}`)" if result.catalog_key else " (not in the catalog)"),
             f"* measured in {measurement.seconds:g}s; nodes left running after teardown: {nodes_left}", "",
             "| figure | value | unit | detail |", "|---|---:|---|---|"]
    lines += [f"| {row['figure']} | {row['value']} | {row['unit']} | {row['detail']} |" for row in measurement.rows()]
    head = (f"**ok**: {len(verdict.checks)} figures checked" if verdict.ok
            else f"**missed**: {len(verdict.failures)} of {len(verdict.checks)} figures")
    lines += ["", f"## Verdict: {head}", ""] + [f"* {line}" for line in verdict.lines()]
    return "\n".join(lines) + "\n"


@task(name="publish-bench")
def publish_bench(bench_id: str, result: BenchResult, nodes_left: int) -> None:
    measurement = result.measurement
    create_table_artifact(measurement.rows(), key="cluster-bench-figures",
                          description=f"bench {bench_id}: TCP, all-reduce and disk figures")
    disks = [{"node": d.node, "write MB/s": d.write_mb_per_s, "read MB/s": d.read_mb_per_s,
              "MB": round(d.bytes / 1e6, 1), "O_DIRECT": d.direct} for d in measurement.disks]
    create_table_artifact(disks, key="cluster-bench-disks", description=f"bench {bench_id}: local disk throughput")
    checks = [{"figure": c.figure, "measured": c.measured, "expected": c.expected, "unit": c.unit,
               "source": c.source, "passed": c.passed} for c in result.verdict.checks]
    if checks:
        create_table_artifact(checks, key="cluster-bench-verdict",
                              description=f"bench {bench_id}: measured vs expected")
    create_markdown_artifact(_markdown(bench_id, result, nodes_left), key="cluster-bench",
                             description=f"bench {bench_id}")
