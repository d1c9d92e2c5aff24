"""The ssh provider against real OpenSSH servers on loopback: config checks, launch (host keys, reservations,
bootstrap, rollback), teardown, and the whole retrain flow end to end on a 2-host cluster.

Both "hosts" are this machine behind two sshd servers, each with its own host key and its own workdir, so every
process the cluster starts is visible here for the checks that nothing outlived the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from cmdline_scan import CommandLineScan
from jobs import job_config, make_dataset
from provider_checks import assert_replaces_only_the_lost
from sshd import SshServer, ssh_servers

from infra.checkpoints.store import CheckpointStore
from infra.compute.access.ssh.connection import close_connections
from infra.compute.providers import InvalidRequestError, get_provider
from infra.compute.providers.base import Cluster, ReplacementUnavailable
from infra.compute.providers.local import CLUSTER_TAG
from infra.compute.providers.ssh.provider import RESERVATION, HostReservedError, SshProvider
from infra.compute.spec import ClusterSpec
from infra.job.spec import ConfigError, parse_job
from infra.node.preemption_notice import NOTICE_FILE, Notice, write_notice
from infra.storage import open_store

Servers = tuple[Path, list[SshServer]]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    with ssh_servers(tmp_path_factory.mktemp("sshd"), 2) as found:
        yield found
    close_connections()


@pytest.fixture
def workdirs(tmp_path: Path) -> list[Path]:
    """Each host's NVMe dir, fresh for every test."""
    dirs = [tmp_path / f"nvme-{index}" for index in range(2)]
    for directory in dirs:
        directory.mkdir()
    return dirs


def host_config(server: SshServer, key: Path, workdir: Path, **overrides: Any) -> dict[str, Any]:
    return {"host": server.host, "port": server.port, "user": "root", "key_file": str(key), "workdir": str(workdir),
            "python": sys.executable, "host_key": server.fingerprint, **overrides}


def ssh_spec(servers: Servers, workdirs: list[Path], nodes: int = 2, **overrides: Any) -> ClusterSpec:
    key, found = servers
    hosts = [host_config(server, key, workdir) for server, workdir in zip(found, workdirs, strict=True)]
    return ClusterSpec.model_validate({"provider": "ssh", "nodes": nodes, "ssh": {"hosts": hosts[:max(nodes, 1)]},
                                       **overrides})


def cluster_processes(workdirs: list[Path]) -> list[psutil.Process]:
    """Processes of any cluster launched on these hosts' workdirs (the tag is the cluster's dir on its host)."""
    prefixes = tuple(str(directory) + "/" for directory in workdirs)
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(CLUSTER_TAG, "").startswith(prefixes):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_until(check, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


# -- config ---------------------------------------------------------------------------------------------------------


def _job(cluster: dict[str, Any]) -> dict[str, Any]:
    return {"cluster": cluster, "dataset": {"url": "file:///data/ds"}, "checkpoints": {"url": "s3://b/ckpt"}}


def _error(cluster: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_job(_job(cluster), source="job.yaml")
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_config_errors_name_the_field_and_the_fix(tmp_path: Path) -> None:
    key = tmp_path / "id_ed25519"
    key.write_text("not really a key, but readable\n")
    host = {"host": "10.0.0.1", "user": "ubuntu", "key_file": str(key), "workdir": "/nvme",
            "host_key": "SHA256:" + "a" * 43}

    assert "provider ssh needs cluster.ssh.hosts" in _error({"provider": "ssh", "nodes": 1})
    assert "provider ssh needs cluster.ssh.hosts" in _error({"provider": "ssh", "nodes": 1, "ssh": {"hosts": []}})
    assert "cluster.nodes is 2 but cluster.ssh.hosts lists 1: add hosts or lower cluster.nodes" in _error(
        {"provider": "ssh", "nodes": 2, "ssh": {"hosts": [host]}})
    unpinned = {k: v for k, v in host.items() if k != "host_key"}
    message = _error({"provider": "ssh", "nodes": 1, "ssh": {"hosts": [unpinned]}})
    assert "cluster.ssh: hosts[0] (10.0.0.1:22): no way to verify its host key" in message
    assert "set its host_key" in message and "known_hosts is not set" in message
    known = tmp_path / "known_hosts"
    known.write_text("10.9.9.9 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHc8d5x5d0tAcDqaUo5XHgXAZg8AhM6Aa1gGfGFgPYjK\n")
    message = _error({"provider": "ssh", "nodes": 1, "ssh": {"hosts": [unpinned], "known_hosts": str(known)}})
    assert f"known_hosts ({known}) has no entry for it" in message
    missing = _error({"provider": "ssh", "nodes": 1, "ssh": {"hosts": [{**host, "key_file": str(tmp_path / "nope")}]}})
    assert "cluster.ssh.hosts.0.key_file: key file" in missing and "not a readable file" in missing
    assert "host_key 'MD5:aa' is not a SHA256 fingerprint" in _error(
        {"provider": "ssh", "nodes": 1, "ssh": {"hosts": [{**host, "host_key": "MD5:aa"}]}})
    assert "workdir 'nvme' is not absolute" in _error(
        {"provider": "ssh", "nodes": 1, "ssh": {"hosts": [{**host, "workdir": "nvme"}]}})


def test_a_public_cluster_address_is_refused_at_plan_unless_allowed(tmp_path: Path) -> None:
    """The peer servers and the rendezvous listen on a node's cluster address: a public one is refused (one line naming
    the host and the fix) unless the config allows it; a private one, or a public host with a private cluster address,
    is taken, and becomes the nodes' cluster_address."""
    key = tmp_path / "id_ed25519"
    key.write_text("not really a key, but readable\n")
    pinned = {"user": "ubuntu", "key_file": str(key), "workdir": "/nvme", "host_key": "SHA256:" + "a" * 43}

    def cluster(*hosts: dict[str, Any], nodes: int = 2, **ssh: Any) -> dict[str, Any]:
        return {"provider": "ssh", "nodes": nodes, "ssh": {"hosts": [{**pinned, **h} for h in hosts], **ssh}}

    private = {"host": "10.0.0.1"}
    message = _error(cluster(private, {"host": "198.51.100.7"}))
    assert ("cluster.ssh.hosts[1] (198.51.100.7): cluster address 198.51.100.7 is public, and the peer "
                            "servers and torchrun's rendezvous would listen on it: set its cluster_address to its "
                            "private address, or cluster.ssh.allow_public_cluster_address: true") in message, message
    assert "cluster address 2001:db8::7 is public" in _error(
        cluster(private, {"host": "10.0.0.2", "cluster_address": "2001:db8::7"}))
    assert "cluster.ssh.hosts[0] (h): cluster address h.invalid does not resolve" in _error(
        cluster({"host": "h", "cluster_address": "h.invalid"}, private))

    taken = [
        cluster({"host": "198.51.100.7", "cluster_address": "10.0.0.7"}, {"host": "198.51.100.8",
                                                                          "cluster_address": "192.168.1.8"}),
        cluster({"host": "100.64.0.1"}, {"host": "169.254.0.2"}, {"host": "fd00::3"}, {"host": "localhost"},
                nodes=4),
        cluster({"host": "198.51.100.7"}, {"host": "198.51.100.8"}, allow_public_cluster_address=True),
        cluster({"host": "198.51.100.7"}, nodes=1),  # no peers: nothing listens for them
    ]
    specs = [ClusterSpec.model_validate(config) for config in taken]
    nodes = SshProvider()._new_cluster("tp-addr", specs[0], "r1").nodes
    assert [(n.address, n.cluster_address) for n in nodes] == [("198.51.100.7", "10.0.0.7"),
                                                              ("198.51.100.8", "192.168.1.8")]
    nodes = SshProvider()._new_cluster("tp-addr", specs[1], "r1").nodes
    assert all(n.cluster_address == n.address for n in nodes), "default: the address trainpipe reaches it by"


def test_example_config_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    example = yaml.safe_load((Path(__file__).parent.parent / "examples" / "ssh.yaml").read_text())
    # The example names keys in the user's home; give it readable ones here.
    for host in example["cluster"]["ssh"]["hosts"]:
        key = tmp_path / Path(host["key_file"]).name
        key.write_text("key\n")
        host["key_file"] = str(key)
    job = parse_job(example)
    assert job.cluster.provider == "ssh" and len(job.cluster.ssh.hosts) == job.cluster.nodes == 2


def test_provider_is_instant_and_empty_without_clusters(workspace: Path) -> None:
    started = time.monotonic()
    provider = get_provider("ssh")
    assert provider.list_clusters() == []
    assert provider.describe("tp-nothing") is None and provider.terminate("tp-nothing") is False
    assert time.monotonic() - started < 1.0


# -- launch and teardown --------------------------------------------------------------------------------------------


def test_launch_bootstraps_reserves_and_terminate_cleans_every_host(workspace: Path, servers: Servers,
                                                                    workdirs: list[Path]) -> None:
    provider = SshProvider()
    cluster = provider.launch("tp-boot", ssh_spec(servers, workdirs), "boot")
    for node, workdir in zip(cluster.nodes, workdirs, strict=True):
        assert node.workdir == f"{workdir}/tp-boot" and node.node_python == sys.executable
        assert node.python == provider.last_reports[node.name].agent_python != sys.executable, "the agent's own env"
        assert all((workdir / "tp-boot" / sub).is_dir() for sub in ("data", "ckpt", "logs"))
        holder = json.loads((workdir / RESERVATION).read_text())
        assert holder["cluster"] == "tp-boot" and holder["owner"]["pid"] == os.getpid()

    report = provider.last_reports[cluster.nodes[0].name]
    assert cluster.bootstrap[cluster.nodes[0].name] == report.to_dict(), "reports travel with the record"
    # A record written before bootstrap had its own field kept the reports in the provider's owner state.
    older = json.loads(cluster.to_json())
    older["owner"]["bootstrap"] = older.pop("bootstrap")
    assert Cluster.from_json(json.dumps(older)) == cluster
    findmnt = subprocess.run(["findmnt", "-n", "-o", "TARGET,FSTYPE", "-T", str(workdirs[0])], capture_output=True,
                             text=True, check=True).stdout.split()
    assert [report.mount.target, report.mount.fstype] == findmnt
    assert report.mount.free_bytes > 0 and report.mount.nvme is False
    assert report.gpus == () and report.gpu_error is None, "this machine has no GPUs"
    assert "lo" in [i.name for i in report.interfaces]
    assert report.python == sys.executable and report.agent_python.endswith("/bin/python")

    records = provider.list_clusters()
    assert [(r.name, r.nodes, r.owner_alive) for r in records] == [("tp-boot", 2, True)]
    other_process = SshProvider()  # another process finds it through the workspace record
    assert other_process.describe("tp-boot") == cluster

    # A process on each node, started the way tasks start them, with a child of its own.
    for node in cluster.nodes:
        provider.runner(cluster, node).start(["sh", "-c", "sleep 300 & sleep 300"], log_path=node.path("logs", "x"))
    wait_until(lambda: len(cluster_processes(workdirs)) >= 4)
    assert other_process.nodes_alive(cluster) == {node.name: True for node in cluster.nodes}
    assert other_process.preemption_notices(cluster) == []
    write_notice(workdirs[1] / "tp-boot" / NOTICE_FILE, Notice("chaos: spot notice", time.time() + 30, "chaos"))
    [notice] = other_process.preemption_notices(cluster)
    assert (notice.node, notice.reason) == (cluster.nodes[1].name, "chaos: spot notice"), "read over SFTP"

    assert other_process.terminate("tp-boot") is True
    assert not cluster_processes(workdirs), "processes of the cluster outlived terminate"
    for workdir in workdirs:
        assert list(workdir.iterdir()) == [], "cluster dir or reservation left behind"
    assert provider.describe("tp-boot") is None and provider.list_clusters() == []
    assert provider.terminate("tp-boot") is False, "terminate is idempotent"


def test_unexpected_host_key_refuses_launch_and_leaves_nothing(workspace: Path, servers: Servers,
                                                                workdirs: list[Path]) -> None:
    key, (first, second) = servers
    hosts = [host_config(first, key, workdirs[0]), host_config(second, key, workdirs[1], host_key=first.fingerprint)]
    spec = ClusterSpec.model_validate({"provider": "ssh", "nodes": 2, "ssh": {"hosts": hosts}})
    provider = SshProvider()
    with pytest.raises(InvalidRequestError) as caught:
        provider.launch("tp-badkey", spec, "badkey")
    assert f"127.0.0.1:{second.port}: host key {second.fingerprint}" in str(caught.value)
    assert f"does not match the pinned host_key {first.fingerprint}" in str(caught.value)
    assert list(workdirs[0].iterdir()) == [], "the good host kept a reservation or dir of the failed launch"
    assert provider.describe("tp-badkey") is None and provider.list_clusters() == []


def test_host_reserved_by_a_live_cluster_is_refused(workspace: Path, servers: Servers, workdirs: list[Path]) -> None:
    provider = SshProvider()
    spec = ssh_spec(servers, workdirs, nodes=1)
    provider.launch("tp-first", spec, "first")
    with pytest.raises(HostReservedError, match=r"reserved by cluster tp-first \(run first.*trainpipe down tp-first"):
        provider.launch("tp-second", spec, "second")
    assert json.loads((workdirs[0] / RESERVATION).read_text())["cluster"] == "tp-first", "the holder lost its host"
    assert provider.describe("tp-second") is None and not (workdirs[0] / "tp-second").exists()

    provider.terminate("tp-first")
    provider.launch("tp-second", spec, "second")
    assert json.loads((workdirs[0] / RESERVATION).read_text())["cluster"] == "tp-second"
    provider.terminate("tp-second")


def test_reservation_of_a_dead_run_is_taken_over(workspace: Path, servers: Servers, workdirs: list[Path]) -> None:
    """A run that died without teardown left its reservation, its dir and a process: launch cleans them up."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale_dir = workdirs[0] / "tp-dead"
    stale_dir.mkdir()
    (workdirs[0] / RESERVATION).write_text(json.dumps({
        "cluster": "tp-dead", "run_id": "dead", "record": str(workspace / "ssh-clusters" / "tp-dead.json"),
        "owner": {"pid": dead.pid, "create_time": 0.0, "host": socket.gethostname()}}))
    leftover = subprocess.Popen(["sleep", "300"], env={**os.environ, CLUSTER_TAG: str(stale_dir)})
    try:
        provider = SshProvider()
        provider.launch("tp-new", ssh_spec(servers, workdirs, nodes=1), "new")
        assert leftover.wait(15) is not None, "the dead run's process was not ended"
        assert not stale_dir.exists()
        assert json.loads((workdirs[0] / RESERVATION).read_text())["cluster"] == "tp-new"
        provider.terminate("tp-new")
    finally:
        leftover.kill()


def test_cluster_of_a_dead_run_is_listed_as_orphaned(workspace: Path, servers: Servers, workdirs: list[Path]) -> None:
    """What the sweeper acts on: the record outlives the orchestrator that launched it."""
    provider = SshProvider()
    cluster = provider.launch("tp-orphan", ssh_spec(servers, workdirs, nodes=1), "orphan")
    dead = subprocess.Popen(["true"])
    dead.wait()
    record = workspace / "ssh-clusters" / "tp-orphan.json"
    data = json.loads(record.read_text())
    data["owner"].update(pid=dead.pid, create_time=0.0)
    record.write_text(json.dumps(data))
    assert [(r.name, r.owner_alive) for r in SshProvider().list_clusters()] == [("tp-orphan", False)]
    assert SshProvider().terminate("tp-orphan") is True
    assert list(workdirs[0].iterdir()) == [] and not record.exists()
    assert cluster.nodes[0].workdir == f"{workdirs[0]}/tp-orphan"


def test_unreachable_host_at_teardown_is_reported_and_kept(workspace: Path, servers: Servers,
                                                           workdirs: list[Path]) -> None:
    _, (_, second) = servers
    provider = SshProvider(teardown_connect_s=1.5)
    cluster = provider.launch("tp-gone", ssh_spec(servers, workdirs), "gone")
    second.stop()
    close_connections()
    try:
        assert provider.terminate("tp-gone") is True
        unreached = cluster.nodes[1].name
        assert "not reachable" in provider.last_teardown["tp-gone"][unreached]["error"]
        left = provider.describe("tp-gone")
        assert left is not None and [n.name for n in left.nodes] == [unreached], "the unreached host is forgotten"
        assert provider.nodes_alive(left) == {unreached: True}, "an unreached host must not count as cleaned up"
        assert not (workdirs[0] / "tp-gone").exists() and (workdirs[1] / "tp-gone").exists()
    finally:
        second.start()
    assert provider.terminate("tp-gone") is True
    assert provider.describe("tp-gone") is None and list(workdirs[1].iterdir()) == []


def test_replace_nodes_renews_the_lost_node_on_its_own_host_or_is_unavailable(workspace: Path, servers: Servers,
                                                                             workdirs: list[Path]) -> None:
    _, (_, second) = servers
    provider = SshProvider(teardown_connect_s=1.5)
    cluster = provider.launch("tp-renew", ssh_spec(servers, workdirs), "renew")
    try:
        replaced = assert_replaces_only_the_lost(provider, cluster)
        holder = json.loads((workdirs[1] / RESERVATION).read_text())
        assert holder["cluster"] == "tp-renew", "the host stays reserved for the cluster"
        second.stop()
        close_connections()
        try:
            with pytest.raises(ReplacementUnavailable, match=cluster.nodes[1].name):
                provider.replace_nodes(replaced, [cluster.nodes[1].name])
        finally:
            second.start()
        assert provider.describe("tp-renew") == replaced, "a failed replacement leaves the record as it was"
    finally:
        provider.terminate("tp-renew")
    assert all(list(workdir.iterdir()) == [] for workdir in workdirs)


# -- the whole pipeline ---------------------------------------------------------------------------------------------


def test_retrain_flow_on_two_ssh_hosts(prefect_server: None, workspace: Path, servers: Servers,
                                       workdirs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """...with two secrets (one from the orchestrator's environment, one from a Prefect Secret block) that setup
    checks on every node: neither is in any command line of the sshd host while the run goes on, nor in the flow
    run's parameters on the Prefect server, nor in the summary."""
    from prefect.blocks.system import Secret

    from flows.retrain import retrain

    key, found = servers
    needles = {"env secret": "hf_" + secrets.token_urlsafe(24), "block secret": "db-" + secrets.token_urlsafe(24)}
    monkeypatch.setenv("TP_SSH_TEST_HF_TOKEN", needles["env secret"])
    Secret(value=needles["block secret"]).save("tp-ssh-test-db", overwrite=True)
    digest = hashlib.sha256((needles["env secret"] + needles["block secret"]).encode()).hexdigest()
    config = job_config(tmp_path, make_dataset(tmp_path / "dataset", tokens=200_000), steps=40, ckpt_every=20,
                        setup=[f'test "$(printf %s "$HF_TOKEN$DB_TOKEN" | sha256sum | cut -c1-64)" = {digest}'])
    config["training"]["secrets"] = {"HF_TOKEN": {"env": "TP_SSH_TEST_HF_TOKEN"},
                                     "DB_TOKEN": {"prefect_secret": "tp-ssh-test-db"}}
    config["cluster"] = {"provider": "ssh", "nodes": 2, "procs_per_node": 1, "ssh": {
        "hosts": [host_config(server, key, workdir) for server, workdir in zip(found, workdirs, strict=True)]}}
    job = parse_job(config)

    with CommandLineScan(needles) as scan:
        summary = retrain(job, "ssh-run")

    assert summary["status"] == "completed", summary.get("error")
    assert scan.saw("trainer.train") and scan.saw("infra.node\0sync"), "the scan missed the nodes' processes"
    parameters = flow_run_parameters("ssh-run")
    assert "TP_SSH_TEST_HF_TOKEN" in parameters and "tp-ssh-test-db" in parameters, "the job names its secrets"
    places = {"flow run parameters": parameters, "summary": json.dumps(summary, default=str)}
    hits = scan.hits() + [(name, place) for place, text in places.items() for name, needle in needles.items()
                          if needle in text]
    print(f"\nsecrets scan over ssh nodes: {len(needles)} secrets × {len(scan.command_lines)} command lines of the "
          f"sshd host, the flow run's parameters and the summary: {len(hits)} hits")
    assert hits == []
    assert summary["provider"] == "ssh" and summary["steps"] == 40 and summary["nodes_left"] == 0
    assert summary["checkpoint"].endswith("/ssh-run/step-00000040")
    assert [(a["instance_type"], a["outcome"]) for a in summary["attempts"]] == [("ssh-host", "launched")]
    assert len(summary["node_reports"]) == 2, "bootstrap's node reports belong in the run summary"
    assert all(report["gpus"] == [] for report in summary["node_reports"].values())
    checkpoints = CheckpointStore(open_store(f"{job.checkpoints.url}/ssh-run"))
    assert [c.step for c in checkpoints.committed()] == [40, 20]

    assert not cluster_processes(workdirs), "node processes outlived the run"
    for workdir in workdirs:
        # The host's dataset cache stays, by design: the next run on this host reuses its bytes.
        assert [p.name for p in workdir.iterdir()] == ["dataset-cache"], "cluster dir or reservation outlived the run"
        assert any((workdir / "dataset-cache" / "objects").iterdir()), "the staged objects were not cached"
    assert SshProvider().list_clusters() == []


def flow_run_parameters(run_id: str) -> str:
    """The parameters of the run's flow run, as the Prefect server gives them to its UI and API."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_flow_runs(limit=200) if r.parameters.get("run_id") == run_id]
    assert len(runs) == 1, f"flow runs of {run_id}: {len(runs)}"
    return json.dumps(runs[0].parameters, default=str)
