"""Cluster benchmarks: launch a cluster for measuring only, measure each node's disk, publish the numbers."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from infra.providers import Cluster, Node, get_provider
from infra.spec import ClusterSpec
from tasks.node_output import last_event, node_line_sink
from tasks.policy import TRANSIENT_RETRIES


@task(name="launch-bench-cluster", **TRANSIENT_RETRIES)
def launch_bench_cluster(spec: ClusterSpec, cluster_name: str, bench_id: str) -> Cluster:
    cluster = get_provider(spec.provider).launch(cluster_name, spec, bench_id)
    get_run_logger().info("launched %s for benchmarks: %s", cluster.name, ", ".join(n.name for n in cluster.nodes))
    return cluster


@task(name="disk-bench", **TRANSIENT_RETRIES)
def disk_bench(cluster: Cluster, node: Node, megabytes: int) -> dict[str, Any]:
    runner = get_provider(cluster.provider).runner(cluster, node)
    result = runner.run([node.python, "-m", "infra.node", "diskbench", "--dir", node.data_dir,
                         "--megabytes", str(megabytes)], timeout=600, on_line=node_line_sink(get_run_logger(),
                                                                                            node.name))
    return {"node": node.name, **last_event(result.output, "diskbench")}


@task(name="publish-bench")
def publish_bench(bench_id: str, disks: list[dict[str, Any]], nodes_left: int) -> None:
    rows = [{"node": d["node"], "write MB/s": d["write_mb_per_s"], "read MB/s": d["read_mb_per_s"],
             "MB": round(d["bytes"] / 1e6, 1)} for d in disks]
    create_table_artifact(rows, key="cluster-bench-disks", description=f"bench {bench_id}: local disk throughput")
    slowest = min(disks, key=lambda d: d["write_mb_per_s"])
    create_markdown_artifact(
        f"# Cluster bench `{bench_id}`\n\n"
        f"* {len(disks)} nodes; slowest disk: **{slowest['node']}** writes {slowest['write_mb_per_s']} MB/s "
        f"(fsync'd), reads {slowest['read_mb_per_s']} MB/s (page cache dropped)\n"
        f"* nodes left running after teardown: {nodes_left}\n",
        key="cluster-bench", description=f"bench {bench_id}")
