"""Real OpenSSH servers on loopback for tests: each with its own host key, accepting one generated client key.

Nothing is mocked: the runner and the provider talk to /usr/sbin/sshd exactly as they would to a remote machine.
The servers run as root (sshd needs it to log users in), so tests skip outside CI when that is not possible and
fail in CI (CI=true), where `make test` installs openssh-server.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from conftest import cannot_run_here

SSHD = Path("/usr/sbin/sshd")
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without its privilege separation dir
START_TIMEOUT_S = 20.0


def require_sshd() -> None:
    """Skip (fail in CI) when real sshd servers cannot run here."""
    problem = None
    if not SSHD.is_file():
        problem = f"{SSHD} is missing: install openssh-server (scripts/install-system-packages)"
    elif os.geteuid() != 0:
        problem = "sshd test servers log users in, which needs root"
    elif shutil.which("ssh-keygen") is None:
        problem = "ssh-keygen is missing: install openssh-client"
    if problem is not None:
        cannot_run_here(problem)


def keygen(path: Path, comment: str) -> Path:
    """A new ed25519 key pair at path (private) and path.pub."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True)
    return path


def fingerprint(public_key: Path) -> str:
    """The SHA256:... fingerprint of a public key, as ssh-keygen prints it."""
    out = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", str(public_key)], check=True,
                         capture_output=True, text=True).stdout
    return out.split()[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def answers(port: int) -> bool:
    return answers_at("127.0.0.1", port)


def answers_at(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1) as sock:
            sock.settimeout(2)
            return sock.recv(4).startswith(b"SSH-")
    except OSError:
        return False


@dataclass
class SshServer:
    root: Path
    port: int
    host_key: Path  # private; .pub beside it
    process: subprocess.Popen[bytes] | None = None
    host: str = "127.0.0.1"

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.host_key.with_suffix(".pub"))

    def known_hosts_line(self) -> str:
        key_type, key = self.host_key.with_suffix(".pub").read_text().split()[:2]
        return f"[{self.host}]:{self.port} {key_type} {key}\n"

    def log(self) -> str:
        path = self.root / "sshd.log"
        return path.read_text() if path.exists() else ""

    def start(self) -> None:
        """Start (or restart, after stop) the server and wait until it answers."""
        config = self.root / "sshd_config"
        with (self.root / "sshd.log").open("ab") as log:
            self.process = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not answers(self.port):
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd on port {self.port} exited {self.process.returncode}:\n{self.log()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on port {self.port} did not answer within {START_TIMEOUT_S}s")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop listening for new connections (as with a real sshd, sessions already open are not ended)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def sshd_config(port: int, host_key: Path, authorized_keys: Path, pid_file: Path, listen: str = "127.0.0.1",
                more: str = "") -> str:
    """A test sshd's configuration: key authentication only, SFTP, root logins (sshd logs users in as themselves)."""
    return f"""\
Port {port}
ListenAddress {listen}
HostKey {host_key}
PidFile {pid_file}
AuthorizedKeysFile {authorized_keys}
StrictModes no
UsePAM no
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
Subsystem sftp internal-sftp
LogLevel VERBOSE
{more}"""


def _write_config(root: Path, port: int, host_key: Path, authorized_keys: Path,
                  session_env: Mapping[str, str] | None = None) -> None:
    # SetEnv: what every session gets besides sshd's own few variables (sshd passes none of its own environment on).
    # One line: sshd takes only its first SetEnv directive.
    pairs = " ".join(f'"{name}={value}"' for name, value in (session_env or {}).items())
    more = f"SetEnv {pairs}\n" if pairs else ""
    (root / "sshd_config").write_text(sshd_config(port, host_key, authorized_keys, root / "sshd.pid", more=more))


def start_server(root: Path, client_public_key: Path, attempts: int = 5, host_key: Path | None = None,
                 session_env: Mapping[str, str] | None = None) -> SshServer:
    """A new sshd in root, accepting client_public_key; retried on a port taken between probe and bind. Its host key
    is host_key (private, mode 0600, .pub beside it) when given, else a new one; session_env: variables every session
    gets."""
    root.mkdir(parents=True, exist_ok=True)
    PRIVSEP_DIR.mkdir(parents=True, exist_ok=True)
    host_key = host_key or keygen(root / "host_ed25519", "test-host")
    authorized = root / "authorized_keys"
    authorized.write_text(client_public_key.read_text())
    for attempt in range(1, attempts + 1):
        server = SshServer(root=root, port=free_port(), host_key=host_key)
        _write_config(root, server.port, host_key, authorized, session_env)
        try:
            server.start()
            return server
        except RuntimeError:
            server.stop()
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


@contextmanager
def ssh_servers(root: Path, count: int, session_env: Mapping[str, str] | None = None
                ) -> Iterator[tuple[Path, list[SshServer]]]:
    """count servers accepting one new client key; yields (client private key, servers) and stops them after.
    session_env: variables every session of theirs gets (sshd_config SetEnv)."""
    require_sshd()
    root.mkdir(parents=True, exist_ok=True)
    client_key = keygen(root / "client_ed25519", "test-client")
    servers: list[SshServer] = []
    try:
        for index in range(count):
            servers.append(start_server(root / f"sshd-{index}", client_key.with_suffix(".pub"),
                                        session_env=session_env))
        yield client_key, servers
    finally:
        for server in servers:
            server.stop()
