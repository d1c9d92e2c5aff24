"""Sweep: tear down what dead runs left behind, logging each cluster it takes down."""

from __future__ import annotations

from prefect import get_run_logger, task

from infra.compute.providers import ClusterRecord
from infra.lifecycle.sweep import sweep_clusters
from tasks.policy import NO_RETRIES


@task(name="sweep-clusters", **NO_RETRIES)
def sweep_orphaned_clusters(include_alive: bool = False) -> list[str]:
    logger = get_run_logger()

    def say(record: ClusterRecord) -> None:
        logger.warning("tearing down %s (%s, run %s, %d processes): its run is gone", record.name, record.provider,
                       record.run_id, record.processes)

    swept = sweep_clusters(include_alive=include_alive, on_cluster=say)
    logger.info("swept %d clusters", len(swept))
    return [record.name for record in swept]
