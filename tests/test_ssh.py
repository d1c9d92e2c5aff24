"""SshRunner against real OpenSSH servers on loopback: commands, env, process groups, files, host keys, auth,
retries. Nothing is mocked; the "nodes" are this machine reached through sshd."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from sshd import SshServer, keygen, ssh_servers

from infra.compute.access.remote import RemoteError
from infra.compute.access.ssh.connection import (
    HostKeyError,
    SshAuthError,
    SshConnectError,
    close_connections,
    wait_for_ssh,
)
from infra.compute.access.ssh.runner import SshRunner
from infra.errors import is_transient

# A command that reports a child it started, says when SIGTERM reaches it, and exits cleanly after it.
TERM_AWARE = """
import signal, subprocess, sys, time
child = subprocess.Popen(["sleep", "300"])
print("child", child.pid, flush=True)
def stop(*_):
    print("got SIGTERM", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
time.sleep(300)
"""


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[SshServer]]]:
    with ssh_servers(tmp_path_factory.mktemp("sshd"), 2) as found:
        yield found
    close_connections()


@pytest.fixture
def server(servers: tuple[Path, list[SshServer]]) -> SshServer:
    return servers[1][0]


@pytest.fixture
def client_key(servers: tuple[Path, list[SshServer]]) -> Path:
    return servers[0]


def runner_for(server: SshServer, key: Path, **kwargs: object) -> SshRunner:
    options: dict[str, object] = {"host_key": server.fingerprint, **kwargs}
    return SshRunner(node_name="node-a", host=server.host, port=server.port, user="root", key_file=str(key),
                     **options)  # type: ignore[arg-type]


def wait_for_line(process, prefix: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in process.tail(100).splitlines():
            if line.startswith(prefix):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no line starting with {prefix!r} within {timeout}s: {process.tail(20)!r}")


def pid_alive(runner: SshRunner, pid: int) -> bool:
    return runner.run(["kill", "-0", str(pid)], check=False).returncode == 0


def test_run_returns_output_and_exit_code(server: SshServer, client_key: Path) -> None:
    runner = runner_for(server, client_key)
    result = runner.run(["sh", "-c", "echo out; echo err >&2; exit 3"], check=False)
    assert result.returncode == 3
    assert result.output.splitlines() == ["out", "err"], "stdout and stderr come back together, in order"
    lines: list[str] = []
    assert runner.run(["printf", "a\\nb\\n"], on_line=lines.append).returncode == 0
    assert lines == ["a", "b"]
    with pytest.raises(RemoteError, match=r"node-a: 'sh -c exit 7' exited 7"):
        runner.run(["sh", "-c", "exit 7"])
    assert runner.run(["no-such-command-here"], check=False).returncode == 127


def test_env_tags_workdir_and_quoting(server: SshServer, client_key: Path, tmp_path: Path) -> None:
    runner = runner_for(server, client_key, workdir=str(tmp_path), tags={"TRAINPIPE_NODE": "node-a"})
    tricky = "it's \"quoted\" $HOME `x` ; rm -rf /"
    result = runner.run(["sh", "-c", 'pwd; printf "%s\\n" "$TRICKY" "$TRAINPIPE_NODE" "$1"', "sh", "a b;c"],
                        env={"TRICKY": tricky})
    assert result.output.splitlines() == [str(tmp_path), tricky, "node-a", "a b;c"]
    with pytest.raises(ValueError, match="not a shell identifier"):
        runner.start(["true"], env={"BAD NAME": "x"})



def test_env_values_are_on_no_command_line_of_the_node(server: SshServer, client_key: Path) -> None:
    """Every user of a node reads every command line on it (/proc/*/cmdline, ps): an environment value (a token, a
    multi-line key) reaches the command whole, and appears in no command line of the sshd host while it runs."""
    runner = runner_for(server, client_key)
    token = "tp-secret-" + secrets.token_urlsafe(24)
    key = f"-----BEGIN KEY-----\n{secrets.token_urlsafe(40)}\n-----END KEY-----"
    script = 'printf "%s\\n" "$TOKEN" | sha256sum; printf "%s" "$KEY" | sha256sum; echo ready; sleep 300'
    process = runner.start(["sh", "-c", script], env={"TOKEN": token, "KEY": key, "EMPTY": ""})
    try:
        wait_for_line(process, "ready")
        seen = 0
        for found in psutil.process_iter(["cmdline"]):
            command_line = "\0".join(found.info["cmdline"] or [])
            seen += "@@trainpipe-pgid" in command_line  # the wrapper of the command above, at least
            assert token not in command_line and key.splitlines()[1] not in command_line, command_line[:200]
        assert seen, "the node's own processes were not among those searched"
        digests = process.tail(10).splitlines()[:2]
        assert [d.split()[0] for d in digests] == [hashlib.sha256(f"{token}\n".encode()).hexdigest(),
                                                   hashlib.sha256(key.encode()).hexdigest()]
    finally:
        process.terminate(grace_s=5)


def test_a_command_whose_environment_is_cut_short_never_runs(server: SshServer, client_key: Path) -> None:
    """The wrapper reads the environment until its end mark: input that stops before it exits 125, the command
    unstarted, rather than running it with half its environment."""
    from infra.compute.access.ssh.command import wrapped_command

    runner = runner_for(server, client_key)
    code, output = runner.exec_quick(wrapped_command(["echo", "ran"], None, None) + " < /dev/null")
    assert code == 125 and "ran" not in output

def test_terminate_ends_the_whole_process_group(server: SshServer, client_key: Path, tmp_path: Path) -> None:
    runner = runner_for(server, client_key)
    log_path = tmp_path / "logs" / "job.log"
    process = runner.start(["python3", "-c", TERM_AWARE], log_path=str(log_path))
    child = int(wait_for_line(process, "child ").split()[1])
    assert process.poll() is None and pid_alive(runner, child)

    started = time.monotonic()
    assert process.terminate(grace_s=10) == 0, "the command handled SIGTERM and exited 0"
    assert time.monotonic() - started < 8, "it ended on SIGTERM, without waiting for SIGKILL"
    assert "got SIGTERM" in process.tail(), "output written while handling SIGTERM still reaches the orchestrator"
    assert not pid_alive(runner, child), "the child in the same process group outlived terminate"
    assert not Path(f"/proc/{child}").exists()
    assert log_path.read_text().splitlines() == [f"child {child}", "got SIGTERM"], "the node's log has it all"


def test_terminate_escalates_to_sigkill(server: SshServer, client_key: Path) -> None:
    runner = runner_for(server, client_key)
    process = runner.start(["sh", "-c", "trap '' TERM; echo ready; sleep 300 & wait"])
    wait_for_line(process, "ready")
    started = time.monotonic()
    assert process.terminate(grace_s=1) == -9
    assert time.monotonic() - started < 10
    assert process.pgid is not None and not Path(f"/proc/{process.pgid}").exists()


def test_node_process_survives_a_lost_connection_and_can_still_be_ended(server: SshServer, client_key: Path,
                                                                         tmp_path: Path) -> None:
    """Like a local node process outliving its orchestrator: the lease watchdog, not the SSH session, ends it."""
    runner = runner_for(server, client_key)
    log_path = tmp_path / "ticks.log"
    process = runner.start(["sh", "-c", "while true; do echo tick; sleep 0.2; done"], log_path=str(log_path))
    wait_for_line(process, "tick")
    close_connections()  # what the node sees when the orchestrator dies or the network drops
    assert process.wait(10) == 255, "a lost connection is not an exit status"
    size = log_path.stat().st_size
    deadline = time.monotonic() + 30
    while log_path.stat().st_size <= size:  # a new tick, written after the connection went away
        assert time.monotonic() < deadline, "the command stopped when the connection went away"
        time.sleep(0.05)
    assert process.pgid is not None and Path(f"/proc/{process.pgid}").exists()

    process.terminate(grace_s=5)  # reaches the process group over a new connection
    deadline = time.monotonic() + 10
    while Path(f"/proc/{process.pgid}").exists():
        assert time.monotonic() < deadline, "the detached process group was not ended"
        time.sleep(0.1)


def test_run_that_loses_its_connection_ends_the_command_and_is_transient(server: SshServer,
                                                                        client_key: Path) -> None:
    """A step run with run() (stage, verify) must not keep running on the node when the task retries it."""
    runner = runner_for(server, client_key)
    marker = "301.25"  # a sleep nothing else runs, to find it in /proc
    started = threading.Event()
    raised: list[BaseException] = []

    def step() -> None:
        try:
            runner.run(["sh", "-c", f"echo go; sleep {marker}"], on_line=lambda line: started.set())
        except BaseException as exc:  # checked below
            raised.append(exc)

    thread = threading.Thread(target=step)
    thread.start()
    assert started.wait(30)
    close_connections()
    thread.join(60)
    assert len(raised) == 1 and isinstance(raised[0], SshConnectError), raised
    assert "connection lost" in str(raised[0]) and is_transient(raised[0])
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and _runs(int(pid), marker)]


def _runs(pid: int, argument: str) -> bool:
    try:
        return argument.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False


def test_write_and_read_text(server: SshServer, client_key: Path, tmp_path: Path) -> None:
    runner = runner_for(server, client_key)
    target = tmp_path / "deep" / "er" / "lease"
    runner.write_text(str(target), "1.5\n")
    runner.write_text(str(target), "héllo ✓\n")  # replaced atomically, parents created once
    assert runner.read_text(str(target)) == "héllo ✓\n"
    assert target.read_text() == "héllo ✓\n"
    assert [p.name for p in target.parent.iterdir()] == ["lease"], "no temporary file left behind"
    assert runner.read_text(str(tmp_path / "missing")) is None


def test_concurrent_commands_share_one_connection(server: SshServer, client_key: Path) -> None:
    """Tasks build a runner per call from many threads; more channels than sshd's MaxSessions (10) still work."""
    runner = runner_for(server, client_key)
    results: list[int] = []
    errors: list[BaseException] = []

    def one(index: int) -> None:
        try:
            results.append(runner_for(server, client_key).run(["sh", "-c", f"sleep 1; exit {index % 3}"],
                                                              check=False).returncode)
        except BaseException as exc:  # surfaced below with the others
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert sorted(results) == sorted(i % 3 for i in range(12))
    assert runner.run(["true"]).returncode == 0


def test_pinned_fingerprint_mismatch_is_refused(servers: tuple[Path, list[SshServer]]) -> None:
    client_key, (server, other) = servers
    runner = runner_for(server, client_key, host_key=other.fingerprint)
    started = time.monotonic()
    with pytest.raises(HostKeyError) as caught:
        runner.run(["true"])
    message = str(caught.value)
    assert f"127.0.0.1:{server.port}" in message and server.fingerprint in message and other.fingerprint in message
    assert "update host_key" in message and "refused" in message
    assert not is_transient(caught.value), "a wrong host key must never be retried"
    assert time.monotonic() - started < 10


def test_known_hosts_verifies_and_refuses(servers: tuple[Path, list[SshServer]], tmp_path: Path) -> None:
    client_key, (server, other) = servers
    good = tmp_path / "known_hosts"
    good.write_text(server.known_hosts_line())
    assert runner_for(server, client_key, host_key=None, known_hosts=str(good)).run(["true"]).returncode == 0

    changed = tmp_path / "changed_hosts"  # the other server's key under this server's name: a changed host key
    changed.write_text(f"[{server.host}]:{server.port} " + other.known_hosts_line().split(" ", 1)[1])
    mismatch = rf"{re.escape(server.fingerprint)} .*does not match known_hosts .*ssh-keygen -R"
    with pytest.raises(HostKeyError, match=mismatch):
        runner_for(server, client_key, host_key=None, known_hosts=str(changed)).run(["true"])

    empty = tmp_path / "empty_hosts"
    empty.write_text(other.known_hosts_line())
    unknown = rf"{re.escape(server.fingerprint)} .*is not in known_hosts .*ssh-keyscan -p {server.port}"
    with pytest.raises(HostKeyError, match=unknown):
        runner_for(server, client_key, host_key=None, known_hosts=str(empty)).run(["true"])

    with pytest.raises(HostKeyError, match="unknown keys are never accepted"):
        runner_for(server, client_key, host_key=None).run(["true"])


def test_wrong_client_key_fails_once_without_retries(server: SshServer, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    stranger = keygen(tmp_path / "stranger", "not-authorized")
    caplog.set_level(logging.WARNING, logger="infra.compute.access.ssh")
    started = time.monotonic()
    with pytest.raises(SshAuthError, match=r"key .*stranger .*was refused: add its public key"):
        runner_for(server, stranger).run(["true"])
    assert time.monotonic() - started < 10
    assert not [r for r in caplog.records if "retrying" in r.getMessage()], "an auth failure was retried"


def test_connection_refused_is_retried_then_fails_in_bounded_time(client_key: Path, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    from sshd import free_port

    caplog.set_level(logging.WARNING, logger="infra.compute.access.ssh")
    port = free_port()  # nothing listens there
    runner = SshRunner(node_name="node-z", host="127.0.0.1", port=port, user="root", key_file=str(client_key),
                       host_key="SHA256:" + "A" * 43, connect_timeout_s=2.0)
    started = time.monotonic()
    expected = rf"node-z: ssh root@127.0.0.1:{port}: not reachable after \d+ attempts"
    with pytest.raises(SshConnectError, match=expected):
        runner.run(["true"])
    assert time.monotonic() - started < 6
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) >= 2 and "ConnectionRefusedError" in retries[0].getMessage()
    with pytest.raises(SshConnectError):
        wait_for_ssh("127.0.0.1", port, timeout=1.0)


def test_a_booting_node_is_waited_for(servers: tuple[Path, list[SshServer]], caplog: pytest.LogCaptureFixture) -> None:
    """Connection refused while the node boots: the runner retries until sshd answers."""
    client_key, (_, other) = servers
    caplog.set_level(logging.WARNING, logger="infra.compute.access.ssh")
    other.stop()
    close_connections()
    booting = threading.Timer(2.0, other.start)
    booting.start()
    try:
        assert runner_for(other, client_key).run(["echo", "up"]).output == "up"
    finally:
        booting.join()
    assert any("retrying" in r.getMessage() for r in caplog.records), "it never had to wait"
    assert wait_for_ssh("127.0.0.1", other.port, timeout=5) < 5


def test_a_slow_sink_never_costs_the_ssh_output_its_last_lines(server: SshServer, client_key: Path) -> None:
    from test_command_output import LINES, PRINT, slow_sink

    seen: list[str] = []
    result = runner_for(server, client_key).run(PRINT, on_line=slow_sink(seen))
    assert result.output.splitlines()[-1] == f"line {LINES - 1}"
    assert len(seen) == LINES
