"""cluster-bench: provision → probe every node → TCP between nodes, all-reduce, every node's disk → teardown (always)
→ publish the figures and the verdict."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, unmapped
from prefect.logging.loggers import flow_run_logger
from prefect.runtime import flow_run as current_flow_run
from prefect.states import State

from infra.compute.spec import ClusterSpec
from infra.job.plan import cluster_name_for
from tasks.bench import launch_bench_cluster, measure_cluster, publish_bench
from tasks.capacity import nodes_held
from tasks.cluster import teardown_cluster
from tasks.verify import enforce_verdict, verify_node


def default_bench_id(flow_run_id: str) -> str:
    return f"bench-{flow_run_id.replace('-', '')[:10]}"


def teardown_bench_on_crash(flow: Any, flow_run: Any, state: State[Any]) -> None:
    """Cancellation and crash skip the flow's finally; the cluster's name follows from the parameters alone."""
    spec = ClusterSpec.model_validate(flow_run.parameters.get("cluster") or {})
    bench_id = flow_run.parameters.get("bench_id") or default_bench_id(str(flow_run.id))
    flow_run_logger(flow_run, flow).warning("bench %s ended %s: tearing down its cluster", bench_id, state.type.value)
    teardown_cluster.fn(spec.provider, cluster_name_for(bench_id))


@flow(name="cluster-bench", on_cancellation=[teardown_bench_on_crash], on_crashed=[teardown_bench_on_crash])
def cluster_bench(cluster: ClusterSpec | None = None, disk_megabytes: int | None = None,
                  bench_id: str | None = None) -> dict[str, Any]:
    """Measure what a cluster of this shape gives a job before paying for a long run on it.

    Args:
        cluster: The cluster to launch (default: 2 local nodes); its verify settings say how long and how much to
            measure, and what the figures are held to (its floors, the catalog, verify.min_fraction).
        disk_megabytes: Size of the file each node writes and reads back on its local disk (default:
            cluster.verify.disk_bytes_mb).
        bench_id: Names the cluster; default derives it from the flow run id.
    """
    spec = cluster or ClusterSpec()
    if disk_megabytes is not None:
        spec = spec.model_copy(update={"verify": spec.verify.model_copy(update={"disk_bytes_mb": disk_megabytes})})
    bench_id = bench_id or default_bench_id(str(current_flow_run.id))
    cluster_name = cluster_name_for(bench_id)
    # Its nodes count against the global node limit like a retrain's, from launch to teardown.
    with nodes_held(spec.nodes):
        try:
            launched = launch_bench_cluster(spec, cluster_name, bench_id)
            verify_node.map(unmapped(launched), launched.nodes,
                            unmapped(spec.verify.disk_bytes_mb * 1024 * 1024)).result()
            result = measure_cluster(launched, spec)
        finally:
            nodes_left = teardown_cluster(spec.provider, cluster_name)
    publish_bench(bench_id, result, nodes_left)
    # Published first: a cluster that misses is exactly the one whose figures someone needs to see.
    enforce_verdict(result, spec.verify.bench, get_run_logger())
    return {"bench_id": bench_id, **result.to_dict(), "nodes_left": nodes_left}
