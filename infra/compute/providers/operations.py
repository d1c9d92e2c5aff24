"""The two waits every cloud API client makes: one call repeated while it fails transiently, and a long-running
operation polled until it is done. Both back off exponentially, log each retry, have a deadline and end at the run's
cancellation (infra.cancel)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from infra.cancel import CANCEL
from infra.compute.providers.base import LaunchError
from infra.compute.providers.cloud_errors import retry_later

log = logging.getLogger(__name__)

T = TypeVar("T")

# The preemption watch's reads (liveness, notices): asked once, within WATCH_TIMEOUT_S. The watch asks again on a
# backoff of its own (infra/lifecycle/preemption_watch.py) and judges a silent control plane by how long it stays
# silent; retries under a read would only block its round, with the wait loop behind it (15 s of backoff per read
# on GCP and Nebius, up to 20 s a retry on AWS, a throttle's Retry-After per retry on Azure).
WATCH_ATTEMPTS, WATCH_TIMEOUT_S = 1, 20.0


def call_retrying(call: Callable[[], T], transient: Callable[[BaseException], bool],
                  describe: Callable[[BaseException], str], what: str, attempts: int, first_s: float) -> T:
    """call(), repeated after first_s, 2*first_s… while it raises what `transient` says a repeat may get past, at most
    `attempts` times in all; any other failure, and the last, is raised. Each retry is logged as `what` (cloud:
    doing) with `describe`'s line for the failure."""
    attempt = 1
    while True:
        try:
            return call()
        except Exception as exc:
            if attempt >= attempts or not transient(exc):
                raise
            delay = first_s * 2 ** (attempt - 1)
            log.warning("%s: transient %s: retry %d of %d in %.1fs", what, describe(exc)[:300], attempt,
                        attempts - 1, delay)
            CANCEL.wait(delay)
            attempt += 1


def wait_done(operation: T, done: Callable[[T], bool], refresh: Callable[[T], T], what: str, wait_s: float,
              first_s: float, max_s: float) -> T:
    """The operation once done(operation), refreshed from first_s apart, doubling up to max_s. Not done after wait_s:
    a LaunchError worth a later try, naming `what` (cloud: doing: the operation)."""
    deadline = time.monotonic() + wait_s
    delay = first_s
    while not done(operation):
        if time.monotonic() > deadline:
            raise retry_later(f"{what} not done after {wait_s:.0f}s: retry later")
        CANCEL.wait(delay)
        delay = min(delay * 2, max_s)
        operation = refresh(operation)
    return operation


def raise_first(failures: Sequence[LaunchError], doing: str) -> None:
    """Of operations that ran together (one per node), the first failure raised and the others logged."""
    for other in failures[1:]:
        log.warning("%s: another operation failed too: %s", doing, other)
    if failures:
        raise failures[0]
