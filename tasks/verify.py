"""Verify: every node answers, its dirs are writable and it has room for the dataset."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from infra.providers import Cluster, Node, get_provider
from tasks.node_output import last_event
from tasks.policy import TRANSIENT_RETRIES


class NodeCheckError(RuntimeError):
    pass


@task(name="verify-node", **TRANSIENT_RETRIES)
def verify_node(cluster: Cluster, node: Node, need_bytes: int) -> dict[str, Any]:
    runner = get_provider(cluster.provider).runner(cluster, node)
    result = runner.run([node.python, "-m", "infra.node", "probe", "--dir", node.data_dir, "--dir", node.ckpt_dir,
                         "--need-bytes", str(need_bytes)], timeout=120, check=False)
    probe = last_event(result.output, "probe")
    if probe["problems"]:
        raise NodeCheckError(f"{node.name}: " + "; ".join(probe["problems"]))
    get_run_logger().info("%s ok: python %s, %s cpus, %.1f GB free for data", node.name, probe["python"],
                          probe["cpus"], probe["free_bytes"][node.data_dir] / 1e9)
    return probe
