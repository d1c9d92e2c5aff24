"""Replacing only the lost nodes of a cloud cluster (Provider.replace_nodes), on the simulated control planes: EC2 is
a real `moto_server` (tests/aws_server.py), GCE the stand-in of tests/gce_server.py; no real cloud is reached.

A preemption is played behind the provider's back (EC2: TerminateInstances; GCE: a Spot VM stopping, as GCE reclaims
one). Where the replacement must be reached, the machines behind the simulated instances are stand-ins
(tests/cloud_nodes.py: a real sshd per instance address, serving the host key of its boot script), so the replacement
is reached over SSH with its own pinned key and bootstrapped as a launched node is. Nobody answers at the addresses of
the kill test: its orchestrator waits for the replacement to boot, and is SIGKILLed there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import test_aws_provider as aws_tests
import test_cloud_teardown as teardown_tests
import test_gcp_provider as gcp_tests
from aws_server import Ec2Server
from cloud_env import aws_env, aws_left, ec2_client, gcp_env, gcp_key_file, gcp_left, wait_for
from cloud_nodes import (
    Instance,
    Machines,
    MetadataServer,
    ec2_instances,
    ec2_power_off,
    gce_instances,
    gce_power_off,
    machines,
)
from cloud_nodes import Node as StandIn
from gce_server import PROJECT, GceServer
from google.auth.credentials import AnonymousCredentials
from provider_checks import unreached_key
from sshd import require_sshd
from test_cloud_teardown import AWS_PREFIX, GCP_PREFIX, REGION

import infra.compute.providers.cloud as cloud
import infra.compute.providers.gcp.api as gcp_api
import infra.compute.providers.gcp.labels as gcp_labels
from infra.compute.providers.aws.provider import (
    TAG_CLUSTER,
    TAG_CREATED,
    TAG_HEARTBEAT,
    TAG_HOST_KEY,
    TAG_LEASE_TTL,
    TAG_OWNER,
    TAG_RANK,
    TAG_RUN,
    AwsProvider,
)
from infra.compute.providers.base import Cluster, ReplacementUnavailable
from infra.compute.providers.cloud import HOST_KEYS, CloudProvider
from infra.compute.providers.gcp.provider import GcpProvider
from infra.compute.providers.hosts import HostUnreachableError
from infra.lifecycle.sweep import sweep_clusters

GCP_REGION = "us-central1"
TTL_S = 10.0  # the shortest lease a job may have: the kill test waits for it to expire
CLUSTER_TAGS = (TAG_CLUSTER, TAG_RUN, TAG_OWNER, TAG_CREATED, TAG_LEASE_TTL)
CLUSTER_LABELS = (gcp_labels.LABEL_CLUSTER, gcp_labels.LABEL_RUN, gcp_labels.LABEL_OWNER, gcp_labels.LABEL_CREATED,
                  gcp_labels.LABEL_LEASE_TTL)
# The simulated clouds whose instances have loopback addresses (where the stand-ins answer), module-scoped here too.
ec2, image, gce = teardown_tests.ec2, teardown_tests.image, teardown_tests.gce


@pytest.fixture
def aws_setup(ec2: Ec2Server, image: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    env = {**aws_env(ec2, image, REGION), "TRAINPIPE_SSH_KEY_FILE": str(unreached_key(tmp_path))}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def gcp_setup(gce: GceServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    gce.reset()
    # The simulated API answers at once: poll and back off in milliseconds, not in the seconds GCE needs.
    monkeypatch.setattr(gcp_api, "POLL_FIRST_S", 0.005)
    monkeypatch.setattr(gcp_api, "POLL_MAX_S", 0.02)
    env = {**gcp_env(gce, gcp_key_file(tmp_path / "service-account.json", gce)),
           "TRAINPIPE_GCP_ZONES": f"{GCP_REGION}-a", "TRAINPIPE_SSH_KEY_FILE": str(unreached_key(tmp_path))}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def aws_provider(bootstrap: bool = False) -> AwsProvider:
    return AwsProvider(catalog=aws_tests.small_catalog(), bootstrap=bootstrap)


def gcp_provider(gce: GceServer, bootstrap: bool = False) -> GcpProvider:
    return GcpProvider(catalog=gcp_tests.small_catalog(), project=PROJECT, credentials=AnonymousCredentials(),
                       api_endpoint=gce.endpoint, bootstrap=bootstrap)


def launch(provider: CloudProvider, name: str, nodes: int = 3) -> Cluster:
    if isinstance(provider, AwsProvider):
        spec = aws_tests.spec(nodes=nodes, regions=(REGION,), lease_ttl_s=TTL_S)
    else:
        spec = gcp_tests.spec(nodes=nodes, regions=(GCP_REGION,), lease_ttl_s=TTL_S)
    return provider.launch(name, spec, f"run-{name}")


@contextmanager
def reachable(tmp_path: Path, prefix: str, found: Callable[[], list[Instance]],
              power_off: Callable[[StandIn], str]) -> Iterator[Machines]:
    """Stand-ins for the instances' machines, and the provider's SSH settings to reach them."""
    with machines(tmp_path / "machines", prefix, found, power_off) as stand_ins, pytest.MonkeyPatch.context() as env:
        env.setenv("TRAINPIPE_SSH_KEY_FILE", str(stand_ins.client_key))
        env.setenv("TRAINPIPE_SSH_USER", "root")
        yield stand_ins


def aws_instances(ec2: Ec2Server, cluster: str, *states: str) -> list[dict[str, Any]]:
    filters = [{"Name": "tag:trainpipe:cluster", "Values": [cluster]}]
    if states:
        filters.append({"Name": "instance-state-name", "Values": list(states)})
    return [i for r in ec2_client(ec2, REGION).describe_instances(Filters=filters)["Reservations"]
            for i in r["Instances"]]


def tags(instance: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in instance.get("Tags", [])}


def gce_instance(gce: GceServer, name: str) -> dict[str, Any]:
    [found] = [i for i in gce.instances() if i["name"] == name]
    return found


def metadata(instance: dict[str, Any]) -> dict[str, str]:
    return {item["key"]: item["value"] for item in instance["metadata"].get("items", [])}


# -- (a) the lost node comes back alone, in the cluster's placement -------------------------------------------------


def test_aws_replaces_a_preempted_node_alone_in_the_placement_group(aws_setup: dict[str, str], ec2: Ec2Server,
                                                                    tmp_path: Path) -> None:
    require_sshd()
    cluster = launch(aws_provider(), "tp-replace-aws")
    lost = cluster.nodes[1]
    old_id = cluster.owner["instances"][lost.name]
    ec2_client(ec2, REGION).terminate_instances(InstanceIds=[old_id])  # what a spot reclaim does to it
    creds = ec2.env()
    found = ec2_instances(ec2.endpoint, REGION, creds["AWS_ACCESS_KEY_ID"], creds["AWS_SECRET_ACCESS_KEY"])
    power_off = ec2_power_off(ec2.endpoint, REGION, creds["AWS_ACCESS_KEY_ID"], creds["AWS_SECRET_ACCESS_KEY"])
    with reachable(tmp_path, AWS_PREFIX, found, power_off) as stand_ins:
        provider = aws_provider(bootstrap=True)
        replaced = provider.replace_nodes(cluster, [lost.name])
        new_node = next(n for n in replaced.nodes if n.name == lost.name)
        # Reached over SSH with the replacement's own pinned key, and bootstrapped like a launched node.
        assert provider.runner(replaced, new_node).read_text("/run/trainpipe-boot-status") == "0\n"
        assert stand_ins.errors == []

    new_id = replaced.owner["instances"][lost.name]
    assert new_id != old_id
    assert {n: i for n, i in replaced.owner["instances"].items() if n != lost.name} == \
        {n: i for n, i in cluster.owner["instances"].items() if n != lost.name}, "survivors are untouched"
    assert [(n.name, n.rank) for n in replaced.nodes] == [(n.name, n.rank) for n in cluster.nodes]
    assert new_node.address != lost.address
    assert lost.name in replaced.bootstrap, "the replacement's bootstrap report"
    assert replaced.run_id == cluster.run_id and replaced.created_at == cluster.created_at

    live = {i["InstanceId"]: i for i in aws_instances(ec2, "tp-replace-aws", "pending", "running")}
    assert set(live) == set(replaced.owner["instances"].values())
    new, survivor = live[new_id], live[cluster.owner["instances"][cluster.nodes[0].name]]
    for field in ("InstanceType", "ImageId", "SubnetId", "InstanceLifecycle"):
        assert new.get(field) == survivor.get(field), field
    assert new["Placement"]["GroupName"] == survivor["Placement"]["GroupName"] == "tp-replace-aws"
    assert new["Placement"]["AvailabilityZone"] == survivor["Placement"]["AvailabilityZone"]
    assert [g["GroupId"] for g in new["NetworkInterfaces"][0]["Groups"]] == \
        [g["GroupId"] for g in survivor["NetworkInterfaces"][0]["Groups"]]
    assert {k: tags(new)[k] for k in CLUSTER_TAGS} == {k: tags(survivor)[k] for k in CLUSTER_TAGS}
    assert tags(new)["Name"] == lost.name and tags(new)[TAG_RANK] == str(lost.rank)
    assert TAG_HEARTBEAT in tags(new)
    assert tags(new)[TAG_HOST_KEY] == replaced.owner[HOST_KEYS][lost.name] != cluster.owner[HOST_KEYS][lost.name]

    sweeper = aws_provider()
    assert sweeper.describe("tp-replace-aws").owner["instances"] == replaced.owner["instances"]
    [record] = [r for r in sweeper.list_clusters() if r.name == "tp-replace-aws"]
    assert record.nodes == 3 and record.owner_alive
    assert sweeper.terminate("tp-replace-aws")
    assert aws_left(ec2, "tp-replace-aws", REGION) == {}


def test_gcp_replaces_a_preempted_node_alone_under_the_compact_policy(gcp_setup: dict[str, str], gce: GceServer,
                                                                      tmp_path: Path) -> None:
    require_sshd()
    name = "tp-replace-gcp"
    cluster = launch(gcp_provider(gce), name)
    zone = cluster.owner["zone"]
    lost = cluster.nodes[2]
    old_id = cluster.owner["instances"][lost.name]
    gce.preempt(zone, lost.name)  # GCE reclaiming a Spot VM: STOPPING, then gone
    metadata_server = MetadataServer(PROJECT, lambda: stand_ins.nodes)
    try:
        with reachable(tmp_path, GCP_PREFIX, gce_instances(gce), gce_power_off(metadata_server)) as stand_ins:
            provider = gcp_provider(gce, bootstrap=True)
            replaced = provider.replace_nodes(cluster, [lost.name])
            new_node = next(n for n in replaced.nodes if n.name == lost.name)
            assert provider.runner(replaced, new_node).read_text("/run/trainpipe-boot-status") == "0\n"
            assert stand_ins.errors == []
    finally:
        metadata_server.close()

    assert replaced.owner["instances"][lost.name] != old_id
    assert {n: i for n, i in replaced.owner["instances"].items() if n != lost.name} == \
        {n: i for n, i in cluster.owner["instances"].items() if n != lost.name}, "survivors are untouched"
    assert [(n.name, n.rank) for n in replaced.nodes] == [(n.name, n.rank) for n in cluster.nodes]
    assert lost.name in replaced.bootstrap and replaced.owner["zone"] == zone

    new, survivor = gce_instance(gce, lost.name), gce_instance(gce, cluster.nodes[0].name)
    assert new["status"] == "RUNNING" and new["id"] == replaced.owner["instances"][lost.name]
    assert new["zone"] == survivor["zone"]
    assert new["resourcePolicies"] == survivor["resourcePolicies"]
    assert new["resourcePolicies"][0].endswith(f"/regions/{GCP_REGION}/resourcePolicies/"
                                               f"{gcp_labels.resource_name(name, 'compact')}")
    assert new["machineType"] == survivor["machineType"]
    assert new["scheduling"]["provisioningModel"] == survivor["scheduling"]["provisioningModel"]
    assert new["serviceAccounts"] == survivor["serviceAccounts"]
    assert {k: new["labels"][k] for k in CLUSTER_LABELS} == {k: survivor["labels"][k] for k in CLUSTER_LABELS}
    assert {k: metadata(new)[k] for k in CLUSTER_LABELS} == {k: metadata(survivor)[k] for k in CLUSTER_LABELS}
    assert new["labels"][gcp_labels.LABEL_RANK] == str(lost.rank) and gcp_labels.LABEL_HEARTBEAT in new["labels"]
    assert (metadata(new)[gcp_labels.META_HOST_KEY] == replaced.owner[HOST_KEYS][lost.name]
            != cluster.owner[HOST_KEYS][lost.name])

    sweeper = gcp_provider(gce)
    assert sweeper.describe(name).owner["instances"] == replaced.owner["instances"]
    [record] = [r for r in sweeper.list_clusters() if r.name == name]
    assert record.nodes == 3 and record.owner_alive
    assert sweeper.terminate(name)
    assert gcp_left(gce, name) == {}


# -- (b) no capacity in the placement: ReplacementUnavailable, and nothing of the attempt left ----------------------


def test_aws_without_capacity_in_the_placement_the_replacement_is_unavailable_and_leaves_nothing(
        aws_setup: dict[str, str], ec2: Ec2Server) -> None:
    name = "tp-replace-aws-full"
    provider = aws_provider()
    cluster = launch(provider, name)
    lost = [cluster.nodes[0].name, cluster.nodes[2].name]
    ec2_client(ec2, REGION).terminate_instances(InstanceIds=[cluster.owner["instances"][n] for n in lost])
    # The simulated EC2 never runs out: the stockout is injected on the client, as EC2 answers it. The first
    # replacement starts; the second finds the placement group full, so the first must be ended again.
    remaining = aws_tests.inject_run_instances(provider, [None, "InsufficientInstanceCapacity"])
    with pytest.raises(ReplacementUnavailable) as raised:
        provider.replace_nodes(cluster, lost)
    said = str(raised.value)
    for part in (*lost, f"placement group {name}", "InsufficientInstanceCapacity"):
        assert part in said, said
    assert remaining == [], "both replacements were tried"

    live = aws_instances(ec2, name, "pending", "running", "stopping", "stopped", "shutting-down")
    assert [i["InstanceId"] for i in live] == [cluster.owner["instances"][cluster.nodes[1].name]], \
        "only the survivor is left"
    started = [i for i in aws_instances(ec2, name) if i["InstanceId"] not in cluster.owner["instances"].values()]
    assert [tags(i)["Name"] for i in started] == [lost[0]], "the replacement that started was ended"
    provider.terminate(name)
    assert aws_left(ec2, name, REGION) == {}


def test_gcp_without_capacity_in_the_zone_the_replacement_is_unavailable_and_leaves_nothing(
        gcp_setup: dict[str, str], gce: GceServer) -> None:
    name = "tp-replace-gcp-full"
    provider = gcp_provider(gce)
    cluster = launch(provider, name)
    zone = cluster.owner["zone"]
    lost = [cluster.nodes[0].name, cluster.nodes[1].name]
    for node in lost:
        gce.preempt(zone, node)
    # The simulated GCE refuses the second insert as a stocked-out zone does (an accepted insert whose operation
    # ends with ZONE_RESOURCE_POOL_EXHAUSTED); the first replacement, already running, must be deleted again.
    fault = gce.fail("ZONE_RESOURCE_POOL_EXHAUSTED", zone=zone, after_n_ok_inserts=1)
    with pytest.raises(ReplacementUnavailable) as raised:
        provider.replace_nodes(cluster, lost)
    said = str(raised.value)
    policy = gcp_labels.resource_name(name, "compact")
    for part in (*lost, f"compact policy {policy} in {zone}", "ZONE_RESOURCE_POOL_EXHAUSTED"):
        assert part in said, said
    assert (fault.passed, fault.fired) == (1, 1), "both replacements were tried"
    assert [i["name"] for i in gce.instances() if i["labels"].get(gcp_labels.LABEL_CLUSTER) == name] == \
        [cluster.nodes[2].name], "only the survivor is left"
    provider.terminate(name)
    assert gcp_left(gce, name) == {}


def test_a_replacement_that_never_answers_is_ended_before_the_failure_is_raised(
        aws_setup: dict[str, str], ec2: Ec2Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a capacity problem: the new instance runs but nobody answers at its address (no stand-in here)."""
    name = "tp-replace-aws-mute"
    cluster = launch(aws_provider(), name, nodes=2)
    lost = cluster.nodes[0].name
    ec2_client(ec2, REGION).terminate_instances(InstanceIds=[cluster.owner["instances"][lost]])
    monkeypatch.setattr(cloud, "BOOT_TIMEOUT_S", 1.0)
    with pytest.raises(HostUnreachableError, match=lost):
        aws_provider(bootstrap=True).replace_nodes(cluster, [lost])
    live = aws_instances(ec2, name, "pending", "running", "stopping", "stopped", "shutting-down")
    assert [i["InstanceId"] for i in live] == [cluster.owner["instances"][cluster.nodes[1].name]]
    assert len(aws_instances(ec2, name)) == 3, "the replacement was started, then ended"
    aws_provider().terminate(name)
    assert aws_left(ec2, name, REGION) == {}


# -- (c) kill matrix row: the orchestrator killed while the replacement boots ----------------------------------------

REPLACER = """
import logging, sys
from pathlib import Path
from infra.compute.providers import get_provider
from infra.compute.providers.base import Cluster
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
cluster = Cluster.from_json(Path(sys.argv[1]).read_text())
get_provider(cluster.provider).replace_nodes(cluster, sys.argv[2:])
print("replace_nodes returned", flush=True)
"""


@pytest.mark.parametrize("provider_name", ["aws", "gcp"])
def test_orchestrator_killed_while_a_replacement_boots_leaves_nothing_after_the_sweep(
        provider_name: str, ec2: Ec2Server, image: str, gce: GceServer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"tp-replace-kill-{provider_name}"
    if provider_name == "aws":
        env = {**aws_env(ec2, image, REGION), "TRAINPIPE_SSH_KEY_FILE": str(unreached_key(tmp_path))}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        sweeper: CloudProvider = aws_provider()
        cluster = launch(sweeper, name)
        lost = cluster.nodes[1].name
        ec2_client(ec2, REGION).terminate_instances(InstanceIds=[cluster.owner["instances"][lost]])

        def left() -> dict[str, list[str]]:
            return aws_left(ec2, name, REGION)

        def replacement_started() -> bool:
            return any(tags(i)["Name"] == lost for i in aws_instances(ec2, name, "pending", "running"))

        def heartbeat() -> float:
            return max(float(tags(i).get(TAG_HEARTBEAT, 0)) for i in aws_instances(ec2, name, "pending", "running"))
    else:
        gce.reset()
        env = {**gcp_env(gce, gcp_key_file(tmp_path / "service-account.json", gce)),
               "TRAINPIPE_GCP_ZONES": f"{GCP_REGION}-a", "TRAINPIPE_SSH_KEY_FILE": str(unreached_key(tmp_path))}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        sweeper = gcp_provider(gce)
        cluster = launch(sweeper, name)
        lost = cluster.nodes[1].name
        old_id = cluster.owner["instances"][lost]
        gce.preempt(cluster.owner["zone"], lost)

        def left() -> dict[str, list[str]]:
            return gcp_left(gce, name)

        def replacement_started() -> bool:
            return any(i["name"] == lost and i["id"] != old_id for i in gce.instances())

        def heartbeat() -> float:
            return max(float(i["labels"].get(gcp_labels.LABEL_HEARTBEAT, 0)) for i in gce.instances()
                       if i["labels"].get(gcp_labels.LABEL_CLUSTER) == name)

    record = tmp_path / "cluster.json"
    record.write_text(cluster.to_json())
    log = tmp_path / "replacer.log"
    with log.open("wb") as out:
        # An orchestrator of its own, in a session of its own, as a Prefect worker runs one.
        replacer = subprocess.Popen([sys.executable, "-c", REPLACER, str(record), lost], env={**os.environ, **env},
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: replacement_started() or replacer.poll() is not None, 120, "the replacement starting")
        assert replacer.poll() is None, log.read_text()[-3000:]
    finally:
        os.killpg(replacer.pid, signal.SIGKILL)
        replacer.wait(timeout=30)
    output = log.read_text()
    assert "replace_nodes returned" not in output, output[-3000:]
    left_by_kill = left()
    assert len(left_by_kill["instances"]) == 3, f"survivors and the replacement: {left_by_kill}"
    [owner] = [r for r in sweeper.list_clusters() if r.name == name]
    assert owner.nodes == 3 and owner.owner_alive, "the replacement carries the cluster's tags and heartbeat"
    # Nobody renews the lease any more: once the newest heartbeat is older than the TTL, the sweep takes it all.
    wait_for(lambda: time.time() - heartbeat() > TTL_S, TTL_S + 30, "the heartbeat expiring", interval=0.5)
    swept = sweep_clusters(providers=[sweeper])
    assert [r.name for r in swept] == [name]
    assert left() == {}, f"left after the sweep: {left()}"
