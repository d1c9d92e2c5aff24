"""Runs `trainpipe run`'s temporary Prefect server as its child, and ends it when that `trainpipe run` is gone.

Prefect stops its temporary server at the command's exit (atexit). A `trainpipe run` killed outright (SIGKILL, the
OOM killer) has no exit, and its server, in a session of its own (trainpipe.prefect_server), ran on for good: one
more uvicorn process and port on the machine for every such night. The guard sits between the two: it watches its
parent (reparented once the run is gone) and forwards a stop to the server; the server gets SIGTERM from the kernel
if the guard itself is killed (PR_SET_PDEATHSIG, set in the server's process before it execs: the guard has one
thread, so the hook is safe there, which it is not in the run's own multi-threaded process).

Stdlib only, started as `python -m trainpipe.server_guard OWNER_PID -- COMMAND...`; it exits with the server's code
(Prefect reads 3 as a port already taken and starts another)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from types import FrameType

PARENT_POLL_S = 1.0
STOP_GRACE_S = 10.0
GRACE_ENV = "TRAINPIPE_SERVER_STOP_GRACE_S"  # the server's grace after a stop (tests shorten it)
PR_SET_PDEATHSIG = 1


def _end_with_me(guard: int) -> None:
    """In the server's process, before exec: SIGTERM when its parent (this guard) dies, however it dies. A guard
    killed between the fork and the prctl is gone before the signal was asked for: then the server ends at once."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent poll below still ends it
        return
    if os.getppid() != guard:
        os.kill(os.getpid(), signal.SIGTERM)


def _stop(server: subprocess.Popen[bytes], grace_s: float) -> int:
    server.terminate()
    try:
        return server.wait(grace_s)
    except subprocess.TimeoutExpired:
        server.kill()
        return server.wait()


def run(owner: int, command: list[str], grace_s: float = STOP_GRACE_S) -> int:
    """owner: the run's pid, this guard's parent (given, not read: the run may be gone by the time this starts).
    A stop forwarded to the server that it has not obeyed within grace_s is made a SIGKILL: a server stuck in its
    shutdown would otherwise keep its port and this guard for good."""
    # preexec_fn is safe here, unlike in the run's process: this one has a single thread.
    guard = os.getpid()
    server = subprocess.Popen(command, preexec_fn=lambda: _end_with_me(guard))
    kill_at: list[float] = []  # when a forwarded stop runs out of grace

    def forward(signum: int, frame: FrameType | None) -> None:
        server.send_signal(signum)
        kill_at.append(time.monotonic() + grace_s)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    while True:
        try:
            code = server.wait(PARENT_POLL_S)
            break
        except subprocess.TimeoutExpired:
            if kill_at and time.monotonic() >= kill_at[0]:
                print(f"trainpipe: the Prefect server did not stop within {grace_s:g}s of the stop: killing it",
                      file=sys.stderr)
                server.kill()
                code = server.wait()
                break
            if os.getppid() != owner:  # the run is gone: nobody will stop its server
                print(f"trainpipe: the run that started this Prefect server (pid {owner}) is gone: stopping it",
                      file=sys.stderr)
                code = _stop(server, grace_s)
                break
    return code if code >= 0 else 128 - code


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[0].isdigit() or argv[1] != "--":
        print("usage: python -m trainpipe.server_guard OWNER_PID -- COMMAND...", file=sys.stderr)
        return 2
    grace_s = float(os.environ.get(GRACE_ENV) or STOP_GRACE_S)
    return run(int(argv[0]), argv[2:], grace_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
