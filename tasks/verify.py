"""Verify: every node answers, its dirs are writable and it has room for the dataset; its training environment has
torch; the cluster delivers the network and disk throughput the job pays for."""

from __future__ import annotations

import logging
from typing import Any

from prefect import get_run_logger, task

from infra.analysis import clusterbench
from infra.analysis.clusterbench import BenchResult, VerifyBench
from infra.compute.providers import Cluster, Node, agent_for
from infra.dataset.stagecache import node_cache_dir
from infra.job.environment import training_environment
from infra.job.spec import JobSpec
from infra.node.events import NodeEvent, event_line, parse
from infra.node.protocol import EnvironmentKind, ExecRequest, ProbeRequest
from tasks.node_output import last_event, node_line_sink
from tasks.policy import TRANSIENT_RETRIES
from tasks.results import Probe


class NodeCheckError(RuntimeError):
    pass


ENV_CHECK_TIMEOUT_S = 600.0  # importing torch on a cold node (and a container's first start) takes a while
TORCH_FIX = "set training.python to an interpreter with torch, or training.image"


def environment_check(python: str) -> tuple[str, ...]:
    """The check's argv: the interpreter imports torch and prints the TRAINING_ENV event (spelled here, since the
    training environment cannot import the agent's events module)."""
    template = event_line(NodeEvent.TRAINING_ENV, python="PY", torch="TORCH")
    source = ("import json, sys\nimport torch\n"
              f"line = json.loads({template!r})\n"
              "line.update(python=sys.executable, torch=torch.__version__)\n"
              "print(json.dumps(line), flush=True)\n")
    return (python, "-c", source)


@task(name="verify-training-env", **TRANSIENT_RETRIES)
def check_training_env(job: JobSpec, cluster: Cluster, node: Node) -> dict[str, str]:
    """probe_training_env on the node, at verify; a container image is checked once it is pulled, beside staging
    (tasks/workload.prepare_node), so the pull is not paid for here: then {}."""
    if training_environment(job, cluster, node).kind is EnvironmentKind.CONTAINER:
        return {}
    return probe_training_env(job, cluster, node)


def probe_training_env(job: JobSpec, cluster: Cluster, node: Node) -> dict[str, str]:
    """The node's training environment can run the job: its interpreter exists and imports torch. Nothing is
    installed anywhere; a node that cannot fails in one line naming the node, the interpreter or image and the fix.
    Returns python (as the environment names itself) and torch (its version)."""
    environment = training_environment(job, cluster, node)
    request = ExecRequest(argv=environment_check(environment.python), training_env=environment, cwd=node.workdir,
                          timeout_s=ENV_CHECK_TIMEOUT_S)
    result = agent_for(cluster, node).run(request, timeout=ENV_CHECK_TIMEOUT_S + 60, check=False)
    found = next((event for event in map(parse, reversed(result.output.splitlines()))
                  if event is not None and event.kind is NodeEvent.TRAINING_ENV), None)
    if result.returncode != 0 or found is None:
        lines = [line.strip() for line in result.output.splitlines() if line.strip()]
        why = next((line for line in reversed(lines) if "Error" in line or "error" in line),
                   lines[-1] if lines else f"exit {result.returncode}")
        raise NodeCheckError(f"{node.name}: {environment.label} cannot import torch ({why}): {TORCH_FIX}")
    get_run_logger().info("%s: training environment %s: torch %s", node.name, environment.label, found["torch"])
    return {"python": str(found["python"]), "torch": str(found["torch"])}


@task(name="verify-node", **TRANSIENT_RETRIES)
def verify_node(cluster: Cluster, node: Node, need_bytes: int, budget: str | None = None) -> Probe:
    """need_bytes: what the node will hold (its disk budget's total; budget: its terms, named if it does not fit);
    its cached objects count as free (reused or evicted)."""
    request = ProbeRequest(dirs=(node.data_dir, node.ckpt_dir), need_bytes=need_bytes,
                           cache=node_cache_dir(cluster.provider, node.workdir), budget=budget)
    result = agent_for(cluster, node).run(request, timeout=120, check=False)
    probe = Probe.from_event(last_event(result.output, NodeEvent.PROBE))
    if probe.problems:
        raise NodeCheckError(f"{node.name}: " + "; ".join(probe.problems))
    get_run_logger().info("%s ok: python %s, %s cpus, %.1f GB free for data", node.name, probe.python,
                          probe.cpus, probe.free_bytes[node.data_dir] / 1e9)
    return probe


class ClusterBenchError(RuntimeError):
    """The cluster missed what the job pays for and cluster.verify.bench is fail: one line per missed figure."""


def enforce_verdict(result: BenchResult, mode: str, logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    """Log every figure against what it was held to; a miss raises when mode is fail and warns otherwise."""
    verdict = result.verdict
    for line in verdict.lines():
        logger.info("cluster bench: %s", line)
    if verdict.ok:
        logger.info("cluster bench: ok, %d figures checked in %.0fs", len(verdict.checks), result.measurement.seconds)
        return
    if mode == "fail":
        raise ClusterBenchError(verdict.failure_message())
    logger.warning("%s\n(cluster.verify.bench is %s: going on)", verdict.failure_message(), mode)


@task(name="bench-cluster", **TRANSIENT_RETRIES)
def bench_cluster(job: JobSpec, cluster: Cluster) -> VerifyBench:
    """Measure node-to-node TCP, all-reduce and local disk throughput, and hold them to the floors and the catalog.

    Retried only on transient errors (a dropped connection to a node); a verdict is never retried. The run summary
    keeps the record; its cluster_bench section is the record's to_dict().
    """
    logger = get_run_logger()
    mode = job.cluster.verify.bench
    if mode == "off":
        logger.info("cluster bench skipped: cluster.verify.bench is off")
        return VerifyBench(mode)
    result = clusterbench.bench_cluster(cluster, job.cluster, sink_for=lambda label: node_line_sink(logger, label),
                                        environment=lambda node: training_environment(job, cluster, node),
                                        say=lambda message: logger.info("cluster bench: %s", message))
    enforce_verdict(result, mode, logger)
    return VerifyBench(mode, result)
