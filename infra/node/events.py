"""Node commands report to the orchestrator as one JSON object per stdout line."""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def emit(event: str, **fields: Any) -> None:
    # One write per line: a sidecar's background thread (infra/node/replica.py) emits too, and print's separate
    # write of the newline could interleave two events on one line.
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def parse(line: str) -> dict[str, Any] | None:
    """The event a line carries, or None for ordinary output."""
    if not line.startswith('{"event"'):
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


class Throttle:
    """Lets an action through at most once per interval, so progress never floods the logs."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last = 0.0

    def ready(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return False
        self._last = now
        return True


def fail(message: str, code: int = 1) -> int:
    print(message, file=sys.stderr, flush=True)
    return code
