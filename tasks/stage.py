"""Stage: every node pulls the dataset (and, when resuming, the latest committed checkpoint) to its own disk."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from infra.providers import Cluster, Node, get_provider
from tasks.node_output import last_event, node_line_sink
from tasks.policy import TRANSIENT_RETRIES


@task(name="stage-dataset", **TRANSIENT_RETRIES)
def stage_dataset(cluster: Cluster, node: Node, dataset_url: str, timeout_s: float = 3600) -> dict[str, Any]:
    runner = get_provider(cluster.provider).runner(cluster, node)
    sink = node_line_sink(get_run_logger(), node.name)
    result = runner.run([node.python, "-m", "infra.node", "stage", "--dataset", dataset_url, "--dest", node.data_dir],
                        timeout=timeout_s, on_line=sink)
    return last_event(result.output, "staged")


@task(name="restore-checkpoint", **TRANSIENT_RETRIES)
def restore_checkpoint(cluster: Cluster, node: Node, checkpoint_url: str, timeout_s: float = 3600) -> dict[str, Any]:
    """Download the latest committed checkpoint onto the node; returns its step and local path."""
    runner = get_provider(cluster.provider).runner(cluster, node)
    sink = node_line_sink(get_run_logger(), node.name)
    result = runner.run([node.python, "-m", "infra.node", "restore", "--url", checkpoint_url,
                         "--dest", node.path("restore")], timeout=timeout_s, on_line=sink)
    return last_event(result.output, "restored")
