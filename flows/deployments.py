"""The deployments `trainpipe serve` runs, built from prefect.yaml so served and worker-run deployments never differ."""

from __future__ import annotations

import importlib
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from prefect import Flow
from prefect.client.schemas.objects import ConcurrencyLimitConfig
from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron, Interval, Schedule

PREFECT_YAML = Path(__file__).resolve().parent.parent / "prefect.yaml"
# A fixed anchor keeps interval runs on the same wall-clock grid however often serve restarts.
INTERVAL_ANCHOR = datetime(2024, 1, 1, tzinfo=UTC)


def deployment_configs(path: Path = PREFECT_YAML) -> list[dict[str, Any]]:
    return list(yaml.safe_load(path.read_text())["deployments"])


def entrypoint_flow(entrypoint: str) -> Flow[..., Any]:
    """'flows/retrain.py:retrain' → the flow object, imported as a module so it is the same one tests import."""
    file, name = entrypoint.split(":")
    module = importlib.import_module(file.removesuffix(".py").replace("/", "."))
    return getattr(module, name)


def _schedule(config: dict[str, Any]) -> Schedule:
    if "cron" in config:
        return Cron(config["cron"], timezone=config.get("timezone"))
    if "interval" in config:
        return Interval(timedelta(seconds=config["interval"]), anchor_date=INTERVAL_ANCHOR,
                        timezone=config.get("timezone"))
    raise ValueError(f"prefect.yaml: schedule {config}: use 'cron' or 'interval'")


def served_deployments(path: Path = PREFECT_YAML) -> list[RunnerDeployment]:
    deployments = []
    for config in deployment_configs(path):
        limit = config.get("concurrency_limit")
        deployments.append(entrypoint_flow(config["entrypoint"]).to_deployment(
            name=config["name"],
            description=config.get("description"),
            tags=config.get("tags"),
            parameters=config.get("parameters") or {},
            schedules=[_schedule(s) for s in config.get("schedules") or []],
            concurrency_limit=ConcurrencyLimitConfig(**limit) if limit else None,
            enforce_parameter_schema=config.get("enforce_parameter_schema", True),
        ))
    return deployments
