"""Connecting to an SSH endpoint: host key checks (pinned fingerprint or known_hosts), our key, transient failures
retried with backoff, a keepalive watch that closes a connection the server stopped answering, and the connections
shared by every runner of an endpoint in this process."""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence, Set
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import paramiko
from paramiko.hostkeys import HostKeys
from paramiko.ssh_exception import AuthenticationException, ChannelException, IncompatiblePeer, SSHException

from infra.cancel import CANCEL
from infra.compute.access.remote import RemoteError

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


CONNECTION_ERRORS = (SSHException, EOFError, ConnectionError, TimeoutError)


class Connection:
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
                except CONNECTION_ERRORS as exc:
                    raise SshConnectError(f"{self.endpoint.label}: cannot start SFTP ({exc or type(exc).__name__})"
                                          ": the server needs the sftp subsystem") from None
            try:
                yield self._sftp
            except CONNECTION_ERRORS as exc:
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


_connections: dict[Endpoint, Connection] = {}
_connections_lock = threading.Lock()


def shared_connection(endpoint: Endpoint) -> Connection:
    with _connections_lock:
        if endpoint not in _connections:
            _connections[endpoint] = Connection(endpoint)
        return _connections[endpoint]


def close_connections() -> None:
    """Close every shared connection of this process (processes still running on nodes keep running)."""
    with _connections_lock:
        connections = list(_connections.values())
        _connections.clear()
    for connection in connections:
        connection.close()
