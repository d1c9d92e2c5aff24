"""Cloud clusters end when their run does, even when nothing of the run is left to end them.

- A killed orchestrator's nodes power off when their lease expires, and the cloud ends them: no sweep involved.
  The orchestrator is the installed `trainpipe run`, unmodified, against the simulated EC2 (moto) and Compute Engine
  (tests/gce_server.py) control planes; the machines behind the instances are stand-ins (tests/cloud_nodes.py says
  what is real there and what is faked: booting, and what a power-off does).
- A sweep from another machine (a different hostname) tells a dead run's cluster from a live one by the heartbeat the
  orchestrator renews on the instances (a tag, a label), and reclaims only the dead one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from aws_server import Ec2Server, moto_ec2
from cloud_env import (
    aws_env,
    aws_left,
    ec2_client,
    gcp_env,
    gcp_key_file,
    gcp_left,
    register_image,
    wait_for,
)
from cloud_nodes import MetadataServer, ec2_instances, ec2_power_off, gce_instances, gce_power_off, machines
from conftest import REPO, TRAINPIPE, cannot_run_here
from gce_server import PROJECT, GceServer
from google.auth.credentials import AnonymousCredentials
from jobs import job_config, make_dataset, write_config
from sshd import require_sshd

from infra.compute.access.agent import NodeAgent
from infra.compute.providers.aws.provider import TAG_HEARTBEAT, AwsProvider
from infra.compute.providers.cloud import lease_alive
from infra.compute.providers.gcp.labels import LABEL_CLUSTER, LABEL_HEARTBEAT
from infra.compute.providers.gcp.provider import GcpProvider
from infra.compute.providers.local import LocalProvider
from infra.compute.renewal import Renewal
from infra.compute.spec import ClusterSpec
from infra.job.plan import cluster_name_for
from infra.node.events import NodeEvent, parse
from infra.node.protocol import NodeCommand, WatchRequest, runs_command

AWS_PREFIX, GCP_PREFIX = "127.77.1.", "127.77.2."  # public: where the stand-ins' sshd listen
# Private (VPC subnet) addresses, distinct from the public ones (127.78.x: other tests' public ones): node-to-node
# traffic must use these.
AWS_PRIVATE_PREFIX, GCP_PRIVATE_PREFIX = "127.79.1.", "127.79.2."
REGION, ZONE = "us-east-1", "us-central1-a"
TTL_S = 10.0  # the shortest lease a job may have
# The watchdog polls once a second; the stand-in's power-off starts an interpreter that calls the API; the test
# polls the simulated cloud. On 2 loaded cores an interpreter's start alone can take seconds: within twice the TTL
# still tells an expired lease from nodes that were never ended (the wait for them gives up at TTL + 60 s).
EXPIRY_SLACK_S = TTL_S


@pytest.fixture(scope="module")
def ec2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ec2Server]:
    with moto_ec2(tmp_path_factory.mktemp("moto"), public_ip_prefix=AWS_PREFIX,
                  private_ip_prefix=AWS_PRIVATE_PREFIX) as server:
        yield server


@pytest.fixture(scope="module")
def image(ec2: Ec2Server) -> str:
    return register_image(ec2, REGION)


@pytest.fixture(scope="module")
def gce() -> Iterator[GceServer]:
    with GceServer(nat_prefix=GCP_PREFIX, network_prefix=GCP_PRIVATE_PREFIX) as server:
        yield server


@pytest.fixture(scope="module")
def gcp_key(gce: GceServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gcp_key_file(tmp_path_factory.mktemp("gcp") / "service-account.json", gce)


def prefect_env() -> dict[str, str]:
    """The session's Prefect server (the prefect_server fixture) for the orchestrators started here."""
    from prefect.settings import PREFECT_API_URL

    return {"PREFECT_API_URL": str(PREFECT_API_URL.value()), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def cloud_job(tmp_path: Path, provider: str, region: str) -> Path:
    config = job_config(tmp_path, make_dataset(tmp_path / "dataset", tokens=200_000), steps=2000)
    config["cluster"] = {"provider": provider, "nodes": 2, "procs_per_node": 1, "regions": [region],
                         "lease_ttl_s": TTL_S, "verify": {"bench": "off"}}
    return write_config(tmp_path / "job.yaml", config)


def watchdogs(stand_ins, address: str) -> list[psutil.Process]:
    found = []
    for pid in stand_ins.processes_of(address):
        try:
            process = psutil.Process(pid)
            if runs_command(process.cmdline(), NodeCommand.WATCH):
                found.append(process)
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_a_killed_orchestrators_nodes_end_when_their_lease_expires(
        provider: str, prefect_server: None, workspace: Path, tmp_path: Path, ec2: Ec2Server, image: str,
        gce: GceServer, gcp_key: Path) -> None:
    require_sshd()
    run_id = f"lease-{provider}"
    cluster = cluster_name_for(run_id)
    if provider == "aws":
        env = aws_env(ec2, image, REGION)
        creds = ec2.env()
        found = ec2_instances(ec2.endpoint, REGION, creds["AWS_ACCESS_KEY_ID"], creds["AWS_SECRET_ACCESS_KEY"])
        power_off = ec2_power_off(ec2.endpoint, REGION, creds["AWS_ACCESS_KEY_ID"], creds["AWS_SECRET_ACCESS_KEY"])
        prefix, metadata = AWS_PREFIX, None

        def left() -> dict[str, list[str]]:
            return aws_left(ec2, cluster, REGION)
    else:
        env = {**gcp_env(gce, gcp_key), "TRAINPIPE_GCP_ZONES": ZONE}
        found, prefix = gce_instances(gce), GCP_PREFIX
        metadata = MetadataServer(PROJECT, lambda: stand_ins.nodes)
        power_off = gce_power_off(metadata)

        def left() -> dict[str, list[str]]:
            return gcp_left(gce, cluster)

    log = tmp_path / "orchestrator.log"
    with machines(tmp_path / "machines", prefix, found, power_off) as stand_ins:
        env = {**os.environ, **prefect_env(), **env, "TRAINPIPE_SSH_KEY_FILE": str(stand_ins.client_key),
               "TRAINPIPE_SSH_USER": "root"}
        config = cloud_job(tmp_path, provider, REGION if provider == "aws" else "us-central1")
        orchestrator = subprocess.Popen([TRAINPIPE, "run", str(config), "--run-id", run_id], cwd=REPO, env=env,
                                        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def watching() -> bool:
                assert orchestrator.poll() is None, "the run ended before its nodes were up:\n" + log.read_text()[
                    -4000:]
                assert not stand_ins.errors, stand_ins.errors
                return len(stand_ins.nodes) == 2 and all(watchdogs(stand_ins, a) for a in stand_ins.nodes)

            wait_for(watching, 240, "both nodes' lease watchdogs starting")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(orchestrator.pid, signal.SIGKILL)
            orchestrator.wait()
        assert left().get("instances"), "the nodes should outlive their orchestrator until the lease expires"

        # No sweep: the nodes' watchdogs, then the cloud.
        ended_s = wait_for(lambda: "instances" not in left(), TTL_S + 60, "the instances ending")
        renewed = max(float((node.root / "mnt/trainpipe/trainpipe/lease").read_text())
                      for node in stand_ins.nodes.values())
        after_renewal_s = time.time() - renewed
        print(f"\n{provider}: instances ended {ended_s:.1f}s after the orchestrator was killed, {after_renewal_s:.1f}s "
              f"after its last lease renewal (lease TTL {TTL_S:g}s)")
        assert after_renewal_s <= TTL_S + EXPIRY_SLACK_S, f"{after_renewal_s:.1f}s is beyond the lease TTL"
        for address, node in stand_ins.nodes.items():
            wait_for(lambda a=address: not stand_ins.processes_of(a), 60, f"{address} powering off")
            events = [e for e in map(parse, (node.root / "mnt/trainpipe/trainpipe/logs/watch.log").read_text()
                                     .splitlines()) if e]
            expired = [e for e in events if e.kind is NodeEvent.LEASE_EXPIRED]
            assert expired and expired[0]["action"] == "shutdown" and expired[0]["age_s"] >= TTL_S, events
        if provider == "aws":
            states = {i["State"]["Name"] for r in ec2_client(ec2, REGION).describe_instances(
                Filters=[{"Name": "tag:trainpipe:cluster", "Values": [cluster]}])["Reservations"]
                for i in r["Instances"]}
            assert states == {"terminated"}, "a powered-off node must be terminated, not merely stopped"
        else:
            deletes = [c for c in gce.calls("DELETE", r"/instances/") if c.status == 200]
            assert sorted(c.authorization or "" for c in deletes) == sorted(
                f"Bearer {token}" for token in metadata.tokens.values()), "each node deletes itself, with its own token"
            metadata.close()

    # What costs nothing and no node can delete (groups, the placement policy) is the sweeper's, as always.
    swept = subprocess.run([TRAINPIPE, "sweep"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert swept.returncode == 0, swept.stderr
    assert left() == {}


def heartbeats(ec2: Ec2Server, gce: GceServer, cluster: str) -> list[float]:
    """The heartbeat each of the cluster's instances carries (an EC2 tag or a GCE label)."""
    gcp = [float(i["labels"][LABEL_HEARTBEAT]) for i in gce.instances()
           if i["labels"].get(LABEL_CLUSTER) == cluster and LABEL_HEARTBEAT in i["labels"]]
    aws = [float(t["Value"]) for r in ec2_client(ec2, REGION).describe_instances(Filters=[
        {"Name": "tag:trainpipe:cluster", "Values": [cluster]}])["Reservations"]
        for i in r["Instances"] for t in i["Tags"] if t["Key"] == TAG_HEARTBEAT]
    return gcp + aws


def test_a_sweep_on_another_machine_takes_the_dead_run_and_leaves_the_live_one(
        workspace: Path, tmp_path: Path, ec2: Ec2Server, image: str, gce: GceServer, gcp_key: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both clouds at once; `trainpipe sweep` runs in a UTS namespace of its own, with another hostname."""
    if os.geteuid() != 0:
        cannot_run_here("a sweeper with another hostname needs a UTS namespace (root)")
    for name, value in aws_env(ec2, image, REGION).items():
        monkeypatch.setenv(name, value)
    key = tmp_path / "id_ed25519"
    key.write_text("not used: the clusters here are never bootstrapped\n")
    monkeypatch.setenv("TRAINPIPE_SSH_KEY_FILE", str(key))
    # Twice the shortest lease: on 2 loaded cores, launching four clusters and starting the sweeper can take TTL_S.
    ttl_s = 2 * TTL_S
    spec = {"nodes": 2, "procs_per_node": 1, "lease_ttl_s": ttl_s}
    aws = AwsProvider(bootstrap=False)
    gcp = GcpProvider(project=PROJECT, credentials=AnonymousCredentials(), api_endpoint=gce.endpoint,
                      zones=(ZONE,), bootstrap=False)
    launched = {}
    for provider, region in ((aws, REGION), (gcp, "us-central1")):
        for state in ("dead", "live"):
            name = f"tp-sweep-{provider.name}-{state}"
            launched[name] = (provider, provider.launch(name, ClusterSpec(provider=provider.name, regions=(region,),
                                                                          **spec), f"sweep-{state}"))
    # The live runs' orchestrator: what its LeaseKeeper does for the cluster (the nodes here are not reachable).
    beating = [Renewal(name, lambda p=provider, c=cluster: p.heartbeat(c), ttl_s / 6).start()
               for name, (provider, cluster) in launched.items() if name.endswith("-live")]
    # The dead runs' orchestrator beat once more just now, then died: at the early sweep they are live too.
    for name, (provider, cluster) in launched.items():
        if name.endswith("-dead"):
            provider.heartbeat(cluster)
    env = {**os.environ, **gcp_env(gce, gcp_key), "TRAINPIPE_GCP_ZONES": ZONE}
    sweep = ["unshare", "--uts", "sh", "-c", "hostname sweeper-elsewhere && hostname && exec \"$@\"", "sweep",
             TRAINPIPE, "sweep"]
    try:
        early = subprocess.run(sweep, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert early.returncode == 0, early.stderr
        assert early.stdout.splitlines()[0] == "sweeper-elsewhere" != os.uname().nodename
        assert "swept 0 clusters" in early.stdout, "a fresh heartbeat is a live run, from any machine"

        # The dead runs' heartbeats (written at launch) age past the lease TTL, by the clock the sweeper reads them
        # with; the live ones are renewed meanwhile.
        dead = [beat for name in launched if name.endswith("-dead") for beat in heartbeats(ec2, gce, name)]
        assert len(dead) == 2 * spec["nodes"], dead
        wait_for(lambda: time.time() > max(dead) + ttl_s, ttl_s * 3, "the dead runs' leases to expire")
        late = subprocess.run(sweep, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert late.returncode == 0, late.stderr
    finally:
        for renewal in beating:
            renewal.stop()
    assert "swept 2 clusters" in late.stdout, late.stdout
    assert aws_left(ec2, "tp-sweep-aws-dead", REGION) == {} and gcp_left(gce, "tp-sweep-gcp-dead") == {}
    assert aws_left(ec2, "tp-sweep-aws-live", REGION).get("instances")
    assert gcp_left(gce, "tp-sweep-gcp-live").get("instances")
    for name in ("tp-sweep-aws-live", "tp-sweep-gcp-live"):
        beats = heartbeats(ec2, gce, name)
        assert beats and all(beat > time.time() - TTL_S for beat in beats), name
    for provider, cluster in launched.values():
        provider.terminate(cluster.name)


def test_lease_alive_reads_the_newest_heartbeat_any_node_carries() -> None:
    now = 10_000.0
    assert lease_alive(["9990", None, "not a time"], "20", created_at=0.0, now=now)
    assert not lease_alive(["9970", "9975"], "20", created_at=0.0, now=now), "older than the TTL on every node"
    assert lease_alive(["9970", "9995"], "20", created_at=0.0, now=now), "one node renewed is enough"
    # Stamped before heartbeats existed: from its creation, with the default TTL (120 s).
    assert lease_alive([], None, created_at=now - 100, now=now)
    assert not lease_alive([None], None, created_at=now - 130, now=now)


def test_a_node_that_cannot_power_off_still_ends_its_processes(tmp_path: Path) -> None:
    """The watchdog's `shutdown` refused (here a stand-in that fails as a non-root user's would): the node's processes
    end anyway, the failure is an event and the exit status, and the sweeper ends the machine."""
    provider = LocalProvider(tmp_path / "clusters")
    cluster = provider.launch("tp-no-power-off", ClusterSpec(nodes=1), "no-power-off")
    node = cluster.head
    refuses = tmp_path / "bin" / "shutdown"
    refuses.parent.mkdir()
    refuses.write_text("#!/bin/sh\necho 'shutdown: Failed to talk to init daemon: access denied' >&2\nexit 1\n")
    refuses.chmod(0o755)
    runner = provider.runner(cluster, node)
    try:
        workload = runner.start(["sleep", "600"])
        watchdog = NodeAgent(runner, node.python).start(
            WatchRequest(lease=node.path("lease"), ttl_s=1, poll_s=0.2, on_expire="shutdown"),
            env={"PATH": f"{refuses.parent}:{os.environ['PATH']}"})
        assert watchdog.wait(timeout=30) == 1
        assert workload.wait(timeout=10) is not None
        events = [e.kind for e in map(parse, watchdog.tail(50).splitlines()) if e]
        assert events[-3:] == [NodeEvent.LEASE_EXPIRED, NodeEvent.POWER_OFF_FAILED, NodeEvent.NODE_DOWN], events
    finally:
        provider.terminate(cluster.name)
