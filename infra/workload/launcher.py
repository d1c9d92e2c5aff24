"""The launcher the node agent starts in the training environment: the standard library only, since it runs under the
user's Python (a container image's, training.python, the node's own), where nothing of trainpipe is installed.

    python launcher.py torchrun <torch.distributed.run's argv>
    python launcher.py exec <argv>

`torchrun` runs torch.distributed.run in this process (runpy), as `torchrun` itself would, and prints the agent's
ranks-exited event line (handed over in LINE_ENV, so the event's spelling stays the agent's) when this node's ranks
all exited 0, before torchrun's exit barrier. `exec` runs one command as a child, handing it SIGTERM and SIGINT.

Either way stdin is the lifeline: the agent holds its write end and never writes. EOF means the agent is gone (killed,
its node lost): the launcher then stops what it started (SIGTERM, then after GRACE_ENV seconds SIGKILL to every process
below it), so a killed agent never leaves ranks running, in a container or not. A stop signal torchrun gets is bounded
the same way: torchrun hands it to its ranks, and whatever still runs GRACE_ENV seconds later is killed.
"""

from __future__ import annotations

import importlib
import os
import runpy
import signal
import subprocess
import sys
import threading
from typing import Any

LINE_ENV = "TRAINPIPE_LAUNCHER_RANKS_EXITED"  # the exact line to print once this node's ranks all exited 0
GRACE_ENV = "TRAINPIPE_LAUNCHER_GRACE_S"  # SIGTERM to SIGKILL, when the lifeline breaks or the timeout passes
TIMEOUT_ENV = "TRAINPIPE_LAUNCHER_TIMEOUT_S"  # exec: stop the command past this (exit 124)
LAUNCHER_VARS = (LINE_ENV, GRACE_ENV, TIMEOUT_ENV)
TORCHRUN_MODULE = "torch.distributed.run"
DEFAULT_GRACE_S = 30.0
TIMED_OUT = 124


def descendants(root: int) -> list[int]:
    """Every process below root, from /proc: torchrun starts each rank in a session of its own, so no process group
    holds them all."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                stat = handle.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the command name, which may hold spaces and parens
        children.setdefault(ppid, []).append(int(entry))
    found, queue = [], [root]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue


class Stopper:
    """Stops what this launcher started: first politely (the command's own SIGTERM handling: torchrun stops its
    ranks, a script saves), then everything below it, firmly."""

    def __init__(self, grace_s: float, terminate: Any) -> None:
        self.grace_s, self.terminate = grace_s, terminate
        self.finished = threading.Event()  # set once the command ended by itself
        self._lock = threading.Lock()
        self._stopping = False

    def stop(self, why: str, code: int) -> None:
        """SIGTERM what runs here (the terminate callable), then the firm end below after grace_s."""
        if self._start_stopping():
            print(f"trainpipe launcher: {why}: stopping", file=sys.stderr, flush=True)
            self.terminate()
            self._kill_after_grace(code)

    def signalled(self, signum: int) -> None:
        """The command was handed a stop signal itself (torchrun passes it to its ranks and waits for them up to
        30 s of its own): the same firm end after grace_s, so a rank hung at exit is gone within the bound the
        orchestrator waits for, rather than outlive the trainer it killed (ranks are in sessions of their own)."""
        if self._start_stopping():
            threading.Thread(target=self._kill_after_grace, args=(128 + signum,), name="stop-grace",
                             daemon=True).start()

    def _start_stopping(self) -> bool:
        with self._lock:
            if self._stopping or self.finished.is_set():
                return False
            self._stopping = True
            return True

    def _kill_after_grace(self, code: int) -> None:
        if self.finished.wait(self.grace_s):
            return
        pids = descendants(os.getpid())
        print(f"trainpipe launcher: still running {self.grace_s:g}s after SIGTERM: killing {len(pids)} processes",
              file=sys.stderr, flush=True)
        _signal_all(pids, signal.SIGKILL)
        os._exit(code)


def watch_lifeline(fd: int, stopper: Stopper) -> None:
    """Read the agent's pipe until EOF (the agent never writes: any bytes are ignored)."""
    def watch() -> None:
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        stopper.stop("the node agent is gone (its pipe closed)", 137)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def take_lifeline() -> int:
    """The lifeline on a private fd; stdin becomes /dev/null, so nothing started here reads (or holds) the pipe."""
    fd = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return fd


def _torchrun_part(module: str, owner: str | None, name: str, without: str) -> Any:
    """What holds torchrun's `name` (the module, or its class `owner`) for a hook to replace; None when torch cannot
    be imported (torch.distributed.run then fails to import, saying why) or this torch has no such part (said: what
    is lost without the hook)."""
    try:
        found: Any = importlib.import_module(module)
    except ImportError:
        return None
    if owner is not None:
        found = getattr(found, owner, None)
    if getattr(found, name, None) is None:
        print(f"trainpipe launcher: torchrun has no {name}: {without}", file=sys.stderr, flush=True)
        return None
    return found


def _bound_signalled_stop(stopper: Stopper) -> None:
    """torchrun's signal handler (installed when it starts the ranks) also arms the stopper's grace."""
    api = _torchrun_part("torch.distributed.elastic.multiprocessing.api", None, "_terminate_process_handler",
                         "a rank that hangs after a stop is killed by torchrun's own 30 s")
    if api is None:
        return
    handler = api._terminate_process_handler

    def bounded(signum: int, frame: Any) -> Any:
        stopper.signalled(signum)
        return handler(signum, frame)

    api._terminate_process_handler = bounded


def _announce_exit_barrier(line: str) -> None:
    """torchrun's agent enters its exit barrier only once its worker group succeeded: say so first."""
    agent = _torchrun_part("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_exit_barrier",
                           "a rank that hangs at exit costs training.timeout_s")
    if agent is None:
        return
    barrier = agent._exit_barrier

    def announcing(self: Any) -> Any:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        return barrier(self)

    agent._exit_barrier = announcing


def _exit_status(code: object) -> int:
    if code is None or isinstance(code, int):
        return int(code or 0)
    print(code, file=sys.stderr)
    return 1


def run_torchrun(argv: list[str], line: str, grace_s: float) -> int:
    stopper = Stopper(grace_s, lambda: os.kill(os.getpid(), signal.SIGTERM))
    watch_lifeline(take_lifeline(), stopper)

    def early_exit(signum: int, _frame: Any) -> None:
        # Until torchrun installs its own handlers (in a container this process is PID 1, where an unhandled SIGTERM
        # would be ignored).
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, early_exit)
    signal.signal(signal.SIGINT, early_exit)
    _bound_signalled_stop(stopper)
    if line:
        _announce_exit_barrier(line)
    sys.argv = [TORCHRUN_MODULE, *argv]
    try:
        runpy.run_module(TORCHRUN_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as exited:
        return _exit_status(exited.code)
    finally:
        stopper.finished.set()
    return 0


def run_exec(argv: list[str], grace_s: float, timeout_s: float | None) -> int:
    try:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    except OSError as exc:
        print(f"trainpipe launcher: cannot start {argv[0]}: {exc.strerror}", file=sys.stderr, flush=True)
        return 127
    stopper = Stopper(grace_s, lambda: _signal_all([child.pid], signal.SIGTERM))
    watch_lifeline(take_lifeline(), stopper)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: _signal_all([child.pid], signum))
    try:
        code = child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # The stopper's SIGKILL path exits the launcher itself (124) if the command outlives its grace.
        threading.Thread(target=stopper.stop, args=(f"{argv[0]} still running after {timeout_s:g}s", TIMED_OUT),
                         daemon=True).start()
        child.wait()
        stopper.finished.set()
        return TIMED_OUT
    stopper.finished.set()
    return code if code >= 0 else 128 - code


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("torchrun", "exec"):
        print("usage: launcher.py {torchrun,exec} ARGV...", file=sys.stderr)
        return 2
    line = os.environ.get(LINE_ENV, "")
    grace_s = float(os.environ.get(GRACE_ENV) or DEFAULT_GRACE_S)
    timeout = os.environ.get(TIMEOUT_ENV)
    for name in LAUNCHER_VARS:  # what the launcher was told is no business of the ranks
        os.environ.pop(name, None)
    if argv[0] == "torchrun":
        return run_torchrun(argv[1:], line, grace_s)
    return run_exec(argv[1:], grace_s, float(timeout) if timeout else None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
