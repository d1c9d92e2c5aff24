"""A control plane's outage of its instance reads, as the cloud fakes serve it (tests/aws_server.py, gce_server.py,
azure_arm_server.py, nebius_server.py): server errors first, then throttling, each until a wall-clock end (wall-clock,
not monotonic: the EC2 fake is another process, told through a file).

Only the reads the run's preemption watch makes (liveness, notices) fail; every fake answers its own way, as its cloud
does (tests/test_control_plane_outage.py).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ERRORS, THROTTLED = "errors", "throttled"


@dataclass(frozen=True)
class Outage:
    phases: tuple[tuple[str, float], ...] = ()  # (ERRORS | THROTTLED, until: time.time()), in order

    @classmethod
    def lasting(cls, window_s: float) -> Outage:
        """Server errors for the first half of window_s from now, throttling for the second."""
        now = time.time()
        return cls(((ERRORS, now + window_s / 2), (THROTTLED, now + window_s)))

    def phase(self) -> str | None:
        """What the reads get now: ERRORS, THROTTLED, or None (answered)."""
        now = time.time()
        return next((kind for kind, until in self.phases if now < until), None)

    @property
    def ends_at(self) -> float:
        return max((until for _, until in self.phases), default=0.0)

    def write(self, path: Path) -> None:
        """Replaced whole (rename): the server process never reads half a file."""
        partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        partial.write_text(json.dumps([list(p) for p in self.phases]))
        partial.replace(path)

    @classmethod
    def read(cls, path: Path) -> Outage:
        try:
            return cls(tuple((str(kind), float(until)) for kind, until in json.loads(path.read_text())))
        except FileNotFoundError:
            return cls()


class OutageSwitch:
    """An in-process fake's outage: start() it from the test, phase() in the fake's request handler."""

    def __init__(self) -> None:
        self._outage = Outage()

    def start(self, window_s: float) -> Outage:
        self._outage = Outage.lasting(window_s)
        return self._outage

    def end(self) -> None:
        self._outage = Outage()

    def phase(self) -> str | None:
        return self._outage.phase()
