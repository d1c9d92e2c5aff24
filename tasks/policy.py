"""The retry policy tasks share: transient failures only, exponential backoff with jitter, each retry logged."""

from __future__ import annotations

from typing import Any

from prefect import Task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.logging import get_logger
from prefect.states import State
from prefect.tasks import exponential_backoff

from infra.errors import is_transient

log = get_logger("trainpipe.retry")


def retry_if_transient(task: Task[Any, Any], task_run: TaskRun, state: State[Any]) -> bool:
    exc = state.result(raise_on_failure=False)
    retry = isinstance(exc, BaseException) and is_transient(exc)
    if retry:
        log.warning("%s failed transiently (%s: %s): retrying with backoff", task.name, type(exc).__name__, exc)
    return retry


# Side-effectful steps must never be served from a cache, so every task opts out of result caching.
TRANSIENT_RETRIES: dict[str, Any] = {
    "retries": 3,
    "retry_delay_seconds": exponential_backoff(backoff_factor=2),
    "retry_jitter_factor": 0.5,
    "retry_condition_fn": retry_if_transient,
    "cache_policy": NO_CACHE,
}
NO_RETRIES: dict[str, Any] = {"cache_policy": NO_CACHE}
