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
    # A bound in time rather than in tries: a sidecar rides out an outage of this many seconds, whatever the count.
    give_up_after_s: float | None = None

    def delay_s(self, retry: int) -> float:
        """Exponential backoff with jitter, so parts that failed together do not retry together."""
        ceiling = min(self.max_s, self.base_s * 2 ** (retry - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)


DEFAULT_RETRY = RetryPolicy()


class Cancelled(Exception):
    """Raised inside a worker whose transfer already failed elsewhere; never reaches the caller."""


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def gave_up(what: str, attempts: int, exc: BaseException, spent_s: float | None = None) -> StorageError:
    tries = f"{attempts} times" if spent_s is None else f"for {spent_s:.0f}s ({attempts} tries)"
    return StorageError(f"{what}: failed {tries}, last with {one_line(exc)}: "
                        "check the network and the store, then run again")


def log_retry(what: str, exc: BaseException, attempt: int, policy: RetryPolicy, delay: float) -> None:
    bound = policy.give_up_after_s
    of = str(policy.attempts - 1) if bound is None else f"{bound:g}s"
    log.warning("%s failed (%s): retry %d/%s in %.2fs", what, one_line(exc), attempt, of, delay)


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
    started = time.monotonic()
    while True:
        try:
            return call()
        except Exception as exc:
            if not retryable(exc):
                raise
            bound = policy.give_up_after_s
            spent = time.monotonic() - started
            if bound is None and attempt >= policy.attempts:
                raise gave_up(what, attempt, exc) from exc
            if bound is not None and spent >= bound:
                raise gave_up(what, attempt, exc, spent) from exc
            # The last wait ends at the bound: one more try there, rather than giving up early.
            delay = policy.delay_s(attempt) if bound is None else min(policy.delay_s(attempt), bound - spent)
            log_retry(what, exc, attempt, policy, delay)
            if cancel is None:
                time.sleep(delay)
            elif cancel.wait(delay):
                raise Cancelled(what) from exc
            attempt += 1
