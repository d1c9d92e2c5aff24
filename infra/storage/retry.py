"""Retries of transient storage failures: exponential backoff with jitter, every retry logged."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from infra.errors import is_transient
from infra.storage.base import StorageError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    base_s: float = 0.2
    max_s: float = 10.0

    def delay_s(self, retry: int) -> float:
        """Exponential backoff with jitter, so parts that failed together do not retry together."""
        ceiling = min(self.max_s, self.base_s * 2 ** (retry - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)


DEFAULT_RETRY = RetryPolicy()


class Cancelled(Exception):
    """Raised inside a worker whose transfer already failed elsewhere; never reaches the caller."""


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def gave_up(what: str, attempts: int, exc: BaseException) -> StorageError:
    return StorageError(f"{what}: failed {attempts} times, last with {one_line(exc)}: "
                        "check the network and the store, then run again")


def log_retry(what: str, exc: BaseException, attempt: int, policy: RetryPolicy, delay: float) -> None:
    log.warning("%s failed (%s): retry %d/%d in %.2fs", what, one_line(exc), attempt, policy.attempts - 1, delay)


def call_with_retries(
    call: Callable[[], T],
    what: str,
    policy: RetryPolicy = DEFAULT_RETRY,
    cancel: threading.Event | None = None,
    retryable: Callable[[BaseException], bool] = is_transient,
) -> T:
    """call(), retried with backoff while it fails transiently (or as retryable says); what names the operation in
    logs and errors."""
    attempt = 1
    while True:
        try:
            return call()
        except Exception as exc:
            if not retryable(exc):
                raise
            if attempt >= policy.attempts:
                raise gave_up(what, attempt, exc) from exc
            delay = policy.delay_s(attempt)
            log_retry(what, exc, attempt, policy, delay)
            if cancel is None:
                time.sleep(delay)
            elif cancel.wait(delay):
                raise Cancelled(what) from exc
            attempt += 1
