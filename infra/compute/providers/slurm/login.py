"""Where the Slurm commands run: on this machine (trainpipe runs on a login node of the site) or on a login node over
SSH (`cluster.slurm.login: user@host`), with the ssh provider's keys and host-key checks and its shared connections.

Every sinfo, sbatch, squeue, scontrol and scancel goes through Login.run, and every job step's srun through
Login.runner, so one setting moves all of them. Over SSH a command's stdout and stderr still come back apart (the
parsers read stdout alone), a script goes to sbatch on stdin (the login node has no copy of the local file), and a
step's environment travels over the channel's stdin (SshRunner), never on a command line. The login is recorded in
the cluster's owner state, so teardown, the runner and the sweeper reach the same site the launch did.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from infra.compute.access.remote import LocalRunner, Runner
from infra.compute.access.ssh.connection import CONNECTION_ERRORS, Endpoint, SshError, shared_connection
from infra.compute.access.ssh.runner import SshRunner
from infra.compute.providers.slurm.config import SlurmClusterSpec


@dataclass(frozen=True)
class Result:
    """A finished Slurm command: its exit status and its stdout and stderr apart."""

    returncode: int
    stdout: str
    stderr: str


class LoginUnreachable(Exception):
    """The login node did not answer over SSH (or its host key or our key was refused): the message says which."""


@dataclass(frozen=True)
class Login:
    """The site's login node: this machine (address None) or user@host[:port] over SSH."""

    address: str | None = None
    key_file: str | None = None
    host_key: str | None = None
    known_hosts: str | None = None

    @property
    def remote(self) -> bool:
        return self.address is not None

    @property
    def endpoint(self) -> Endpoint:
        if self.address is None or self.key_file is None:
            raise ValueError("a local login has no SSH endpoint")
        user, _, rest = self.address.partition("@")
        host, _, port = rest.partition(":")
        return Endpoint(host=host, port=int(port or 22), user=user, key_file=self.key_file, host_key=self.host_key,
                        known_hosts=self.known_hosts)

    @property
    def label(self) -> str:
        return f"login node {self.address}" if self.remote else "this machine"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any] | None) -> Login:
        return cls(**value) if value else cls()

    def run(self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str], stdin: str | None = None) -> Result:
        """argv on the login node. Locally env is the whole environment; over SSH the login session's own
        environment is the site's, and env is not sent (it holds this machine's variables). TimeoutError when it
        does not end within timeout; FileNotFoundError when the program is not on the login node."""
        if not self.remote:
            try:
                done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=dict(env),
                                      input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                raise TimeoutError from None
            return Result(done.returncode, done.stdout, done.stderr)
        return self._run_remote(argv, timeout, stdin)

    def _run_remote(self, argv: Sequence[str], timeout: float, stdin: str | None) -> Result:
        # `command -v` first: a missing program is the same FileNotFoundError as locally (127 alone is ambiguous).
        command = f"command -v {shlex.quote(argv[0])} >/dev/null || exit 127; exec {shlex.join(argv)}"
        try:
            channel = shared_connection(self.endpoint).open_session(timeout)
        except SshError as exc:
            raise LoginUnreachable(f"{self.label}: {exc}") from None
        try:
            channel.settimeout(timeout)
            channel.exec_command(command)
            if stdin is not None:
                channel.sendall(stdin.encode())
            channel.shutdown_write()
            stdout = channel.makefile("rb").read().decode(errors="replace")
            stderr = channel.makefile_stderr("rb").read().decode(errors="replace")
            if not channel.status_event.wait(timeout):
                raise TimeoutError
            status = channel.recv_exit_status()
        except TimeoutError:
            raise TimeoutError from None
        except CONNECTION_ERRORS as exc:
            raise LoginUnreachable(f"{self.label}: '{argv[0]}' failed ({exc or type(exc).__name__})") from None
        finally:
            channel.close()
        if status == 127 and not stdout and not stderr:
            raise FileNotFoundError(argv[0])
        return Result(status, stdout, stderr)

    def runner(self, node_name: str) -> Runner:
        """Where a job step's srun runs: in any dir (--chdir is where its task runs on the node)."""
        if not self.remote:
            return LocalRunner(node_name, Path("/"), {})
        endpoint = self.endpoint
        return SshRunner(node_name=node_name, host=endpoint.host, port=endpoint.port, user=endpoint.user,
                         key_file=endpoint.key_file, host_key=endpoint.host_key, known_hosts=endpoint.known_hosts)


def login_of(config: SlurmClusterSpec) -> Login:
    """The login node a cluster.slurm section names (this machine when it names none)."""
    if config.login is None:
        return Login()
    return Login(address=config.login, key_file=config.login_key_file, host_key=config.login_host_key,
                 known_hosts=config.login_known_hosts)
