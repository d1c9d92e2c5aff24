"""The command line of every process on this machine (the sshd host of the ssh tests), sampled on a thread while a
run goes on: what any user of a node can read (/proc/*/cmdline, ps), searched for secrets."""

from __future__ import annotations

import threading
from types import TracebackType

import psutil


class CommandLineScan:
    def __init__(self, needles: dict[str, str], interval_s: float = 0.2) -> None:
        self.needles = needles
        self.interval_s = interval_s
        self.command_lines: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="cmdline-scan", daemon=True)

    def __enter__(self) -> CommandLineScan:
        self._thread.start()
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            for process in psutil.process_iter(["cmdline"]):
                self.command_lines.add("\0".join(process.info["cmdline"] or []))

    def hits(self) -> list[tuple[str, str]]:
        """(secret name, the start of the command line holding it)."""
        return [(name, line[:120]) for line in self.command_lines for name, needle in self.needles.items()
                if needle in line]

    def saw(self, fragment: str) -> bool:
        return any(fragment in line for line in self.command_lines)
