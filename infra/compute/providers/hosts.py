"""What providers that reach their machines over SSH (ssh, aws, gcp) share: work on every host at once, and one
host's failure told as the LaunchError that says whether trying again can help."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

from infra.cancel import CANCEL
from infra.compute.access.ssh.connection import HostKeyError, SshAuthError, SshConnectError
from infra.compute.providers.base import InvalidRequestError, LaunchError

T = TypeVar("T")
_CANCEL_POLL_S = 0.2  # how soon the caller stops waiting on its workers after a cancel


class HostUnreachableError(LaunchError):
    """The host did not answer over SSH; it may later (a reboot)."""

    transient = True


def launch_error(exc: BaseException) -> LaunchError:
    """The failure of one host as the LaunchError that says whether trying again can help."""
    if isinstance(exc, LaunchError):
        return exc
    if isinstance(exc, HostKeyError | SshAuthError):
        return InvalidRequestError(str(exc))
    if isinstance(exc, SshConnectError):
        return HostUnreachableError(str(exc))
    return LaunchError(str(exc))


def in_parallel(items: list[T], work: Callable[[T], Any], within_s: float | None = None,
                ) -> list[tuple[T, Any, BaseException | None]]:
    """work(item) for every item at once (hosts are independent); (item, result, error) in item order.

    A cancel (infra.cancel) ends the wait at once with Cancelled; the workers stop at their own next wait, which
    checks the same token. Workers started by a teardown are teardown too: a cancel does not stop them.
    within_s: the wait ends then; an item still being worked on has a TimeoutError, its worker left to end on its
    own bound (a read that must not hold a watch up on one host that stopped answering)."""
    if not items:
        return []
    deadline = None if within_s is None else time.monotonic() + within_s
    pool = ThreadPoolExecutor(max_workers=min(16, len(items)), thread_name_prefix="ssh-host")
    futures = [pool.submit(CANCEL.carried(work), item) for item in items]
    try:
        pending = futures
        while pending and (deadline is None or time.monotonic() < deadline):
            poll_s = _CANCEL_POLL_S if deadline is None else max(0.0, min(_CANCEL_POLL_S, deadline - time.monotonic()))
            pending = list(wait(pending, timeout=poll_s).not_done)
            CANCEL.check()  # workers a cancel stopped raised Cancelled: so does the wait for them
    except BaseException as exc:
        CANCEL.interrupted(exc)  # a SIGTERM through Prefect's handler: the workers stop too
        raise
    finally:
        # On a cancel (or past within_s), the caller need not wait for workers still inside a connect attempt.
        late = deadline is not None and any(not future.done() for future in futures)
        pool.shutdown(wait=not late and (not CANCEL.cancelled or CANCEL.shielded), cancel_futures=True)
    results = []
    for item, future in zip(items, futures, strict=True):
        if not future.done():
            results.append((item, None, TimeoutError(f"no answer within {within_s:g}s")))
            continue
        error = future.exception()
        results.append((item, None if error else future.result(), error))
    return results
