"""Reach a node over SSH (paramiko) through the same Runner interface as LocalRunner.

Host keys are verified against a pinned SHA256 fingerprint or a known_hosts file; an unknown or changed key is
refused, never accepted or added. Connections are shared by every runner of the same endpoint in this process (tasks
build a fresh runner per call), reconnect when they drop, and retry transient failures (a node still booting) with
backoff, logging each retry; authentication and host key failures are never retried.

A command runs on the node in its own session and process group under a small bash wrapper, so terminate() can
signal the whole group. Its environment travels over the channel's stdin, never on the command line: every user of
the node can read a process's command line (/proc/*/cmdline, ps) for as long as it runs, while its environment is
readable by its owner alone. The wrapper ignores SIGTERM itself, and so does the `tee` that copies the output to the log
on the node, so a command that handles SIGTERM (a trainer saving a last checkpoint) keeps a working stdout until it
exits. `tee -p` keeps writing the node's log when the orchestrator goes away, so node processes outlive a lost
connection the way local ones outlive a dead orchestrator; the lease watchdog ends them.
"""

from __future__ import annotations

import codecs
import errno
import logging
import posixpath
import re
import shlex
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import paramiko
from paramiko.hostkeys import HostKeys
from paramiko.ssh_exception import AuthenticationException, ChannelException, IncompatiblePeer, SSHException

from infra.cancel import CANCEL
from infra.compute.access.remote import LineSink, Process, RemoteError, Runner, _short

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 60.0  # how long transient connect failures are retried before giving up
TCP_TIMEOUT_S = 10.0  # one TCP connect / SSH handshake attempt
CHANNEL_TIMEOUT_S = 30.0  # the server answering a channel open; longer means a dead connection
# A connection that stops answering (a network partition drops its packets; nothing closes it) is found by asking the
# server a keepalive every KEEPALIVE_S and closing the connection once KEEPALIVE_MISSES in a row go unanswered, as
# OpenSSH's ServerAliveInterval/ServerAliveCountMax do: so within KEEPALIVE_S × (KEEPALIVE_MISSES + 1) of the last
# answer, everything waiting on it (a command's exit, an SFTP read) fails instead of waiting for TCP to give up
# (~15 min of retransmissions).
KEEPALIVE_S = 15.0
KEEPALIVE_MISSES = 3
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
PGID_MARKER = "@@trainpipe-pgid"
KILL_WAIT_S = 5.0  # after SIGKILL, for the channel to report the group gone
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# $1 is the node's log file (/dev/null for none), the rest is the command. The command runs in a subshell that
# restores SIGTERM/SIGINT (SIGHUP stays ignored, as under nohup: a lost connection must not kill it). Its environment
# comes on stdin as NAME=value entries, each ended by a NUL (values may hold newlines), then an empty entry: input that
# ends before that entry exits 125, so a command never runs with half its environment.
WRAPPER = f"""trap '' TERM INT HUP
printf '%s %s\\n' {PGID_MARKER} "$$"
while :; do IFS= read -r -d '' entry || exit 125; [ -z "$entry" ] && break; export -- "$entry" || exit 125; done
log=$1; shift
if [ "$log" != /dev/null ]; then mkdir -p -- "$(dirname -- "$log")" || exit 125; fi
( trap - TERM INT; {{setup}}exec "$@" ) </dev/null 2>&1 | tee -p -a -- "$log"
exit "${{PIPESTATUS[0]}}"
"""


class SshError(RemoteError):
    """Reaching a node over SSH failed; the message names the endpoint and the fix."""


class SshConnectError(SshError, ConnectionError):
    """The node did not answer (yet): worth retrying later, e.g. by a task retry."""

    transient = True


class HostKeyError(SshError):
    """The node's host key is unknown or not the one pinned: refused, whatever the cause."""


class SshAuthError(SshError):
    """The node refused our key (or the key cannot be loaded): retrying cannot help."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    user: str
    key_file: str
    host_key: str | None = None
    known_hosts: str | None = None

    @property
    def label(self) -> str:
        return f"ssh {self.user}@{self.host}:{self.port}"

    @property
    def known_hosts_name(self) -> str:
        # How OpenSSH names the host in known_hosts.
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"


T = TypeVar("T")


class _Transient(Exception):
    """One connect attempt failed in a way a later attempt may not (refused, reset, timed out)."""


# -- connecting -----------------------------------------------------------------------------------------------------


def _backoff(attempt: int) -> float:
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (attempt - 1))


def _tcp_connect(host: str, port: int) -> socket.socket:
    try:
        return socket.create_connection((host, port), timeout=TCP_TIMEOUT_S)
    except socket.gaierror as exc:
        raise SshError(f"ssh {host}:{port}: cannot resolve '{host}' ({exc.strerror}): check the host name") from None
    except (ConnectionError, TimeoutError) as exc:
        raise _Transient(f"{type(exc).__name__}: {exc.strerror or exc}") from None
    except OSError as exc:
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
            raise _Transient(exc.strerror) from None
        raise


def _retrying(what: str, attempt_once: Callable[[], T], deadline: float) -> T:
    """attempt_once until it stops failing transiently or the deadline passes; each retry is logged."""
    attempt = 0
    while True:
        attempt += 1
        CANCEL.check()  # a cancelled run stops asking: the host may never answer
        try:
            return attempt_once()
        except _Transient as exc:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SshConnectError(f"{what}: not reachable after {attempt} attempts ({exc}): check that the "
                                      "host is up and sshd listens on that port") from None
            delay = min(_backoff(attempt), remaining)
            log.warning("%s: %s (attempt %d): retrying in %.1fs", what, exc, attempt, delay)
            CANCEL.wait(delay)


def wait_for_ssh(host: str, port: int = 22, timeout: float = 300.0) -> float:
    """Wait until host:port answers with an SSH banner (a booting node refuses, then accepts); returns the seconds
    it took. Raises SshConnectError when it does not answer within timeout."""
    started = time.monotonic()

    def banner() -> None:
        with _tcp_connect(host, port) as sock:
            try:
                first = sock.recv(256)
            except (ConnectionError, TimeoutError) as exc:
                raise _Transient(f"no banner ({type(exc).__name__})") from None
        if not first.startswith(b"SSH-"):
            raise _Transient(f"answered {first[:40]!r}, not an SSH banner")

    _retrying(f"ssh {host}:{port}", banner, started + timeout)
    return time.monotonic() - started


def _load_client_key(endpoint: Endpoint) -> paramiko.PKey:
    try:
        return paramiko.PKey.from_path(endpoint.key_file)
    except paramiko.PasswordRequiredException:
        raise SshAuthError(f"{endpoint.label}: key {endpoint.key_file} has a passphrase: use a key without one "
                           "for unattended runs") from None
    except (OSError, SSHException, ValueError) as exc:
        raise SshAuthError(f"{endpoint.label}: cannot load key {endpoint.key_file} ({exc}): give an OpenSSH or "
                           "PEM private key in key_file") from None


def _algorithms_of(key_name: str) -> set[str]:
    """Host key algorithms that negotiate a key of this type (an RSA key is offered as rsa-sha2-*)."""
    return {"ssh-rsa", "rsa-sha2-256", "rsa-sha2-512"} if key_name == "ssh-rsa" else {key_name}


def _start_client(endpoint: Endpoint, prefer: Sequence[str] = (), exclude: Set[str] = frozenset()
                  ) -> paramiko.Transport:
    """A transport past key exchange; prefer/exclude steer which of the server's host keys it offers."""
    sock = _tcp_connect(endpoint.host, endpoint.port)
    transport = paramiko.Transport(sock)
    transport.banner_timeout = TCP_TIMEOUT_S
    transport.handshake_timeout = TCP_TIMEOUT_S
    options = transport.get_security_options()
    default = list(options.key_types)
    wanted = [a for a in prefer if a in default] + [a for a in default if a not in prefer]
    wanted = [a for a in wanted if a not in exclude]
    if not wanted:
        transport.close()
        raise IncompatiblePeer("no host key algorithm left to ask for")
    options.key_types = tuple(wanted)
    try:
        transport.start_client(timeout=TCP_TIMEOUT_S)
    except IncompatiblePeer:
        transport.close()
        raise
    except (SSHException, EOFError, OSError) as exc:
        # The banner or key exchange broke off: sshd still starting, or throttling new connections (MaxStartups).
        transport.close()
        raise _Transient(f"handshake failed ({exc or type(exc).__name__})") from None
    return transport


def _handshake_pinned(endpoint: Endpoint) -> paramiko.Transport:
    """Only the fingerprint is pinned, not the key type: ask for each type the server has until one matches."""
    assert endpoint.host_key is not None
    offered: list[paramiko.PKey] = []
    tried: set[str] = set()
    while True:
        try:
            transport = _start_client(endpoint, exclude=tried)
        except IncompatiblePeer:
            break  # the server has no key of the types not tried yet
        key = transport.get_remote_server_key()
        if key.fingerprint == endpoint.host_key:
            return transport
        transport.close()
        offered.append(key)
        tried |= _algorithms_of(key.get_name())
    shown = ", ".join(f"{k.fingerprint} ({k.get_name()})" for k in offered) or "no key of a supported type"
    raise HostKeyError(f"{endpoint.label}: host key {shown} does not match the pinned host_key {endpoint.host_key}: "
                       "refused. If the host was reinstalled, check its key on the host (ssh-keygen -lf "
                       "/etc/ssh/ssh_host_ed25519_key.pub) and update host_key; otherwise the connection may be "
                       "intercepted")


def _handshake_known_hosts(endpoint: Endpoint) -> paramiko.Transport:
    assert endpoint.known_hosts is not None
    try:
        known = HostKeys(endpoint.known_hosts).lookup(endpoint.known_hosts_name) or {}
    except (OSError, SSHException) as exc:
        raise HostKeyError(f"{endpoint.label}: cannot read known_hosts {endpoint.known_hosts} ({exc}): fix the "
                           "file or pin host_key instead") from None
    known_keys = list(known.values())
    # Ask for the key types known_hosts has first, so a host with several keys offers one we can check.
    try:
        prefer = [alg for k in known_keys for alg in sorted(_algorithms_of(k.get_name()))]
        transport = _start_client(endpoint, prefer=prefer)
    except IncompatiblePeer as exc:
        raise HostKeyError(f"{endpoint.label}: no host key algorithm in common ({exc})") from None
    key = transport.get_remote_server_key()
    if any(key.asbytes() == k.asbytes() for k in known_keys):
        return transport
    transport.close()
    if not known_keys:
        raise HostKeyError(f"{endpoint.label}: host key {key.fingerprint} ({key.get_name()}) is not in known_hosts "
                           f"{endpoint.known_hosts}: refused. Check the fingerprint on the host, then add it "
                           f"(ssh-keyscan -p {endpoint.port} {endpoint.host} >> {endpoint.known_hosts}) or pin "
                           "host_key")
    expected = ", ".join(f"{k.fingerprint} ({k.get_name()})" for k in known_keys)
    raise HostKeyError(f"{endpoint.label}: host key {key.fingerprint} ({key.get_name()}) does not match known_hosts "
                       f"{endpoint.known_hosts} ({expected}): refused. If the host was reinstalled, check its new "
                       f"key on the host and replace the entry (ssh-keygen -R '{endpoint.known_hosts_name}' -f "
                       f"{endpoint.known_hosts}); otherwise the connection may be intercepted")


def _authenticate(transport: paramiko.Transport, endpoint: Endpoint, key: paramiko.PKey) -> None:
    try:
        transport.auth_publickey(endpoint.user, key)
    except AuthenticationException:
        raise SshAuthError(f"{endpoint.label}: key {endpoint.key_file} ({key.fingerprint}) was refused: add its "
                           f"public key to ~{endpoint.user}/.ssh/authorized_keys on the host, or fix user/key_file"
                           ) from None
    except (SSHException, EOFError, OSError) as exc:
        raise _Transient(f"connection lost during authentication ({exc or type(exc).__name__})") from None


def connect(endpoint: Endpoint, timeout_s: float = CONNECT_TIMEOUT_S) -> paramiko.Transport:
    """An authenticated transport whose host key checked out; transient failures retried until timeout_s."""
    if endpoint.host_key is None and endpoint.known_hosts is None:
        raise HostKeyError(f"{endpoint.label}: no host key to verify it against: pin host_key (its SHA256 "
                           "fingerprint) or give a known_hosts file; unknown keys are never accepted")
    key = _load_client_key(endpoint)

    def attempt() -> paramiko.Transport:
        transport = _handshake_pinned(endpoint) if endpoint.host_key else _handshake_known_hosts(endpoint)
        try:
            _authenticate(transport, endpoint, key)
        except BaseException:
            transport.close()
            raise
        _watch_liveness(transport, endpoint.label)
        return transport

    transport = _retrying(endpoint.label, attempt, time.monotonic() + timeout_s)
    log.debug("%s: connected", endpoint.label)
    return transport


def _watch_liveness(transport: paramiko.Transport, label: str) -> None:
    """Close the transport once the server leaves keepalives unanswered for KEEPALIVE_MISSES intervals."""
    interval_s, misses = KEEPALIVE_S, KEEPALIVE_MISSES

    def ask() -> threading.Event:
        answered = threading.Event()

        def request() -> None:
            # Any answer counts, a refusal of the request too: the server is there. Returns when the transport closes.
            transport.global_request("keepalive@openssh.com", wait=True)
            answered.set()

        threading.Thread(target=request, name=f"ssh-keepalive-ask-{label}", daemon=True).start()
        return answered

    def watch() -> None:
        while transport.is_active():
            started = time.monotonic()
            if not ask().wait(interval_s * misses):
                if transport.is_active():
                    log.warning("%s: no answer to %d keepalives in %.0fs: the connection is dead, closing it",
                                label, misses, interval_s * misses)
                    transport.close()
                return
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    threading.Thread(target=watch, name=f"ssh-keepalive-{label}", daemon=True).start()


# -- shared connections ---------------------------------------------------------------------------------------------


_CONNECTION_ERRORS = (SSHException, EOFError, ConnectionError, TimeoutError)


class _Connection:
    """The connections to one endpoint, shared by every runner for it. More than one only when the server's
    MaxSessions (10 channels per connection by default) is reached."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._lock = threading.Lock()
        self._transports: list[paramiko.Transport] = []
        self._sftp: paramiko.SFTPClient | None = None
        self._sftp_lock = threading.Lock()

    def _connect(self, timeout_s: float) -> paramiko.Transport:
        transport = connect(self.endpoint, timeout_s)
        self._transports.append(transport)
        return transport

    def transport(self, timeout_s: float) -> paramiko.Transport:
        with self._lock:
            self._transports = [t for t in self._transports if t.is_active()]
            return self._transports[0] if self._transports else self._connect(timeout_s)

    def open_session(self, timeout_s: float) -> paramiko.Channel:
        with self._lock:
            self._transports = [t for t in self._transports if t.is_active()]
            for transport in self._transports:
                try:
                    return transport.open_session(timeout=CHANNEL_TIMEOUT_S)
                except ChannelException:
                    continue  # this connection has its MaxSessions channels open
                except (SSHException, EOFError, OSError) as exc:
                    log.warning("%s: connection failed (%s): reconnecting", self.endpoint.label, exc)
                    transport.close()
            transport = self._connect(timeout_s)
            try:
                return transport.open_session(timeout=CHANNEL_TIMEOUT_S)
            except (ChannelException, SSHException, EOFError, OSError) as exc:
                raise SshConnectError(f"{self.endpoint.label}: cannot open a channel on a new connection ({exc})"
                                      ) from None

    @contextmanager
    def sftp(self, timeout_s: float) -> Iterator[paramiko.SFTPClient]:
        """The connection's SFTP session, one caller at a time; a dropped connection surfaces as SshConnectError
        and is replaced on the next call."""
        with self._sftp_lock:
            channel = self._sftp.get_channel() if self._sftp is not None else None
            if channel is None or channel.closed or not channel.get_transport().is_active():
                transport = self.transport(timeout_s)
                try:
                    self._sftp = paramiko.SFTPClient.from_transport(transport)
                except _CONNECTION_ERRORS as exc:
                    raise SshConnectError(f"{self.endpoint.label}: cannot start SFTP ({exc or type(exc).__name__})"
                                          ": the server needs the sftp subsystem") from None
            try:
                yield self._sftp
            except _CONNECTION_ERRORS as exc:
                self._sftp.close()
                self._sftp = None
                raise SshConnectError(f"{self.endpoint.label}: connection lost ({exc or type(exc).__name__})"
                                      ) from None

    def close(self) -> None:
        with self._sftp_lock:
            if self._sftp is not None:
                self._sftp.close()
                self._sftp = None
        with self._lock:
            for transport in self._transports:
                transport.close()
            self._transports = []


_connections: dict[Endpoint, _Connection] = {}
_connections_lock = threading.Lock()


def _connection(endpoint: Endpoint) -> _Connection:
    with _connections_lock:
        if endpoint not in _connections:
            _connections[endpoint] = _Connection(endpoint)
        return _connections[endpoint]


def close_connections() -> None:
    """Close every shared connection of this process (processes still running on nodes keep running)."""
    with _connections_lock:
        connections = list(_connections.values())
        _connections.clear()
    for connection in connections:
        connection.close()


# -- running commands -----------------------------------------------------------------------------------------------


def wrapped_command(argv: Sequence[str], workdir: str | None, log_path: str | None) -> str:
    """The remote command line: the wrapper in its own session (setsid -w waits and returns its status). It holds
    no environment value: those go to the wrapper's stdin (environment_input)."""
    setup = f"cd -- {shlex.quote(workdir)} || exit 1; " if workdir else ""
    script = WRAPPER.replace("{setup}", setup)
    return " ".join(["exec setsid -w bash -c", shlex.quote(script), "trainpipe-node",
                     shlex.quote(log_path or "/dev/null"), *(shlex.quote(arg) for arg in argv)])


def environment_input(env: Mapping[str, str]) -> bytes:
    """What the wrapper reads from stdin: each NAME=value ended by a NUL, then an empty entry."""
    entries = []
    for name, value in env.items():
        if not ENV_NAME.match(name):
            raise ValueError(f"environment variable name {name!r} is not a shell identifier")
        if "\0" in value:
            raise ValueError(f"environment variable {name}: a value cannot hold a NUL character")
        entries.append(f"{name}={value}\0".encode())
    return b"".join(entries) + b"\0"


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
        self._on_line = on_line
        self._keep = keep
        self._lines: list[str] = []
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
            self._pgid_known.set()  # nothing more will come: never make terminate() wait for a marker

    def _line(self, line: str) -> None:
        if self.pgid is None and line.startswith(PGID_MARKER + " "):
            self.pgid = int(line.split()[1])
            self._pgid_known.set()
            return
        with self._lock:
            self._lines.append(line)
            del self._lines[: -self._keep]
        if self._on_line:
            try:
                self._on_line(line)
            except Exception:  # a broken log sink must not kill the command it watches
                log.exception("line sink failed on %r", line)

    def _finish(self) -> int:
        with self._lock:
            if self._code is not None:
                return self._code
        self._thread.join(5)
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
        with self._lock:
            return "\n".join(self._lines[-lines:])


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
    def _conn(self) -> _Connection:
        return _connection(self.endpoint)

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
        except _CONNECTION_ERRORS as exc:
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
        except _CONNECTION_ERRORS as exc:
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
