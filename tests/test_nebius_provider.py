"""The Nebius provider against a gRPC stand-in for the Nebius API (tests/nebius_server.py, built from the SDK's own
service descriptors); no real Nebius is reached.

The provider's own SDK channel (insecure, to the stand-in's port; the token from NEBIUS_IAM_TOKEN, as the SDK reads
it) does every call. Capacity and quota refusals, throttling and preemption are played in the stand-in in the shapes
Nebius uses, so failover, rollback, replacement and teardown run through the real SDK code.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nebius_server import PROJECTS, TOKEN, NebiusServer, Refusal
from provider_checks import unreached_key

import infra.compute.providers.nebius.api as nebius_api
import infra.compute.providers.nebius.provider as nebius_module
from infra.compute.access.hostkeys import generate_host_key
from infra.compute.catalog import Catalog, shipped_catalog
from infra.compute.failover import QuotaEverywhere
from infra.compute.providers import get_provider
from infra.compute.providers.base import ReplacementUnavailable
from infra.compute.providers.cloud import HOST_KEYS
from infra.compute.providers.nebius.boot import user_data
from infra.compute.providers.nebius.config import NebiusClusterSpec
from infra.compute.providers.nebius.labels import (
    LABEL_CLUSTER,
    LABEL_CREATED,
    LABEL_HEARTBEAT,
    LABEL_RANK,
    fingerprint_labels,
    fingerprint_of,
    resource_name,
)
from infra.compute.providers.nebius.provider import NebiusProvider, split_type
from infra.compute.spec import ClusterSpec
from infra.lifecycle.sweep import sweep_clusters

H200 = "gpu-h200-sxm-8gpu-128vcpu-1600gb"
NORTH, WEST = PROJECTS["eu-north1"], PROJECTS["eu-west1"]


@pytest.fixture(scope="module")
def server() -> Iterator[NebiusServer]:
    with NebiusServer() as running:
        yield running


def nebius_catalog() -> Catalog:
    return Catalog(tuple(shipped_catalog().for_provider("nebius")))


def ssh_key(tmp_path: Path) -> Path:
    """The key nodes are reached with, and its public half the boot script installs (never reached here)."""
    key = unreached_key(tmp_path)
    key.with_name("id_ed25519.pub").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITEST trainpipe-test\n")
    return key


def use_fake(server: NebiusServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The provider's SDK pointed at the stand-in (emptied first), with the token it takes."""
    server.fake.reset()
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    # The stand-in answers at once: poll and back off in milliseconds, not in the seconds Nebius needs.
    monkeypatch.setattr(nebius_api, "POLL_FIRST_S", 0.005)
    monkeypatch.setattr(nebius_api, "POLL_MAX_S", 0.02)
    monkeypatch.setattr(nebius_api, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(nebius_module, "IN_USE_FIRST_S", 0.01)


@pytest.fixture
def nebius(server: NebiusServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> NebiusProvider:
    use_fake(server, monkeypatch)
    monkeypatch.setenv("TRAINPIPE_SSH_KEY_FILE", str(ssh_key(tmp_path)))
    return NebiusProvider(catalog=nebius_catalog(), bootstrap=False)


def spec(**fields: Any) -> ClusterSpec:
    base = {"provider": "nebius", "nodes": 3, "procs_per_node": 8, "accelerator": "H200",
            "regions": ("eu-north1", "eu-west1"), "min_network_gbps": 400}
    return ClusterSpec(**{**base, **fields})


def left(server: NebiusServer, cluster: str) -> list[str]:
    """Everything of the cluster still in the stand-in's projects."""
    fake = server.fake
    return [r.metadata.name for r in [*fake.instances.values(), *fake.gpu_clusters.values()]
            if r.metadata.labels.get(LABEL_CLUSTER) == cluster]


def test_registered_and_built_without_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("NEBIUS_IAM_TOKEN", "TRAINPIPE_NEBIUS_CREDENTIALS_FILE", "TRAINPIPE_NEBIUS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no nebius CLI profile either
    started = time.monotonic()
    provider = get_provider("nebius")
    assert provider.name == "nebius" and provider.notice_source == "file"
    assert provider.list_clusters() == [] and provider.describe("tp-x") is None and provider.terminate("tp-x") is False
    assert time.monotonic() - started < 2.0, "building the provider must not import or call the SDK"


def test_launch_puts_every_node_in_one_gpu_cluster_and_teardown_leaves_nothing(nebius: NebiusProvider,
                                                                               server: NebiusServer) -> None:
    section = {"fabrics": {"eu-north1": "fabric-7"}, "boot_disk_gb": 300, "filesystem_id": "computefilesystem-e00fs1",
               "service_account_id": "serviceaccount-e00sa1"}
    cluster = nebius.launch("tp-neb-launch", spec(nebius=section), "run-launch")
    fake = server.fake
    [gpu_cluster] = fake.gpu_clusters.values()
    assert gpu_cluster.spec.infiniband_fabric == "fabric-7" and gpu_cluster.metadata.parent_id == NORTH
    creates = fake.creates()
    assert len(creates) == 3 and len(fake.instances) == 3
    for rank, request in enumerate(creates):
        assert request.metadata.name == resource_name("tp-neb-launch", f"node-{rank}")
        assert request.metadata.labels[LABEL_RANK] == str(rank)
        assert split_type(H200) == (request.spec.resources.platform, request.spec.resources.preset)
        assert request.spec.gpu_cluster.id == gpu_cluster.metadata.id, "every node in the one GPU cluster"
        assert request.spec.network_interfaces[0].subnet_id == f"vpcsubnet-{NORTH.removeprefix('project-')}"
        assert request.spec.network_interfaces[0].HasField("public_ip_address")
        assert request.spec.boot_disk.managed_disk.spec.size_gibibytes == 300
        assert request.spec.filesystems[0].existing_filesystem.id == "computefilesystem-e00fs1"
        assert request.spec.service_account_id == "serviceaccount-e00sa1"
        assert not request.spec.HasField("preemptible"), "spot: never launches regular nodes"
        script = request.spec.cloud_init_user_data
        assert "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITEST" in script and "mount -t virtiofs" in script
        assert "BEGIN OPENSSH PRIVATE KEY" in script
    # One host key per cluster: only its fingerprint is recorded, from the labels.
    pins = set(cluster.owner[HOST_KEYS].values())
    assert len(pins) == 1 and {fingerprint_of(dict(r.metadata.labels)) for r in creates} == pins
    assert not any("PRIVATE KEY" in str(value) for value in cluster.owner.values())
    # Reached at the public address, node-to-node at the private one: distinct, never confused.
    assert all(n.address.startswith("127.77.3.") and n.cluster_address.startswith("127.78.3.") for n in cluster.nodes)
    assert (cluster.instance_type, cluster.market, cluster.owner["region"]) == (H200, "on-demand", "eu-north1")
    assert {c.authorization for c in fake.calls} == {f"Bearer {TOKEN}"}, "the token comes from NEBIUS_IAM_TOKEN"

    described = nebius.describe("tp-neb-launch")
    assert described is not None and described.nodes == cluster.nodes
    assert nebius.nodes_alive(cluster) == {n.name: True for n in cluster.nodes}
    assert nebius.preemption_notices(cluster) == []
    [record] = [r for r in nebius.list_clusters() if r.name == "tp-neb-launch"]
    assert (record.run_id, record.nodes, record.owner_alive) == ("run-launch", 3, True)
    before = float(gpu_cluster.metadata.labels[LABEL_HEARTBEAT])
    gpu_cluster.metadata.labels[LABEL_HEARTBEAT] = f"{before - 100:.0f}"
    nebius.heartbeat(cluster)
    assert float(fake.gpu_clusters[gpu_cluster.metadata.id].metadata.labels[LABEL_HEARTBEAT]) >= before

    assert nebius.terminate("tp-neb-launch") is True
    assert left(server, "tp-neb-launch") == [] and nebius.describe("tp-neb-launch") is None
    assert nebius.terminate("tp-neb-launch") is False, "idempotent"


def test_capacity_fails_over_to_the_next_region_after_rolling_back_a_partial_launch(nebius: NebiusProvider,
                                                                                     server: NebiusServer) -> None:
    # eu-north1's fabric has GPUs for one node only: the second create's operation ends RESOURCE_EXHAUSTED.
    server.fake.refusals.append(Refusal("capacity", project=NORTH, after=1))
    cluster = nebius.launch("tp-neb-failover", spec(), "run-failover")
    assert [(a.region, a.outcome) for a in nebius.last_attempts] == [("eu-north1", "capacity"),
                                                                    ("eu-west1", "launched")]
    assert "not_enough_resources" in (nebius.last_attempts[0].error or "")
    assert cluster.owner["region"] == "eu-west1" and len(cluster.nodes) == 3
    north = [r for r in [*server.fake.instances.values(), *server.fake.gpu_clusters.values()]
             if r.metadata.parent_id == NORTH]
    assert north == [], "the partial launch in eu-north1 is rolled back: its node and its GPU cluster"
    assert nebius.terminate("tp-neb-failover") and left(server, "tp-neb-failover") == []

    # A region this machine has no project in is passed over, not the end of the failover.
    west_only = NebiusProvider(catalog=nebius_catalog(), projects={"eu-west1": WEST}, bootstrap=False)
    west_only.launch("tp-neb-noproject", spec(nodes=1), "run-noproject")
    assert [(a.region, a.outcome) for a in west_only.last_attempts] == [("eu-north1", "error"),
                                                                       ("eu-west1", "launched")]
    assert "names no project in eu-north1" in (west_only.last_attempts[0].error or "")
    assert west_only.terminate("tp-neb-noproject")


def test_preemptible_first_then_regular_and_quota_everywhere_is_one_line(nebius: NebiusProvider,
                                                                         server: NebiusServer) -> None:
    server.fake.refusals.append(Refusal("capacity", preemptible=True))
    cluster = nebius.launch("tp-neb-prefer", spec(nodes=2, spot="prefer"), "run-prefer")
    outcomes = [(a.market, a.outcome) for a in nebius.last_attempts]
    assert outcomes[-1] == ("on-demand", "launched") and ("spot", "capacity") in outcomes
    assert outcomes.index(("spot", "capacity")) < len(outcomes) - 1, "preemptible is tried before regular"
    assert cluster.market == "on-demand"
    assert nebius.terminate("tp-neb-prefer")

    server.fake.refusals[:] = [Refusal("quota")]
    with pytest.raises(QuotaEverywhere) as caught:
        nebius.launch("tp-neb-quota", spec(nodes=2), "run-quota")
    assert "\n" not in str(caught.value) and "quota" in str(caught.value).lower()
    assert left(server, "tp-neb-quota") == [] and server.fake.gpu_clusters == {}


def test_a_stopped_preemptible_node_is_a_notice_and_is_replaced_in_the_same_gpu_cluster(nebius: NebiusProvider,
                                                                                      server: NebiusServer) -> None:
    cluster = nebius.launch("tp-neb-preempt", spec(spot="only"), "run-preempt")
    fake = server.fake
    assert cluster.market == "spot" and all(r.spec.HasField("preemptible") for r in fake.creates())
    lost = cluster.nodes[1]
    ids_before = dict(cluster.owner["instances"])
    stopped: list[str] = []
    fake.on_stop = lambda instance: stopped.append(instance.metadata.name)
    fake.preempt(lost.name)

    assert stopped == [lost.name], "the machine is told as its guest shuts down"
    [notice] = nebius.preemption_notices(cluster)
    assert notice.node == lost.name and "STOPPED" in notice.reason and notice.deadline > time.time()
    assert nebius.nodes_alive(cluster) == {n.name: n.name != lost.name for n in cluster.nodes}

    replaced = nebius.replace_nodes(cluster, [lost.name])
    assert [n.name for n in replaced.nodes] == [n.name for n in cluster.nodes]
    ids_after = replaced.owner["instances"]
    assert ids_after[lost.name] != ids_before[lost.name], "a new instance"
    assert all(ids_after[n] == ids_before[n] for n in ids_before if n != lost.name), "the survivors untouched"
    new = fake.instances[ids_after[lost.name]]
    assert new.spec.gpu_cluster.id == cluster.owner["gpu_cluster"], "inside the same GPU cluster"
    assert new.spec.HasField("preemptible") and new.metadata.labels[LABEL_RANK] == str(lost.rank)
    assert replaced.owner[HOST_KEYS][lost.name] != cluster.owner[HOST_KEYS][lost.name], "its own host key"
    assert nebius.preemption_notices(replaced) == [] and all(nebius.nodes_alive(replaced).values())
    assert nebius.describe("tp-neb-preempt").owner["instances"] == ids_after  # type: ignore[union-attr]
    assert nebius.terminate("tp-neb-preempt") and left(server, "tp-neb-preempt") == []


def test_the_sweeper_takes_dead_clusters_by_label_and_leaves_the_live_one(nebius: NebiusProvider,
                                                                          server: NebiusServer) -> None:
    fake = server.fake
    nebius.launch("tp-neb-live", spec(nodes=2), "run-live")
    nebius.launch("tp-neb-dead", spec(nodes=2, regions=("eu-west1",), lease_ttl_s=10), "run-dead")
    for gpu_cluster in fake.gpu_clusters.values():
        if gpu_cluster.metadata.labels[LABEL_CLUSTER] == "tp-neb-dead":
            gpu_cluster.metadata.labels[LABEL_HEARTBEAT] = f"{time.time() - 60:.0f}"
    # What a launch killed between its GPU cluster and its first node leaves: listed and swept too.
    nebius._gpu_cluster(NORTH, "tp-neb-orphan", "fabric-6", nebius_module.Stamp(
        "tp-neb-orphan", "run-orphan", "someone", f"{time.time() - 600:.0f}", "10"), "test")
    for gpu_cluster in fake.gpu_clusters.values():
        if gpu_cluster.metadata.labels[LABEL_CLUSTER] == "tp-neb-orphan":
            gpu_cluster.metadata.labels[LABEL_HEARTBEAT] = gpu_cluster.metadata.labels[LABEL_CREATED]
    records = {r.name: r for r in nebius.list_clusters()}
    assert {n: r.owner_alive for n, r in records.items()} == {"tp-neb-live": True, "tp-neb-dead": False,
                                                              "tp-neb-orphan": False}
    swept = sweep_clusters(providers=[nebius])
    assert sorted(r.name for r in swept) == ["tp-neb-dead", "tp-neb-orphan"]
    assert left(server, "tp-neb-dead") == [] and left(server, "tp-neb-orphan") == []
    assert len(left(server, "tp-neb-live")) == 3
    assert nebius.terminate("tp-neb-live")


def test_transient_api_errors_are_retried_under_one_idempotency_key(nebius: NebiusProvider,
                                                                    server: NebiusServer) -> None:
    server.fake.unavailable = 2
    nebius.launch("tp-neb-retry", spec(nodes=1), "run-retry")
    first_two = server.fake.calls[:3]
    assert [c.method for c in first_two] == [first_two[0].method] * 3, "the same call, repeated"
    assert len({c.idempotency_key for c in first_two}) == 1 and first_two[0].idempotency_key
    assert nebius.terminate("tp-neb-retry")


def test_the_watchs_reads_are_asked_once_while_nebius_fails_them(nebius: NebiusProvider,
                                                                  server: NebiusServer) -> None:
    """The preemption watch backs off on its own: the provider's 5 attempts under each of its reads (15 s of
    backoff) only blocked its round. Other calls keep their retries."""
    from infra.compute.providers.base import LaunchError

    cluster = nebius.launch("tp-neb-watch", spec(nodes=2, regions=("eu-north1",)), "run-watch")
    server.fake.calls.clear()
    server.fake.outage.start(60)
    try:
        for read in (nebius.nodes_alive, nebius.preemption_notices):
            with pytest.raises(LaunchError, match="UNAVAILABLE"):
                read(cluster)
        assert [c.method for c in server.fake.calls if c.service.endswith("InstanceService")] == ["List", "List"]
    finally:
        server.fake.outage.end()
    assert nebius.terminate("tp-neb-watch")


def test_capacity_while_replacing_is_replacement_unavailable_and_leaves_no_new_node(nebius: NebiusProvider,
                                                                                    server: NebiusServer) -> None:
    cluster = nebius.launch("tp-neb-norepl", spec(nodes=2, spot="only"), "run-norepl")
    server.fake.preempt(cluster.nodes[0].name)
    server.fake.refusals.append(Refusal("capacity"))
    with pytest.raises(ReplacementUnavailable) as caught:
        nebius.replace_nodes(cluster, [cluster.nodes[0].name])
    assert "GPU cluster" in str(caught.value) and "not_enough_resources" in str(caught.value)
    assert [r.metadata.name for r in server.fake.instances.values()] == [cluster.nodes[1].name]
    assert nebius.terminate("tp-neb-norepl")


def test_config_names_fabrics_and_ids_and_the_boot_script_is_valid_bash(tmp_path: Path) -> None:
    section = NebiusClusterSpec()
    assert section.fabric("eu-north1", "gpu-h100-sxm") == "fabric-3" and section.fabric("mars", "x") is None
    assert NebiusClusterSpec(fabrics={"eu-north1": "fabric-2"}).fabric("eu-north1", "gpu-h100-sxm") == "fabric-2"
    with pytest.raises(ValueError, match="not a Nebius resource id"):
        NebiusClusterSpec(subnets={"eu-north1": "my subnet"})
    with pytest.raises(ValueError, match="boot_disk_type"):
        NebiusClusterSpec(boot_disk_type="floppy")
    key = generate_host_key()
    assert fingerprint_of(fingerprint_labels(key.fingerprint)) == key.fingerprint
    script = tmp_path / "user-data.sh"
    script.write_text(user_data(key, "ubuntu", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITEST me", filesystem=True))
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_nodes_reach_nebius_object_storage_with_the_s3_settings_the_job_forwards() -> None:
    from infra.job.spec import parse_job
    from infra.job.store_access import store_access_problem

    def job(secrets: dict[str, Any], dataset: str = "s3://bucket/data") -> Any:
        return parse_job({"cluster": {"provider": "nebius", "nodes": 2}, "dataset": {"url": dataset},
                          "checkpoints": {"url": "s3://bucket/ckpt"},
                          "training": {"command": ["train.py"], "secrets": secrets}})

    forwarded = {name: {"env": name} for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                                                  "AWS_REGION")}
    assert store_access_problem(job(forwarded)) is None
    problem = store_access_problem(job({k: v for k, v in forwarded.items() if k != "AWS_ENDPOINT_URL"})) or ""
    assert problem.startswith("dataset.url s3://bucket/data: the nebius nodes reach Nebius Object Storage") and \
        "add AWS_ENDPOINT_URL to training.secrets" in problem and "storage.eu-north1.nebius.cloud" in problem
    assert "nebius nodes have no credentials for gs:// stores" in (store_access_problem(job(forwarded, "gs://b/d"))
                                                                   or "")


def test_the_example_plans_with_its_candidates_cost_and_fabric(workspace: Path, request: pytest.FixtureRequest,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/nebius.yaml, its bucket in the session's S3 server standing in for Nebius Object Storage (the same
    variables point the S3 engine at either); plan asks no cloud API."""
    from conftest import REPO, run_trainpipe

    from infra.dataset.synth import synthesize
    from infra.job.spec import load_job
    from infra.storage import open_store

    example = REPO / "examples" / "nebius.yaml"
    job = load_job(example)
    s3 = request.getfixturevalue("s3_server")
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    bucket = job.dataset.url.split("://", 1)[1].split("/", 1)[0]
    if not (s3.root / bucket).is_dir():
        s3.make_bucket(bucket)
    synthesize(open_store(job.dataset.url), 200_000, vocab_size=256, shard_tokens=100_000, seed=5)
    result = run_trainpipe("plan", str(example), env=dict(os.environ), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "on nebius: 2 nodes × 8 processes" in result.stdout
    assert f"cheapest {H200}" in result.stdout and "eu-north1" in result.stdout, result.stdout
    assert "3200 Gbps infiniband" in result.stdout and "spot" in result.stdout, result.stdout
    print("\n" + result.stdout)


def stop_notice(stand_ins: Any, instance: Any, notice_s: float) -> None:
    """The guest of a preempted instance shutting down: the stop unit's program (taken verbatim from the boot
    script) runs in the node, writes its notice and holds the shutdown while the node's watcher stops the trainer and
    the syncer ships the last save; then the power goes."""
    from cloud_env import wait_for
    from nebius_server import NOTICE_PROGRAM, public_address

    from infra.node.events import NodeEvent, parse

    address = public_address(instance)
    node = stand_ins.nodes[address]
    [program] = NOTICE_PROGRAM.findall(instance.spec.cloud_init_user_data)
    (node.root / "stop-notice.py").write_text(program)
    holding = subprocess.Popen(["nsenter", "--target", str(node.process.pid), "--mount", "python3",
                                str(node.root / "stop-notice.py")], start_new_session=True)
    watch_log = node.root / "mnt/trainpipe/trainpipe/logs/watch.log"

    def trainer_stopped() -> bool:
        lines = watch_log.read_text().splitlines() if watch_log.exists() else []
        return any((e := parse(line)) is not None and e.kind is NodeEvent.TRAINER_STOPPED for line in lines)

    try:
        wait_for(trainer_stopped, notice_s, "the node's watcher stopping the trainer on the stop notice")
    finally:
        holding.kill()
        holding.wait()
        for pid in stand_ins.processes_of(address):  # the power goes
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_run_on_nebius_is_preempted_once_resumes_commits_and_leaves_nothing(
        server: NebiusServer, prefect_server: None, workspace: Path, tmp_path: Path) -> None:
    """`trainpipe run`, unmodified, against the stand-in API, its nodes' machines stand-ins too (tests/cloud_nodes.py:
    an sshd per instance at its public address, serving the host key of its cloud-init script). Node 1, preemptible,
    is preempted after the first commit: the API shows it STOPPING, its guest's stop unit writes the notice, the
    watcher stops the trainer and the last save is committed; the run replaces node 1 inside the same GPU cluster,
    resumes from the commit on both nodes, finishes and leaves no instance and no GPU cluster."""
    import threading

    from cloud_env import wait_for
    from cloud_nodes import machines
    from conftest import REPO, TRAINPIPE
    from jobs import job_config, make_dataset, write_config
    from nebius_server import nebius_instances, nebius_power_off
    from sshd import require_sshd
    from test_kill_matrix import prefect_env

    from infra.checkpoints.store import CheckpointStore
    from infra.compute.providers.nebius.boot import NOTICE_S
    from infra.storage import open_store

    require_sshd()
    fake = server.fake
    fake.reset()
    run_id = "nebius-e2e"
    config = job_config(tmp_path, make_dataset(tmp_path / "dataset", tokens=200_000), steps=150, ckpt_every=20,
                        step_delay_s=0.05)
    config["cluster"] = {"provider": "nebius", "nodes": 2, "procs_per_node": 1, "regions": ["eu-north1"],
                         "spot": "only", "lease_ttl_s": 60, "verify": {"bench": "off"}}
    config["recovery"] = {"max_recoveries": 2, "confirm_s": 2}
    config_path = write_config(tmp_path / "job.yaml", config)
    checkpoints = CheckpointStore(open_store(f"{config['checkpoints']['url']}/{run_id}"))
    log = tmp_path / "orchestrator.log"
    with machines(tmp_path / "machines", "127.77.3.", nebius_instances(server), nebius_power_off(server)) as stand_ins:
        fake.on_stop = lambda instance: stop_notice(stand_ins, instance, NOTICE_S)
        env = {**os.environ, **prefect_env(), **server.env(), "TRAINPIPE_HOME": str(workspace),
               "TRAINPIPE_SSH_KEY_FILE": str(stand_ins.client_key), "TRAINPIPE_SSH_USER": "root"}
        orchestrator = subprocess.Popen([TRAINPIPE, "run", str(config_path), "--run-id", run_id], cwd=REPO, env=env,
                                        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        preempted: list[str] = []

        def preempt_after_the_first_commit() -> None:
            wait_for(lambda: orchestrator.poll() is not None or checkpoints.latest() is not None, 400,
                     "the first commit")
            if orchestrator.poll() is None:
                [lost] = [i.metadata.name for i in fake.running() if i.metadata.labels[LABEL_RANK] == "1"]
                preempted.append(lost)
                fake.preempt(lost)

        injector = threading.Thread(target=preempt_after_the_first_commit, daemon=True)
        injector.start()
        try:
            orchestrator.wait(timeout=540)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(orchestrator.pid, signal.SIGKILL)
            injector.join(timeout=30)
        output = log.read_text()
        assert orchestrator.returncode == 0 and not stand_ins.errors, output[-6000:] + str(stand_ins.errors)

    summary = json.loads((workspace / "runs" / run_id / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["nodes_left"] == 0, summary
    assert preempted, "the run ended before its first commit was preempted"
    [recovery] = summary["recoveries"]
    assert recovery["with_notice"] and "nebius" in recovery["reason"], recovery
    assert (recovery["path"], recovery["replaced"]) == ("replaced-nodes", preempted), recovery
    assert recovery["resumed_from_step"] and summary["checkpoint_step"] > recovery["resumed_from_step"]
    # Nothing trained before the notice is lost: the save the watcher's SIGTERM asked for was committed (periodic
    # commits come every 20 steps, the preemption at a step the head reported before it).
    assert recovery["resumed_from_step"] >= recovery["step_reached"], recovery
    # The replacement went into the GPU cluster of the launch, and nothing of the cluster is left.
    creates = [c.request for c in fake.calls if c.method == "Create" and c.service.endswith("InstanceService")]
    assert len(creates) == 3 and len({r.spec.gpu_cluster.id for r in creates}) == 1
    assert fake.instances == {} and fake.gpu_clusters == {}
    print(f"\nnebius fake: phases {summary['phases']}")
    print(f"nebius fake: launch to first step {summary['time_to_first_step_s']:.1f}s; preempted {preempted[0]} at "
          f"step {recovery['step_reached']}, resumed from {recovery['resumed_from_step']} "
          f"({recovery['time_to_first_step_s']:.1f}s to the first step after it)")


def test_refused_credentials_stop_the_launch_at_once_in_one_line(nebius: NebiusProvider, server: NebiusServer,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from infra.compute.providers.nebius.errors import AuthError

    monkeypatch.setenv("NEBIUS_IAM_TOKEN", "a-revoked-token")
    refused = NebiusProvider(catalog=nebius_catalog(), bootstrap=False)
    with pytest.raises(AuthError) as caught:
        refused.launch("tp-neb-auth", spec(nodes=1), "run-auth")
    assert "UNAUTHENTICATED" in str(caught.value) and "\n" not in str(caught.value)
    assert [a.outcome for a in refused.last_attempts] == ["invalid"], "nowhere else would take these credentials"
    assert server.fake.instances == {} and server.fake.gpu_clusters == {}


def test_a_service_account_credentials_file_is_exchanged_for_a_token_by_the_sdk(
        nebius: NebiusProvider, server: NebiusServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NEBIUS_IAM_TOKEN")
    credentials = server.fake.credentials_file(tmp_path / "credentials.json")
    monkeypatch.setenv("TRAINPIPE_NEBIUS_CREDENTIALS_FILE", str(credentials))
    provider = NebiusProvider(catalog=nebius_catalog(), bootstrap=False)
    provider.launch("tp-neb-sa", spec(nodes=1), "run-sa")
    calls = server.fake.calls
    assert calls[0].method == "Exchange" and calls[0].authorization == "", "the SDK got its token first"
    assert {c.authorization for c in calls[1:]} == {f"Bearer {TOKEN}"}
    assert provider.terminate("tp-neb-sa") and left(server, "tp-neb-sa") == []
