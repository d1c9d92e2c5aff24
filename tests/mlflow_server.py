"""A real `mlflow server` on loopback for the tracking tests: SQLite backend, local artifact root, one per module.

The server runs from the test venv's own `mlflow` (the full package installs next to Prefect 3.9.1 without moving its
pins: see pyproject's test extra). It can be stopped and started again on the same port and database, as an outage.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

START_DEADLINE_S = 180.0  # a cold start runs the SQLite migrations: ~20 s on 2 busy cores
STOP_DEADLINE_S = 20.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MlflowServer:
    """One server's process, its port, database and artifact root; start() and stop() may be repeated."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root, self.port = root, port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        root.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        mlflow = Path(sys.executable).with_name("mlflow")
        log = (self.root / "server.log").open("ab")
        self.process = subprocess.Popen(
            [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts"), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MLFLOW_TRACKING_URI": ""})
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.process.returncode}: see {self.root / 'server.log'}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    healthy = answer.status == 200
            except OSError:
                healthy = False
            if healthy:
                # The first API call of a fresh server loads its stores (seconds on 2 busy cores): paid here, not
                # by a test's client with its short timeouts.
                first_call = f"{self.uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default"
                with urllib.request.urlopen(first_call, timeout=START_DEADLINE_S) as answer:
                    answer.read()
                return
            time.sleep(0.2)  # polling the health endpoint: the server says nothing else when it is up
        self.stop()
        raise RuntimeError(f"mlflow server not up after {START_DEADLINE_S:g}s: see {self.root / 'server.log'}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)  # its own session: the uvicorn workers go with it
        try:
            process.wait(STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(STOP_DEADLINE_S)


@contextmanager
def mlflow_server(root: Path) -> Iterator[MlflowServer]:
    server = MlflowServer(root)
    server.start()
    try:
        yield server
    finally:
        server.stop()
