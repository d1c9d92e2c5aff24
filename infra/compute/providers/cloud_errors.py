"""What every cloud's errors module shares when it turns an SDK failure into the launch error failover acts on: the
refused-credentials class, the one-line wording, and the failures another try may get past. Each cloud keeps its own
code tables and its own order of judging them in its errors module."""

from __future__ import annotations

from infra.compute.providers.base import InvalidRequestError, LaunchError


class AuthError(InvalidRequestError):
    """The credentials cannot do this: nothing elsewhere will succeed either."""


def one_line(text: str) -> str:
    return " ".join(text.split())


def retry_later(message: str) -> LaunchError:
    """A failure of the cloud's API or of the way to it (not a refusal of the launch): a later try may succeed."""
    error = LaunchError(message)
    error.transient = True
    return error


def unreachable(cloud: str, doing: str, detail: str) -> LaunchError:
    """A connection drop or timeout that outlived the SDK's own retries; `detail` names the exception."""
    return retry_later(f"{cloud}: {doing} failed: {detail}: check the network and retry")
