"""A test's background watcher: `poll()` from a daemon thread every `interval_s` while the `with` block runs (the
flow under test runs in the main thread: it installs signal handlers), until the block ends or poll returns True."""

from __future__ import annotations

import threading
from typing import Self


class Polling:
    interval_s = 0.2

    def poll(self) -> bool | None:
        """One look; True once there is nothing more to watch."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.poll():
                return
