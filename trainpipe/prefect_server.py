"""The temporary Prefect server `trainpipe run` needs when no PREFECT_API_URL is set, started while the run is
planned: its start (a uvicorn process importing Prefect's server) takes longer than planning, and both can go on at
once on two cores instead of one after the other.

The server runs in a session of its own: a Ctrl-C in the terminal (SIGINT to the whole foreground process group)
cancels the run, whose teardown and last reports still need the server. Prefect stops it at the command's exit, after
its log and event queues are drained (those drain at thread shutdown, before atexit); a run killed outright has no
exit, and the server's guard (trainpipe.server_guard) ends it then."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from types import SimpleNamespace
from typing import Any

STARTING = "Starting temporary server"
GUARD = "trainpipe.server_guard"  # ends the server when this process is gone, however it ends


class _Quiet(logging.Filter):
    """Prefect announces its temporary server on stderr: `trainpipe run` promises one line there for bad input."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(STARTING)


class BackgroundServer:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> BackgroundServer:
        """Start the temporary server on a thread, unless a server is configured (PREFECT_API_URL)."""
        if os.environ.get("PREFECT_API_URL"):
            return self
        logging.getLogger("prefect").addFilter(_Quiet())
        self._thread = threading.Thread(target=self._start, name="prefect-server-start", daemon=True)
        self._thread.start()
        return self

    def _start(self) -> None:
        try:
            from prefect.server.api.server import SubprocessASGIServer

            # The same instance Prefect's client finds later: it reuses the running server instead of starting one.
            server = SubprocessASGIServer()
            _in_own_session(server)
            server.start()
        except BaseException as exc:  # handed to the caller's thread by wait()
            self._error = exc

    def stop(self) -> None:
        """Not needed after all: wait for the start to end, then stop the server."""
        if self._thread is None:
            return
        self._thread.join()
        from prefect.server.api.server import SubprocessASGIServer

        SubprocessASGIServer().stop()

    def wait(self) -> None:
        """Block until the server answers; its start's failure is raised here."""
        if self._thread is None:
            return
        self._thread.join()
        if self._error is not None:
            raise self._error


def _guarded(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """The server's command under trainpipe.server_guard, in a session of its own."""
    return subprocess.Popen([sys.executable, "-m", GUARD, str(os.getpid()), "--", *args], start_new_session=True,
                            **kwargs)


def _in_own_session(server: Any) -> None:
    """Prefect starts the server with a bare subprocess.Popen (no way to ask for a session or a guard): its module
    sees one that starts the server guarded, in a new session, for that call only (its restart on a taken port
    included)."""
    from prefect.server.api import server as api

    start = server._run_uvicorn_command

    def own_session() -> subprocess.Popen[Any]:
        api.subprocess = SimpleNamespace(Popen=_guarded, TimeoutExpired=subprocess.TimeoutExpired)
        try:
            return start()
        finally:
            api.subprocess = subprocess

    server._run_uvicorn_command = own_session
