"""Run commands on a node and move small files to and from it, whatever the node is.

The local runner uses subprocesses; an SSH runner (paramiko) implements the same methods, so tasks
never branch on where a node lives. Bulk data never goes through here: nodes move it themselves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from infra.cancel import CANCEL, Cancelled

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.5  # a command's wait asks the cancel token this often
CANCEL_GRACE_S = 2.0  # a cancelled run's command gets this long to end on SIGTERM: its node is being torn down

LineSink = Callable[[str], None]


class RemoteError(Exception):
    """A node command failed; the message names the node, the command and its last output."""


class CommandTimedOut(RemoteError):
    """A node command still ran at its bound (and was ended): the node, or what starts commands on it, did not
    answer in time; not a command that failed."""


@dataclass(frozen=True)
class RunResult:
    """A finished node command: its exit status and what it printed (stdout and stderr together)."""

    returncode: int
    output: str


class Process(ABC):
    """A command running in the background on a node."""

    @abstractmethod
    def poll(self) -> int | None: ...

    @abstractmethod
    def wait(self, timeout: float | None = None) -> int:
        """Exit code; raises TimeoutError when still running after timeout seconds."""

    @abstractmethod
    def terminate(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the whole process group, SIGKILL after grace_s; returns the exit code if it ended."""

    @abstractmethod
    def tail(self, lines: int = 20) -> str:
        """The last lines it printed (stdout and stderr together)."""


class Runner(ABC):
    """How the orchestrator reaches one node."""

    node_name: str

    @abstractmethod
    def start(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, on_line: LineSink | None = None,
              log_path: str | None = None, cwd: str | None = None) -> Process:
        """Start argv on the node (in cwd, default the node's workdir); its output goes to on_line and log_path."""

    @abstractmethod
    def write_text(self, path: str, text: str) -> None:
        """Write a small file on the node atomically."""

    @abstractmethod
    def read_text(self, path: str) -> str | None:
        """A small file's text, or None when it does not exist."""

    @abstractmethod
    def read_from(self, path: str, offset: int) -> bytes | None:
        """What a file holds from offset on (b"" when nothing new), or None when it does not exist: how a file
        another process appends to is followed."""

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None,
            on_line: LineSink | None = None, check: bool = True, cwd: str | None = None) -> RunResult:
        process = self.start(argv, env=env, on_line=on_line, cwd=cwd)
        try:
            code = wait_cancellable(process, timeout)
        except Cancelled:
            process.terminate(grace_s=CANCEL_GRACE_S)
            raise
        except TimeoutError:
            process.terminate()
            raise CommandTimedOut(f"{self.node_name}: '{_short(argv)}' still running after {timeout:.0f}s: "
                                  "raise the timeout or check the node") from None
        self._check_ended(process, argv)
        output = process.tail(10_000)
        if check and code != 0:
            raise RemoteError(f"{self.node_name}: '{_short(argv)}' exited {code}: {_last_line(output)}")
        return RunResult(code, output)


    def _check_ended(self, process: Process, argv: Sequence[str]) -> None:  # noqa: B027 - a hook, empty by default
        """After a command ended: a runner whose transport can fail (ssh) raises here when it did."""


def last_error(process: Process, own_markers: Sequence[str], lines: int = 300) -> str:
    """A node command's own one-line error (a line holding one of own_markers) when it printed one, else the
    last line that looks like an error, else its last line."""
    kept = [line.strip() for line in process.tail(lines).splitlines() if line.strip()]
    ours = [line for line in kept if any(marker in line for marker in own_markers)]
    errors = [line for line in kept if "Error" in line or "error" in line]
    return (ours or errors or kept or ["(no output)"])[-1]


def wait_cancellable(process: Process, timeout: float | None) -> int:
    """process.wait(timeout), in slices: a cancel (infra.cancel) ends it with Cancelled, not after the timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        CANCEL.check()
        left = CANCEL_POLL_S if deadline is None else min(CANCEL_POLL_S, deadline - time.monotonic())
        try:
            return process.wait(max(0.0, left))
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise


def wait_all(processes: Mapping[str, Process], deadline: float, *, failed: Callable[[str, int, Process], Exception],
             overdue: Callable[[list[str]], Exception], poll: Callable[[], None] | None = None,
             interval_s: float = 0.5, stragglers: Callable[[list[str]], bool] | None = None) -> list[str]:
    """Wait for every node's process until the monotonic deadline; the first that fails raises failed(...), the
    deadline raises overdue(names still running); poll runs each round. The caller stops whatever is left.

    stragglers(names still running) is asked each round: True ends the wait early and returns those names (processes
    that hang at exit once the work is done: the caller decides, and stops them). Returns [] when every process
    exited 0."""
    pending = dict(processes)
    while pending:
        if poll is not None:
            poll()
        for name, process in list(pending.items()):
            code = process.poll()
            if code is None:
                continue
            del pending[name]
            if code != 0:
                raise failed(name, code, process)
        if not pending:
            break
        if stragglers is not None and stragglers(list(pending)):
            return list(pending)
        if time.monotonic() > deadline:
            raise overdue(list(pending))
        CANCEL.wait(interval_s)
    return []


def stop_all(processes: Mapping[str, Process], grace_s: float) -> dict[str, int | None]:
    """SIGTERM every process at once, then SIGKILL what is left after grace_s: one bound for all, however many.

    Stopping them one after another would give N nodes up to N × grace_s, and a script whose last save on SIGTERM is
    collective (a DCP save needs every rank) would wait on ranks not yet signalled until it is killed. Returns each
    process's exit code (None when it could not be told)."""
    if not processes:
        return {}
    with ThreadPoolExecutor(max_workers=len(processes), thread_name_prefix="stop") as pool:
        stopping = {name: pool.submit(process.terminate, grace_s) for name, process in processes.items()}
        return {name: future.result() for name, future in stopping.items()}


def _short(argv: Sequence[str]) -> str:
    text = " ".join(argv)
    return text if len(text) < 120 else text[:117] + "..."


def _last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


class OutputLines:
    """A command's output lines as they are read: the tail kept at once, each line handed to on_line by a thread of
    its own. The reader never waits on the sink (a log handler on a loaded machine, the Prefect logger under 16
    nodes' progress), so when the command has exited its tail is whole: before, a reader held up by the sink was
    still lines behind when the wait gave up on it, and a node's last event (`staged`) was missing from its output."""

    FORWARD_DRAIN_S = 30.0  # how long a finished command's wait lets the sink catch up with what was read

    def __init__(self, on_line: LineSink | None, keep: int = 2000, name: str = "output") -> None:
        self._lines: list[str] = []
        self._keep = keep
        self._on_line = on_line
        self._changed = threading.Condition()
        self._added = self._forwarded = 0
        self._pending: list[str | None] = []
        if on_line is not None:
            threading.Thread(target=self._forward, name=f"{name}-lines", daemon=True).start()

    def add(self, line: str) -> None:
        with self._changed:
            self._lines.append(line)
            del self._lines[: -self._keep]
            if self._on_line is not None:
                self._added += 1
                self._pending.append(line)
                self._changed.notify_all()

    def close(self) -> None:
        """Nothing more will be read: the forwarder ends once it has handed on every line."""
        with self._changed:
            self._pending.append(None)
            self._changed.notify_all()

    def _forward(self) -> None:
        assert self._on_line is not None
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._pending))
                line = self._pending.pop(0)
            if line is None:
                return
            try:
                self._on_line(line)
            except Exception:  # a broken log sink must not kill the command it watches
                log.exception("line sink failed on %r", line)
            with self._changed:
                self._forwarded += 1
                self._changed.notify_all()

    def drain(self, timeout: float = FORWARD_DRAIN_S) -> None:
        """Wait (at most timeout) until every line read so far has been handed to on_line."""
        with self._changed:
            target = self._added
            self._changed.wait_for(lambda: self._forwarded >= target, timeout)

    def tail(self, lines: int) -> str:
        with self._changed:
            return "\n".join(self._lines[-lines:])


class _OutputPump:
    """Reads a process's output on a thread so it never blocks on a full pipe, keeps a tail, forwards lines."""

    def __init__(self, stream, on_line: LineSink | None, log: TextIO | None, keep: int = 2000) -> None:
        self._lines = OutputLines(on_line, keep)
        self._log = log  # closed by the pump
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream) -> None:
        try:
            for raw in stream:
                line = raw.rstrip("\n")
                self._lines.add(line)
                if self._log:
                    self._write_log(line)
        finally:
            self._lines.close()
            stream.close()
            if self._log:
                self._log.close()

    def _write_log(self, line: str) -> None:
        """A log that cannot be written (its disk full: the node's own, for a local node) is given up, said once;
        the lines still reach on_line and the tail, and the command is still read, so it never blocks on its pipe."""
        assert self._log is not None
        try:
            self._log.write(line + "\n")
        except OSError as exc:
            log.warning("%s: not written any more (%s): the command's output still reaches the run's log",
                        self._log.name, exc.strerror or exc)
            log_file, self._log = self._log, None
            with contextlib.suppress(OSError):  # the buffered rest of a log already given up on, said above
                log_file.close()

    def join(self, timeout: float | None = None) -> None:
        """The output read to its end (at most timeout: a child the command left may hold the pipe open), and what
        was read handed to the sink."""
        self._thread.join(timeout)
        self._lines.drain()

    def tail(self, lines: int) -> str:
        return self._lines.tail(lines)


class LocalProcess(Process):
    def __init__(self, popen: subprocess.Popen[str], pump: _OutputPump) -> None:
        self._popen = popen
        self._pump = pump
        self.pid = popen.pid

    def poll(self) -> int | None:
        return self._popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        try:
            code = self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"pid {self.pid} still running after {timeout}s") from None
        self._pump.join(5)
        return code

    def terminate(self, grace_s: float = 10.0) -> int | None:
        if self._popen.poll() is None:
            _signal_group(self.pid, signal.SIGTERM)
            try:
                return self.wait(grace_s)
            except TimeoutError:
                _signal_group(self.pid, signal.SIGKILL)
        try:
            return self.wait(5)
        except TimeoutError:
            return None

    def tail(self, lines: int = 20) -> str:
        return self._pump.tail(lines)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return


class LocalRunner(Runner):
    """A node that is a directory on this machine; its processes carry the node's tags in their environment."""

    def __init__(self, node_name: str, workdir: Path, tags: Mapping[str, str]) -> None:
        self.node_name = node_name
        self.workdir = workdir
        self.tags = dict(tags)

    def start(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, on_line: LineSink | None = None,
              log_path: str | None = None, cwd: str | None = None) -> Process:
        full_env = {**os.environ, **self.tags, **(env or {})}
        # The log is opened before the process starts: a node whose dir is going (taken away mid-run) then fails to
        # start anything, rather than leave a process running that nobody reads or ends.
        log_file = None
        try:
            log_file = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115 - closed by the pump
            popen = subprocess.Popen(
                list(argv), cwd=cwd or self.workdir, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
            )
        except OSError as exc:
            if log_file is not None:
                log_file.close()
            raise RemoteError(f"{self.node_name}: cannot start '{_short(argv)}': {exc.strerror}: "
                              f"{exc.filename or cwd or self.workdir}") from None
        return LocalProcess(popen, _OutputPump(popen.stdout, on_line, log_file))

    def write_text(self, path: str, text: str) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, target)

    def read_text(self, path: str) -> str | None:
        try:
            return Path(path).read_text()
        except FileNotFoundError:
            return None

    def read_from(self, path: str, offset: int) -> bytes | None:
        try:
            with open(path, "rb") as handle:
                handle.seek(offset)
                return handle.read()
        except FileNotFoundError:
            return None
