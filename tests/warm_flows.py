"""Flow processes for tests that start many of them (and kill most): each is forked from one interpreter that has
already imported the flows and what they import on first use (Prefect, Great Expectations), as a long-running
worker's interpreter would have. Those imports cost several seconds of CPU per process on a small machine; the flow
each child then runs is the real one, unmodified, from its first line.

The server (`python tests/warm_flows.py`) reads one JSON request a line on stdin, {"flow": "retrain" | "bench",
"config": PATH, "id": RUN_OR_BENCH_ID, "log": PATH, "env": {...}}, forks, and answers {"pid": PID}. The child leads a
session of its own (os.setsid: kill it with its whole process group), writes stdout and stderr to the log, and exits
with 0 when the flow completed, 1 when it raised. Children are reaped by the kernel (SIGCHLD ignored in the server),
so a pid that no longer exists is a flow that ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parent.parent


def _run(request: dict[str, object]) -> int:
    from infra.job.spec import load_job

    job = load_job(str(request["config"]))
    if request["flow"] == "retrain":
        from flows.retrain import retrain

        retrain(job, str(request["id"]))
    else:
        from flows.cluster_bench import cluster_bench

        cluster_bench(job.cluster, bench_id=str(request["id"]))
    return 0


def _child(request: dict[str, object]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the flow waits for the processes it starts
    os.setsid()
    os.environ.update({str(k): str(v) for k, v in dict(request.get("env") or {}).items()})
    log = os.open(str(request["log"]), os.O_WRONLY | os.O_APPEND)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdin = open(0)  # noqa: SIM115 - the process's own, for its whole life
    sys.stdout = open(1, "w", buffering=1)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1)  # noqa: SIM115
    code = 1
    try:
        code = _run(request)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    # Imported once, here, for every child: the flows, and what the plan's dataset validation imports on first use.
    import great_expectations  # noqa: F401

    import flows.cluster_bench
    import flows.retrain  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)


class WarmFlows:
    """The test side: start flows, each in a process forked from the warm server."""

    def __init__(self, env: dict[str, str]) -> None:
        self._server = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], cwd=REPO, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        start_new_session=True)
        assert self._read(self._server.stdout) == {"ready": True}

    @staticmethod
    def _read(stream: IO[str] | None) -> dict[str, object]:
        assert stream is not None
        line = stream.readline()
        assert line, "the warm flow server died"
        return dict(json.loads(line))

    def start(self, flow: str, config: Path, run_id: str, log: Path, env: dict[str, str] | None = None) -> int:
        assert self._server.stdin is not None
        log.write_text("")  # there from the start, for whoever reads it
        self._server.stdin.write(json.dumps({"flow": flow, "config": str(config), "id": run_id, "log": str(log),
                                             "env": env or {}}) + "\n")
        self._server.stdin.flush()
        return int(self._read(self._server.stdout)["pid"])  # type: ignore[call-overload]

    def close(self) -> None:
        if self._server.stdin is not None:
            self._server.stdin.close()
        self._server.wait(timeout=30)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def warm_flows(env: dict[str, str]) -> Iterator[WarmFlows]:
    server = WarmFlows(env)
    try:
        yield server
    finally:
        server.close()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    serve()
