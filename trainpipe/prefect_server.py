"""The temporary Prefect server `trainpipe run` needs when no PREFECT_API_URL is set: Prefect's own public command,
`prefect server start`, run as this process's child on a free loopback port, started while the run is planned (its
start, a process importing Prefect's server, takes longer than planning, and both go on at once on two cores).

PREFECT_API_URL is set to it before Prefect is imported (Prefect reads its settings then), so every client of this
process, the flow's and its log and event workers', talks to it. Its scheduler, late-runs and foreman services are
off (documented settings): a run of the command needs none of them.

The server runs in a session of its own: a Ctrl-C in the terminal (SIGINT to the whole foreground process group)
cancels the run, whose teardown and last reports still need the server. It is stopped at the command's exit (atexit,
registered before Prefect's own handlers, so after Prefect has drained its log and event queues); a run killed
outright has no exit, and the server's guard (trainpipe.server_guard) ends it then. A server that ignores its stop is
killed by the guard after its grace."""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

GUARD = "trainpipe.server_guard"  # ends the server when this process is gone, however it ends
START_TIMEOUT_S = 120.0  # a busy 2-core machine takes ~10 s; Prefect's own 20 s bound was too short there
STOP_TIMEOUT_S = 30.0  # the guard's grace for the server (server_guard.STOP_GRACE_S) and its own exit
HEALTH_POLL_S = 0.2
# Prefect's documented server settings: the services a single run does not use.
QUIET_SERVICES = {"PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
                  "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": "false",
                  "PREFECT_SERVER_SERVICES_FOREMAN_ENABLED": "false",
                  "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                  "PREFECT_UI_ENABLED": "false"}


class ServerStartError(RuntimeError):
    """The temporary server did not come up: one line naming why and where its log is."""


class BackgroundServer:
    def __init__(self) -> None:
        self._guard: subprocess.Popen[bytes] | None = None
        self._health = ""
        self._log: Path | None = None

    def start(self) -> BackgroundServer:
        """Start the temporary server, unless a server is configured (PREFECT_API_URL). Must run before Prefect is
        imported in this process."""
        if os.environ.get("PREFECT_API_URL"):
            return self
        if "prefect" in sys.modules:
            raise RuntimeError("BackgroundServer.start() after Prefect's import: Prefect would not see its URL")
        port = _free_port()
        api = f"http://127.0.0.1:{port}/api"
        self._health = f"{api}/health"
        home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
        home.mkdir(parents=True, exist_ok=True)
        self._log = home / f"trainpipe-server-{port}.log"
        prefect = str(Path(sys.executable).with_name("prefect"))
        command = [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui", "--log-level",
                   "WARNING"]
        with self._log.open("wb") as log:
            self._guard = subprocess.Popen(
                [sys.executable, "-m", GUARD, str(os.getpid()), "--", *command], start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **QUIET_SERVICES})
        os.environ["PREFECT_API_URL"] = api
        atexit.register(self.stop)
        return self

    def wait(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until the server answers its health check; ServerStartError when it exits or stays silent."""
        if self._guard is None:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self._health, timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            code = self._guard.poll()
            if code is not None:
                raise ServerStartError(f"the temporary Prefect server exited {code} before it answered: "
                                       f"{self._tail()} (log: {self._log}); or set PREFECT_API_URL to a server")
            if time.monotonic() >= deadline:
                self.stop()
                raise ServerStartError(f"the temporary Prefect server did not answer within {timeout_s:.0f}s (log: "
                                       f"{self._log}); or set PREFECT_API_URL to a server")
            time.sleep(HEALTH_POLL_S)

    def stop(self) -> None:
        """Stop the server (through its guard, which kills it after its grace) and wait for it; idempotent."""
        guard, self._guard = self._guard, None
        if guard is None:
            return
        if guard.poll() is None:
            guard.terminate()
            try:
                guard.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                guard.kill()  # the server then gets its SIGTERM from the kernel (server_guard._end_with_me)
                guard.wait()
        if guard.returncode in (0, 128 + 15) and self._log is not None:  # stopped as asked (143: by SIGTERM)
            self._log.unlink(missing_ok=True)  # kept only when the server ended badly

    def _tail(self) -> str:
        try:
            lines = [line for line in (self._log.read_text(errors="replace") if self._log else "").splitlines()
                     if line.strip()]
        except OSError:
            return "no output"
        return lines[-1].strip()[:300] if lines else "no output"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
