"""Which failures are worth retrying: the same rule for every retry loop in trainpipe."""

from __future__ import annotations


def is_transient(exc: BaseException | None) -> bool:
    """Timeouts, dropped connections and errors that declare themselves transient (capacity, throttling)."""
    if exc is None:
        return False
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    return getattr(exc, "transient", False) is True
