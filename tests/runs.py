"""`trainpipe run` as a user starts it from a terminal, for the tests that signal, race or kill it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, TRAINPIPE


class Run:
    """`trainpipe run` in a session of its own (as a terminal's foreground job is its own process group)."""

    def __init__(self, config: Path, run_id: str, env: dict[str, str], logs: Path) -> None:
        self.stdout, self.stderr = logs / f"{run_id}.out", logs / f"{run_id}.err"
        self.popen = subprocess.Popen([TRAINPIPE, "run", str(config), "--run-id", run_id], cwd=REPO, env=env,
                                      stdout=self.stdout.open("w"), stderr=self.stderr.open("w"),
                                      start_new_session=True)

    def output(self) -> str:
        return self.stdout.read_text(errors="replace") + self.stderr.read_text(errors="replace")

    def running(self) -> bool:
        assert self.popen.poll() is None, "the run ended before the signal:\n" + self.output()[-4000:]
        return True

    def exit_seconds(self, bound_s: float) -> float:
        """Seconds from now until the command exits; past bound_s (plus a margin to report it) the test fails."""
        started = time.monotonic()
        try:
            self.popen.wait(bound_s + 60)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            pytest.fail(f"trainpipe run still running {bound_s + 60:.0f}s after the signal:\n{self.output()[-4000:]}")
        return time.monotonic() - started

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(30)
