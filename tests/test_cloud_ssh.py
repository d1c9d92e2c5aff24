"""Cloud nodes over SSH with pinned host keys: the key the orchestrator generates (infra.compute.access.hostkeys),
the boot script that installs it, what a launch records (simulated EC2 and GCE: the fingerprint, never the private
key), the SSH settings a launch checks before paying for anything, and real OpenSSH servers (tests/sshd.py) serving
the generated key or another one, reached by the providers' own pinned runners and by the bootstrap that follows a
launch.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import paramiko
import pytest
import test_aws_provider as aws_tests
import test_gcp_provider as gcp_tests
from gce_server import GceServer
from sshd import SshServer, fingerprint, keygen, require_sshd, start_server

import infra.compute.access.ssh.connection
import infra.compute.providers.cloud as cloud
from infra.compute.access.hostkeys import HostKey, fingerprint_of, generate_host_key, install_script
from infra.compute.access.ssh.connection import HostKeyError, close_connections
from infra.compute.access.ssh.runner import SshRunner
from infra.compute.providers.aws.provider import TAG_HOST_KEY, AwsProvider, user_data
from infra.compute.providers.base import Cluster, InvalidRequestError, LaunchError, Node
from infra.compute.providers.cloud import HOST_KEYS, MOUNT, CloudProvider, boot_script
from infra.compute.providers.gcp.boot import startup_script
from infra.compute.providers.gcp.labels import META_HOST_KEY
from infra.compute.providers.gcp.provider import GcpProvider
from infra.compute.providers.hosts import HostUnreachableError
from infra.compute.providers.local import CLUSTER_TAG, NODE_TAG

# The simulated clouds of the provider tests, with their fixtures (module-scoped servers start once here too).
ec2_server = aws_tests.ec2_server
images = aws_tests.images
aws = aws_tests.aws
gce = gcp_tests.gce
gcp = gcp_tests.gcp

PRIVATE_KEY = re.compile(r"-----BEGIN OPENSSH PRIVATE KEY-----\n.*?-----END OPENSSH PRIVATE KEY-----\n", re.DOTALL)
PUBLIC_KEY = re.compile(r"'(ssh-ed25519 [A-Za-z0-9+/=]+) trainpipe-node'")


def fake_systemctl(bin_dir: Path, log: Path, failing: tuple[str, ...] = (), then: str = "") -> dict[str, str]:
    """An environment whose systemctl records its arguments, fails for the units in failing, and otherwise runs then:
    the scripts under test must not restart this machine's sshd."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    units = "|".join(failing) or "no-unit-fails"
    systemctl = bin_dir / "systemctl"
    systemctl.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\ncase "$2" in {units}) exit 1;; esac\n{then}\n')
    systemctl.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def run_bash(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)


def keygen_fingerprint(public_line: str, tmp_path: Path) -> str:
    """The fingerprint `ssh-keygen -lf` prints for a public key line."""
    path = tmp_path / f"key-{time.monotonic_ns()}.pub"
    path.write_text(public_line + "\n")
    return subprocess.run(["ssh-keygen", "-lf", str(path)], check=True, capture_output=True,
                          text=True).stdout.split()[1]


def assert_no_private_key(record: str, script: str) -> None:
    """Neither the private key of script nor any line of it is in record."""
    [private] = PRIVATE_KEY.findall(script)
    assert private not in record
    for line in private.splitlines()[1:-1]:
        assert line not in record, "a line of the host's private key is in the cluster record"


def hand_made_cluster(address: str, workdir: Path, host_key: str, name: str = "tp-ssh-node") -> Cluster:
    """A one-node cluster record as a cloud launch leaves it, for a node that is this machine behind a test sshd."""
    node = Node(name=f"{name}-node-0", rank=0, address=address, workdir=str(workdir), data_dir=str(workdir / "data"),
                ckpt_dir=str(workdir / "ckpt"), python=sys.executable)
    return Cluster(name=name, provider="aws", run_id="run-ssh", nodes=(node,), created_at=time.time(),
                   owner={HOST_KEYS: {node.name: host_key}})


# -- the key and the script that installs it ------------------------------------------------------------------------


def test_generated_host_key_is_what_ssh_keygen_and_paramiko_see(tmp_path: Path) -> None:
    key = generate_host_key()
    public = tmp_path / "host.pub"
    public.write_text(key.public_openssh + "\n")
    listed = subprocess.run(["ssh-keygen", "-lf", str(public)], check=True, capture_output=True, text=True).stdout
    assert listed.split()[1] == key.fingerprint and listed.rstrip().endswith("trainpipe-node (ED25519)")
    assert fingerprint(public) == key.fingerprint == fingerprint_of(key.public_openssh)
    assert re.fullmatch(r"SHA256:[A-Za-z0-9+/]{43}", key.fingerprint), "unpadded base64 of 32 bytes"

    loaded = paramiko.Ed25519Key.from_private_key(io.StringIO(key.private_openssh))
    assert loaded.fingerprint == key.fingerprint
    assert f"{loaded.get_name()} {loaded.get_base64()} trainpipe-node" == key.public_openssh
    private = tmp_path / "host"
    private.write_text(key.private_openssh)
    private.chmod(0o600)
    derived = subprocess.run(["ssh-keygen", "-y", "-f", str(private)], check=True, capture_output=True, text=True)
    assert derived.stdout.split()[:2] == key.public_openssh.split()[:2]

    assert key.private_openssh not in repr(key) and key.fingerprint in repr(key), "a logged key leaks nothing"
    assert generate_host_key().fingerprint != key.fingerprint
    with pytest.raises(ValueError, match="not an OpenSSH public key line"):
        fingerprint_of("ssh-ed25519")


def test_install_script_writes_the_key_with_its_modes_then_restarts_sshd(tmp_path: Path) -> None:
    key = generate_host_key()
    assert "/etc/ssh/ssh_host_ed25519_key" in install_script(key), "the path sshd loads by default"
    ssh_dir = tmp_path / "root" / "etc" / "ssh"
    script = install_script(key, str(ssh_dir))
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)

    log = tmp_path / "systemctl.log"
    done = run_bash("set -euo pipefail\n" + script, fake_systemctl(tmp_path / "bin", log))
    assert done.returncode == 0, done.stderr
    private, public = ssh_dir / "ssh_host_ed25519_key", ssh_dir / "ssh_host_ed25519_key.pub"
    assert private.read_text() == key.private_openssh and public.read_text() == key.public_openssh + "\n"
    assert (private.stat().st_mode & 0o777, public.stat().st_mode & 0o777) == (0o600, 0o644)
    assert sorted(p.name for p in ssh_dir.iterdir()) == [private.name, public.name], "no temporary file left"
    assert fingerprint(public) == key.fingerprint
    assert log.read_text() == "restart ssh\n"

    # A distribution whose unit is sshd; and GCE runs the script again at every boot: same files, same modes.
    log.unlink()
    done = run_bash("set -euo pipefail\n" + script, fake_systemctl(tmp_path / "bin", log, failing=("ssh",)))
    assert done.returncode == 0, done.stderr
    assert log.read_text() == "restart ssh\nrestart sshd\n"
    assert private.read_text() == key.private_openssh and private.stat().st_mode & 0o777 == 0o600

    # No sshd to restart: the script fails (its status tells the orchestrator), it does not carry on silently.
    failed = run_bash("set -euo pipefail\n" + script + "echo carried on\n",
                      fake_systemctl(tmp_path / "bin", log, failing=("ssh", "sshd")))
    assert failed.returncode != 0 and "carried on" not in failed.stdout


def test_boot_scripts_install_the_key_first_and_leave_their_status(tmp_path: Path) -> None:
    key = generate_host_key()
    for script in (user_data(key), startup_script(key)):
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
        assert script.startswith("#!/bin/bash\nset -euo pipefail\n")
        assert key.public_openssh in script and key.private_openssh.rstrip() in script
        # The key and the sshd restart come before the NVMe work (mdadm, mkfs can take minutes).
        assert script.index("systemctl restart ssh") < script.index(f"mkdir -p {MOUNT}") < script.index("mdadm")
        assert cloud.BOOT_STATUS in script

    ssh_dir, status = tmp_path / "etc-ssh", tmp_path / "boot-status"
    env = fake_systemctl(tmp_path / "bin", tmp_path / "systemctl.log")
    # The body runs after the key is in place; a body that fails leaves its exit status, as does one that succeeds.
    body = f'test -s "{ssh_dir}/ssh_host_ed25519_key"\necho body ran\n'
    done = run_bash(boot_script(key, body, status_file=str(status), ssh_dir=str(ssh_dir)), env)
    assert (done.returncode, done.stdout, status.read_text()) == (0, "body ran\n", "0\n"), done.stderr
    failed = run_bash(boot_script(key, "false\necho not reached\n", status_file=str(status), ssh_dir=str(ssh_dir)),
                      env)
    assert (failed.returncode, failed.stdout, status.read_text()) == (1, "", "1\n")
    assert not Path(f"{status}.tmp").exists()


# -- what a launch records ------------------------------------------------------------------------------------------


def test_aws_launch_pins_the_key_of_its_user_data_and_records_no_secret(aws: AwsProvider, tmp_path: Path) -> None:
    calls = aws_tests.record_calls(aws)
    cluster = aws.launch("tp-aws-hostkey", aws_tests.spec(regions=("us-east-1",)), "run-hostkey")
    scripts = [base64.b64decode(p["UserData"]).decode() for _, op, p in calls if op == "RunInstances"]
    assert len(scripts) == 2 and len(set(scripts)) == 1, "one key per cluster"
    [public] = set(PUBLIC_KEY.findall(scripts[0]))
    pinned = keygen_fingerprint(public, tmp_path)
    assert cluster.owner[HOST_KEYS] == {node.name: pinned for node in cluster.nodes}
    [private] = PRIVATE_KEY.findall(scripts[0])
    assert paramiko.Ed25519Key.from_private_key(io.StringIO(private)).fingerprint == pinned
    assert_no_private_key(cluster.to_json(), scripts[0])
    for instance in aws_tests.live(aws, "us-east-1", "tp-aws-hostkey"):
        assert {t["Key"]: t["Value"] for t in instance["Tags"]}[TAG_HOST_KEY] == pinned

    # Another process finds the fingerprints from the tags; a retried launch adopts the running nodes, which keep
    # the key they booted with (the retry's new key is never used, nor recorded).
    other = AwsProvider(catalog=aws_tests.small_catalog(), bootstrap=False)
    described = other.describe("tp-aws-hostkey")
    assert described is not None and described.owner[HOST_KEYS] == cluster.owner[HOST_KEYS]
    again = aws.launch("tp-aws-hostkey", aws_tests.spec(regions=("us-east-1",)), "run-hostkey")
    assert again.owner[HOST_KEYS] == cluster.owner[HOST_KEYS]

    node = cluster.nodes[1]
    runner = other.runner(described, node)
    assert isinstance(runner, SshRunner)
    assert (runner.endpoint.host, runner.endpoint.port, runner.endpoint.host_key) == (node.address, 22, pinned)
    assert (runner.endpoint.user, runner.endpoint.key_file) == ("ubuntu", os.environ["TRAINPIPE_SSH_KEY_FILE"])
    assert runner.workdir == node.workdir == f"{MOUNT}/trainpipe"
    assert runner.tags == {CLUSTER_TAG: node.workdir, NODE_TAG: node.name}
    assert aws.terminate("tp-aws-hostkey") and aws_tests.groups_left(aws, "tp-aws-hostkey") == []


def test_gcp_launch_pins_the_key_of_its_startup_script_and_records_no_secret(gcp: GcpProvider, gce: GceServer,
                                                                             tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINPIPE_SSH_USER", "trainer")
    cluster = gcp.launch("tp-gcp-hostkey", gcp_tests.spec(regions=("us-central1",)), "run-hostkey")
    bodies = gcp_tests.inserts(gce)
    scripts = [gcp_tests.metadata(body)["startup-script"] for body in bodies]
    assert len(scripts) == 2 and len(set(scripts)) == 1, "one key per cluster"
    [public] = set(PUBLIC_KEY.findall(scripts[0]))
    pinned = keygen_fingerprint(public, tmp_path)
    assert cluster.owner[HOST_KEYS] == {node.name: pinned for node in cluster.nodes}
    assert all(gcp_tests.metadata(body)[META_HOST_KEY] == pinned for body in bodies)
    [private] = PRIVATE_KEY.findall(scripts[0])
    assert paramiko.Ed25519Key.from_private_key(io.StringIO(private)).fingerprint == pinned
    assert_no_private_key(cluster.to_json(), scripts[0])

    described = gcp.describe("tp-gcp-hostkey")
    assert described is not None and described.owner[HOST_KEYS] == cluster.owner[HOST_KEYS]
    assert_no_private_key(described.to_json(), scripts[0])
    runner = gcp.runner(described, described.nodes[0])
    assert (runner.endpoint.host_key, runner.endpoint.user) == (pinned, "trainer")
    assert runner.tags == {CLUSTER_TAG: described.nodes[0].workdir, NODE_TAG: described.nodes[0].name}
    assert gcp.terminate("tp-gcp-hostkey") and gcp_tests.left(gce, "tp-gcp-hostkey") == []


def test_without_the_key_file_nothing_is_launched_and_no_runner_is_made(aws: AwsProvider, gcp: GcpProvider,
                                                                        gce: GceServer, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINPIPE_SSH_KEY_FILE")
    calls = aws_tests.record_calls(aws)
    gce.clear_calls()
    for provider, spec in ((aws, aws_tests.spec()), (gcp, gcp_tests.spec())):
        with pytest.raises(InvalidRequestError) as caught:
            provider.launch("tp-nokey", spec, "run-nokey")
        message = str(caught.value)
        assert message.startswith(f"{provider.name}: TRAINPIPE_SSH_KEY_FILE is not set: ") and "\n" not in message
        assert "export TRAINPIPE_SSH_KEY_FILE=" in message and provider.key_hint in message
    assert calls == [] and gce.calls() == [], "the cloud was asked something before the SSH settings were checked"

    monkeypatch.setenv("TRAINPIPE_SSH_KEY_FILE", str(tmp_path / "missing"))
    for provider, spec in ((aws, aws_tests.spec()), (gcp, gcp_tests.spec())):
        with pytest.raises(InvalidRequestError, match=f"TRAINPIPE_SSH_KEY_FILE={tmp_path / 'missing'} is not a "
                                                      "readable file"):
            provider.launch("tp-nokey", spec, "run-nokey")
    assert calls == [] and gce.calls() == []

    monkeypatch.delenv("TRAINPIPE_SSH_KEY_FILE")
    cluster = hand_made_cluster("192.0.2.1", tmp_path, generate_host_key().fingerprint)
    with pytest.raises(InvalidRequestError, match="aws: TRAINPIPE_SSH_KEY_FILE is not set: "):
        aws.runner(cluster, cluster.nodes[0])
    monkeypatch.setenv("TRAINPIPE_SSH_KEY_FILE", str(tmp_path / "missing"))
    unpinned = replace(cluster, owner={})
    with pytest.raises(InvalidRequestError, match="has no pinned host key"):
        aws.runner(unpinned, cluster.nodes[0])


def test_nodes_that_never_answer_are_torn_down(aws: AwsProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    # The simulated instances have addresses with no machine behind them: bootstrap gives up, the launch is undone.
    monkeypatch.setattr(cloud, "BOOT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(infra.compute.access.ssh.connection, "TCP_TIMEOUT_S", 0.3)
    provider = AwsProvider(catalog=aws_tests.small_catalog())
    with pytest.raises(HostUnreachableError) as caught:
        provider.launch("tp-aws-silent", aws_tests.spec(regions=("us-east-1",)), "run-silent")
    assert "tp-aws-silent-node-0" in str(caught.value) and "tp-aws-silent-node-1" in str(caught.value)
    assert [a.outcome for a in getattr(caught.value, "attempts", [])] == ["launched"]
    assert aws_tests.live(aws, "us-east-1", "tp-aws-silent") == []
    assert aws_tests.groups_left(aws, "tp-aws-silent") == []


# -- real sshd servers ----------------------------------------------------------------------------------------------


@dataclass
class Nodes:
    client_key: Path
    host_key: HostKey
    pinned: SshServer  # serves host_key, installed by install_script
    other: SshServer  # serves a key of its own


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    require_sshd()
    root = tmp_path_factory.mktemp("cloud-sshd")
    client_key = keygen(root / "client_ed25519", "test-client")
    host_key = generate_host_key()
    env = fake_systemctl(root / "bin", root / "systemctl.log")
    installed = run_bash("set -euo pipefail\n" + install_script(host_key, str(root / "pinned")), env)
    assert installed.returncode == 0, installed.stderr
    servers = []
    try:
        servers.append(start_server(root / "pinned", client_key.with_suffix(".pub"),
                                    host_key=root / "pinned" / "ssh_host_ed25519_key"))
        servers.append(start_server(root / "other", client_key.with_suffix(".pub")))
        yield Nodes(client_key, host_key, *servers)
    finally:
        for server in servers:
            server.stop()
        close_connections()


@pytest.fixture
def reach(nodes: Nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    """The providers reach the test servers as root (sshd logs users in as themselves) with the client key."""
    monkeypatch.setenv("TRAINPIPE_SSH_USER", "root")
    monkeypatch.setenv("TRAINPIPE_SSH_KEY_FILE", str(nodes.client_key))


@pytest.mark.parametrize("provider_class", [AwsProvider, GcpProvider])
def test_pinned_runner_reaches_the_node_serving_the_generated_key(nodes: Nodes, reach: None, tmp_path: Path,
                                                                  provider_class: type[CloudProvider]) -> None:
    provider = provider_class(bootstrap=False)
    provider.ssh_port = nodes.pinned.port
    assert nodes.pinned.fingerprint == nodes.host_key.fingerprint
    cluster = hand_made_cluster(nodes.pinned.host, tmp_path, nodes.host_key.fingerprint)
    node = cluster.nodes[0]
    result = provider.runner(cluster, node).run(["sh", "-c", 'echo "$TRAINPIPE_CLUSTER $TRAINPIPE_NODE $(pwd)"'])
    assert result.output.strip() == f"{tmp_path} {node.name} {tmp_path}"


@pytest.mark.parametrize("provider_class", [AwsProvider, GcpProvider])
def test_pinned_runner_refuses_a_node_with_another_key(nodes: Nodes, reach: None, tmp_path: Path,
                                                       provider_class: type[CloudProvider]) -> None:
    provider = provider_class(bootstrap=False)
    provider.ssh_port = nodes.other.port
    cluster = hand_made_cluster(nodes.other.host, tmp_path, nodes.host_key.fingerprint)
    with pytest.raises(HostKeyError) as caught:
        provider.runner(cluster, cluster.nodes[0]).run(["touch", str(tmp_path / "ran")])
    message = str(caught.value)
    assert message.startswith(f"{cluster.nodes[0].name}: ssh root@127.0.0.1:{nodes.other.port}: host key "
                              f"{nodes.other.fingerprint} (ssh-ed25519) does not match the pinned host_key "
                              f"{nodes.host_key.fingerprint}: refused")
    assert not (tmp_path / "ran").exists()


def test_bootstrap_waits_for_the_pinned_key_and_the_boot_script(nodes: Nodes, reach: None, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A booting node: sshd first serves the key its image made up, until the boot script installs the cluster's key
    and restarts sshd (here: SIGHUP, which makes sshd re-exec and load its host keys again)."""
    root = tmp_path / "node"
    root.mkdir()
    image_key = keygen(root / "ssh_host_ed25519_key", "image")
    server = start_server(root, nodes.client_key.with_suffix(".pub"), host_key=image_key)
    try:
        assert server.process is not None
        workdir = tmp_path / "work"
        workdir.mkdir()
        host_key = generate_host_key()
        cluster = hand_made_cluster(server.host, workdir, host_key.fingerprint, name="tp-booting")
        status = tmp_path / "boot-status"
        monkeypatch.setattr(cloud, "BOOT_POLL_S", 0.2)
        provider = AwsProvider()
        provider.ssh_port, provider.boot_status = server.port, str(status)

        with caplog.at_level(logging.INFO, logger="infra.compute.providers.cloud"), ThreadPoolExecutor(1) as pool:
            booting = pool.submit(provider.bootstrap_nodes, cluster)
            deadline = time.monotonic() + 60
            while not any("not serving the pinned host key" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline and not booting.done(), "bootstrap never met the image's key"
                time.sleep(0.05)
            env = fake_systemctl(tmp_path / "bin", tmp_path / "systemctl.log", then=f"kill -HUP {server.process.pid}")
            script = boot_script(host_key, "sleep 1\n", status_file=str(status), ssh_dir=str(root))
            booted_script = run_bash(script, env)
            assert booted_script.returncode == 0, booted_script.stderr
            booted = booting.result(timeout=300)

        assert server.fingerprint == host_key.fingerprint, "sshd serves the installed key"
        node = cluster.nodes[0]
        report = provider.last_reports[node.name]
        assert booted.bootstrap == {node.name: report.to_dict()}, "reports travel with the record"
        assert booted.owner[HOST_KEYS] == cluster.owner[HOST_KEYS]
        assert report.node == node.name and report.mount.path == str(workdir.resolve())
        assert report.agent_python == f"{workdir}/agent-env/bin/python", "the agent's own env, linked in the workdir"
        assert report.python == node.node_python, "the image's python made it"

        # A boot script that failed: bootstrap says so and where to look, and does not go on.
        status.write_text("3\n")
        with pytest.raises(LaunchError) as caught:
            provider.bootstrap_nodes(cluster)
        assert str(caught.value) == (f"{node.name}: the boot script failed (exit 3): see "
                                     "/var/log/cloud-init-output.log on the node; the image may lack what it needs "
                                     "(mdadm, mkfs.xfs, systemd's sshd)")
    finally:
        server.stop()
