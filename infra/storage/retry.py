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


def call_with_retries(
    call: Callable[[], T],
    what: str,
    policy: RetryPolicy = DEFAULT_RETRY,
    cancel: threading.Event | None = None,
) -> T:
    """call(), retried with backoff while it fails transiently; what names the operation in logs and errors."""
    attempt = 1
    started = time.monotonic()
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            bound = policy.give_up_after_s
            spent = time.monotonic() - started
            if (attempt >= policy.attempts) if bound is None else (spent >= bound):
                tries = f"{attempt} times" if bound is None else f"for {spent:.0f}s ({attempt} tries)"
                raise StorageError(
                    f"{what}: failed {tries}, last with {one_line(exc)}: check the network and the store, then run "
                    "again"
                ) from exc
            # The last wait ends at the bound: one more try there, rather than giving up early.
            delay = policy.delay_s(attempt) if bound is None else min(policy.delay_s(attempt), bound - spent)
            log.warning(
                "%s failed (%s): retry %d/%s in %.2fs", what, one_line(exc), attempt,
                policy.attempts - 1 if bound is None else f"{bound:g}s", delay
            )
            if cancel is None:
                time.sleep(delay)
            elif cancel.wait(delay):
                raise Cancelled(what) from exc
            attempt += 1
