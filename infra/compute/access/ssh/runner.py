"""SshRunner: one node reached over SSH, its commands run under the wrapper (SshProcess) and its small files moved
over SFTP, on the connection shared by every runner of the endpoint."""

from __future__ import annotations

import codecs
import logging
import posixpath
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import paramiko

from infra.compute.access.remote import LineSink, OutputLines, Process, RemoteError, Runner, _short
from infra.compute.access.ssh.command import PGID_MARKER, environment_input, wrapped_command
from infra.compute.access.ssh.connection import (
    CHANNEL_TIMEOUT_S,
    CONNECT_TIMEOUT_S,
    CONNECTION_ERRORS,
    Connection,
    Endpoint,
    SshConnectError,
    SshError,
    shared_connection,
)

log = logging.getLogger(__name__)

KILL_WAIT_S = 5.0  # after SIGKILL, for the channel to report the group gone


def _read_all(channel: paramiko.Channel, timeout: float) -> tuple[int, str]:
    channel.settimeout(timeout)
    chunks = []
    try:
        while data := channel.recv(65536):
            chunks.append(data)
    except TimeoutError:
        channel.close()
        raise SshConnectError(f"no answer within {timeout:.0f}s") from None
    if not channel.status_event.wait(timeout):
        raise SshConnectError(f"no exit status within {timeout:.0f}s")
    return channel.recv_exit_status(), b"".join(chunks).decode(errors="replace")


class SshProcess(Process):
    """A command running under the wrapper on the node; its output is read on a thread."""

    def __init__(self, runner: SshRunner, channel: paramiko.Channel, argv: Sequence[str], on_line: LineSink | None,
                 keep: int = 2000) -> None:
        self._runner = runner
        self._channel = channel
        self._argv = list(argv)
        self._lines = OutputLines(on_line, keep, name=f"ssh-out-{runner.node_name}")
        self._lock = threading.Lock()
        self.pgid: int | None = None
        self._pgid_known = threading.Event()
        self._signalled: signal.Signals | None = None
        self._code: int | None = None
        self._lost = False
        self._thread = threading.Thread(target=self._pump, name=f"ssh-out-{runner.node_name}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pending = ""
        try:
            while data := self._channel.recv(65536):
                # Universal newlines, as the local runner reads: progress bars redraw with a bare carriage return.
                pending += decoder.decode(data).replace("\r\n", "\n").replace("\r", "\n")
                *lines, pending = pending.split("\n")
                for line in lines:
                    self._line(line)
            pending += decoder.decode(b"", final=True)
            if pending:
                self._line(pending)
        except Exception:  # a reader that dies silently would hang wait(): make it loud
            log.exception("%s: reading the output of '%s' failed", self._runner.node_name, _short(self._argv))
        finally:
            self._lines.close()
            self._pgid_known.set()  # nothing more will come: never make terminate() wait for a marker

    def _line(self, line: str) -> None:
        if self.pgid is None and line.startswith(PGID_MARKER + " "):
            self.pgid = int(line.split()[1])
            self._pgid_known.set()
            return
        self._lines.add(line)

    def _finish(self) -> int:
        with self._lock:
            if self._code is not None:
                return self._code
        self._thread.join(5)
        self._lines.drain()
        status = self._channel.recv_exit_status()
        code = self._exit_code(status)
        with self._lock:
            self._code = code
        return code

    def _exit_code(self, status: int) -> int:
        """Local semantics: -N when our signal N ended it (bash reports 128+N, setsid -w the raw signal N)."""
        if self._signalled is not None and status in (self._signalled, 128 + self._signalled, -1):
            return -int(self._signalled)
        if status == -1 and not self._channel.get_transport().is_active():
            # The connection dropped: the command may well still run on the node (it survives a lost connection).
            self._lost = True
            log.warning("%s: connection lost while '%s' ran (process group %s may still run)",
                        self._runner.node_name, _short(self._argv), self.pgid)
            return 255
        return status

    @property
    def lost(self) -> bool:
        """It ended for us because the connection dropped, not because it exited (it may still run)."""
        return self._lost

    def poll(self) -> int | None:
        return self._finish() if self._channel.exit_status_ready() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._channel.status_event.wait(timeout):
            raise TimeoutError(f"{self._runner.node_name}: '{_short(self._argv)}' still running after {timeout}s")
        return self._finish()

    def terminate(self, grace_s: float = 10.0) -> int | None:
        if self.poll() is not None and self._lost:
            self._terminate_detached(grace_s)
            return self._code
        if self.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                return self.wait(grace_s)
            except TimeoutError:
                self._signal(signal.SIGKILL)
        try:
            return self.wait(KILL_WAIT_S)
        except TimeoutError:
            return None

    def _terminate_detached(self, grace_s: float) -> None:
        """The connection dropped while the command ran: it may run on, with no channel to tell us when it ends."""
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                code, _ = self._runner.exec_quick(f"grep -qa {PGID_MARKER} /proc/{self.pgid}/cmdline 2>/dev/null")
            except SshError as exc:
                log.error("%s: cannot check whether process group %s ended: %s", self._runner.node_name, self.pgid,
                          exc)
                return
            if code != 0:
                return
            time.sleep(0.5)
        self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        if not self._pgid_known.wait(10) or self.pgid is None:
            log.warning("%s: '%s' never reported its process group: cannot signal it", self._runner.node_name,
                        _short(self._argv))
            return
        self._signalled = sig
        # Only while the group's leader is still our wrapper: a pid reused by anything else is left alone.
        command = (f"grep -qa {PGID_MARKER} /proc/{self.pgid}/cmdline 2>/dev/null && "
                   f"kill -s {sig.name.removeprefix('SIG')} -- -{self.pgid} 2>/dev/null; true")
        try:
            self._runner.exec_quick(command, timeout=CHANNEL_TIMEOUT_S)
        except SshError as exc:
            log.error("%s: could not send %s to process group %d: %s", self._runner.node_name, sig.name, self.pgid,
                      exc)

    def tail(self, lines: int = 20) -> str:
        return self._lines.tail(lines)


# -- the runner -----------------------------------------------------------------------------------------------------


class SshRunner(Runner):
    """One node reached over SSH. Keyword-only, so providers construct it the same way whatever they launch:
    SshRunner(node_name=..., host=..., port=..., user=..., key_file=..., host_key=... or known_hosts=...).

    workdir is the commands' working directory; tags are environment variables every command carries (the
    provider's cluster and node tags, which teardown and the node watchdog find processes by)."""

    def __init__(self, *, node_name: str, host: str, user: str, key_file: str, port: int = 22,
                 host_key: str | None = None, known_hosts: str | None = None, workdir: str | None = None,
                 tags: Mapping[str, str] | None = None, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.node_name = node_name
        self.endpoint = Endpoint(host=host, port=port, user=user, key_file=str(key_file), host_key=host_key,
                                 known_hosts=str(known_hosts) if known_hosts else None)
        self.workdir = workdir
        self.tags = dict(tags or {})
        self.connect_timeout_s = connect_timeout_s

    @property
    def _conn(self) -> Connection:
        return shared_connection(self.endpoint)

    def _name(self, exc: SshError) -> SshError:
        """The same error, named after the node (the endpoint alone does not say which node it is)."""
        return type(exc)(f"{self.node_name}: {exc}")

    def connect(self) -> None:
        """Connect (or reuse the connection) now: verifies the host key and our key before anything runs."""
        try:
            self._conn.transport(self.connect_timeout_s)
        except SshError as exc:
            raise self._name(exc) from None

    def start(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, on_line: LineSink | None = None,
              log_path: str | None = None, cwd: str | None = None) -> Process:
        command = wrapped_command(argv, cwd or self.workdir, log_path)
        environment = environment_input({**self.tags, **(env or {})})
        try:
            channel = self._conn.open_session(self.connect_timeout_s)
        except SshError as exc:
            raise self._name(exc) from None
        try:
            channel.set_combine_stderr(True)
            channel.exec_command(command)
            channel.sendall(environment)
            channel.shutdown_write()  # the command's own stdin is /dev/null: nothing follows the environment
        except CONNECTION_ERRORS as exc:
            channel.close()
            raise SshConnectError(f"{self.node_name}: cannot start '{_short(argv)}' ({exc or type(exc).__name__})"
                                  ) from None
        return SshProcess(self, channel, argv, on_line)

    def _check_ended(self, process: Process, argv: Sequence[str]) -> None:
        """A dropped connection ends the command and raises SshConnectError: transient, so a task retry runs the
        step again, with no copy of it left running on the node."""
        if isinstance(process, SshProcess) and process.lost:
            process.terminate()
            raise SshConnectError(f"{self.node_name}: connection lost while '{_short(argv)}' ran: it was ended; "
                                  "running it again is safe")

    def exec_quick(self, command: str, timeout: float = CHANNEL_TIMEOUT_S) -> tuple[int, str]:
        """A short shell command without the wrapper or the tags (signals, checks): exit status and output."""
        try:
            channel = self._conn.open_session(self.connect_timeout_s)
            channel.set_combine_stderr(True)
            channel.exec_command(command)
            channel.shutdown_write()
            return _read_all(channel, timeout)
        except SshError as exc:
            raise self._name(exc) from None
        except CONNECTION_ERRORS as exc:
            raise SshConnectError(f"{self.node_name}: '{command[:80]}' failed ({exc or type(exc).__name__})"
                                  ) from None

    @contextmanager
    def _sftp(self, doing: str, path: str, *, missing_passes: bool = False) -> Iterator[paramiko.SFTPClient]:
        """An SFTP session whose failures name the node: a lost connection as the node's SshError, any other
        failure as 'cannot <doing> <path>'; with missing_passes, FileNotFoundError reaches the caller as is."""
        try:
            with self._conn.sftp(self.connect_timeout_s) as sftp:
                yield sftp
        except FileNotFoundError as exc:
            if missing_passes:
                raise
            raise RemoteError(f"{self.node_name}: cannot {doing} {path}: {exc.strerror or exc}") from None
        except SshError as exc:
            raise self._name(exc) from None
        except OSError as exc:
            raise RemoteError(f"{self.node_name}: cannot {doing} {path}: {exc.strerror or exc}") from None

    def write_text(self, path: str, text: str) -> None:
        def write(sftp: paramiko.SFTPClient, tmp: str) -> None:
            with sftp.open(tmp, "w") as handle:
                handle.write(text.encode())

        self._put(path, write)

    def put_file(self, local: Path, path: str) -> None:
        """Copy a local file to the node (atomically: a reader never sees half of it)."""
        self._put(path, lambda sftp, tmp: sftp.put(str(local), tmp))

    def _put(self, path: str, write: Callable[[paramiko.SFTPClient, str], object]) -> None:
        directory, name = posixpath.split(path)
        tmp = posixpath.join(directory, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        with self._sftp("write", path) as sftp:
            if directory:
                _makedirs(sftp, directory)
            try:
                write(sftp, tmp)
                sftp.posix_rename(tmp, path)
            except BaseException:
                _remove_quietly(sftp, tmp)
                raise

    def read_text(self, path: str) -> str | None:
        try:
            with self._sftp("read", path, missing_passes=True) as sftp, sftp.open(path, "r") as handle:
                return handle.read().decode()
        except FileNotFoundError:
            return None

    def read_from(self, path: str, offset: int) -> bytes | None:
        try:
            with self._sftp("read", path, missing_passes=True) as sftp, sftp.open(path, "r") as handle:
                handle.seek(offset)
                return handle.read()
        except FileNotFoundError:
            return None

    def makedirs(self, path: str) -> None:
        with self._sftp("create", path) as sftp:
            _makedirs(sftp, path)

    def exists(self, path: str) -> bool:
        return self._if_present("stat", path, lambda sftp: sftp.stat(path))

    def create_exclusive(self, path: str, text: str) -> bool:
        """Create path holding text only if it does not exist yet (O_EXCL on the node): False when it did."""
        try:
            with self._conn.sftp(self.connect_timeout_s) as sftp:
                with sftp.open(path, "wx") as handle:
                    handle.write(text.encode())
                return True
        except SshError as exc:
            raise self._name(exc) from None
        except OSError as exc:
            # OpenSSH reports an existing file as a generic "Failure": tell it apart from a real failure.
            if self.exists(path):
                return False
            raise RemoteError(f"{self.node_name}: cannot create {path}: {exc.strerror or exc}") from None

    def remove(self, path: str) -> bool:
        return self._if_present("remove", path, lambda sftp: sftp.remove(path))

    def _if_present(self, action: str, path: str, op: Callable[[paramiko.SFTPClient], object]) -> bool:
        """Do op to path over SFTP: True when it was done, False when path is not there (not an error here)."""
        try:
            with self._sftp(action, path, missing_passes=True) as sftp:
                op(sftp)
                return True
        except FileNotFoundError:
            return False


def _makedirs(sftp: paramiko.SFTPClient, path: str) -> None:
    missing = []
    current = path.rstrip("/")
    while current:
        try:
            sftp.stat(current)
            break
        except FileNotFoundError:
            missing.append(current)
            current = posixpath.dirname(current) if current != "/" else ""
    for directory in reversed(missing):
        try:
            sftp.mkdir(directory)
        except OSError:
            # Another writer created it between our stat and mkdir; anything else shows at the write.
            sftp.stat(directory)


def _remove_quietly(sftp: paramiko.SFTPClient, path: str) -> None:
    try:
        sftp.remove(path)
    except OSError:
        return  # never written, or the connection is gone: the original error is what matters
