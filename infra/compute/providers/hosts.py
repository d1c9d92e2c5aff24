"""What providers that reach their machines over SSH (ssh, aws, gcp) share: work on every host at once, and one
host's failure told as the LaunchError that says whether trying again can help."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from infra.compute.access.ssh import HostKeyError, SshAuthError, SshConnectError
from infra.compute.providers.base import InvalidRequestError, LaunchError

T = TypeVar("T")


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


def in_parallel(items: list[T], work: Callable[[T], Any]) -> list[tuple[T, Any, BaseException | None]]:
    """work(item) for every item at once (hosts are independent); (item, result, error) in item order."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(items)), thread_name_prefix="ssh-host") as pool:
        futures = [pool.submit(work, item) for item in items]
    results = []
    for item, future in zip(items, futures, strict=True):
        error = future.exception()
        results.append((item, None if error else future.result(), error))
    return results
