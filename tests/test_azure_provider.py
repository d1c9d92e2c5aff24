"""The Azure provider against a simulated Azure Resource Manager (tests/azure_arm_server.py); no real Azure is reached.

The provider's own azure-mgmt clients talk HTTPS to the simulated ARM (its certificate trusted through
REQUESTS_CA_BUNDLE, as a proxy's would be), with a credential that hands out a fake token. Capacity and quota refusals
are injected in the server and arrive in ARM's shapes (a 409 refusal, or an accepted VM whose operation fails), so
failover, rollback, replacement and teardown run through the real SDK code, long-running-operation pollers included.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from azure.core.credentials import AccessToken
from azure.core.exceptions import HttpResponseError, ServiceRequestError
from azure_arm_server import SUBSCRIPTION, ArmServer
from conftest import REPO, run_trainpipe
from jobs import job_config, make_dataset
from provider_checks import assert_reports_launched_cluster, unreached_key

import infra.compute.providers.azure.arm as azure_arm
import infra.compute.providers.azure.provider as provider_module
from infra.compute.catalog import Catalog, shipped_catalog
from infra.compute.failover import QuotaEverywhere
from infra.compute.providers import get_provider
from infra.compute.providers.azure.boot import poweroff_deletes_script
from infra.compute.providers.azure.errors import AuthError, classify
from infra.compute.providers.azure.names import (
    TAG_CLUSTER,
    TAG_HEARTBEAT,
    TAG_HOST_KEY,
    TAG_RANK,
    TAG_RUN,
    group_name,
    nic_name,
    public_ip_name,
    vm_name,
)
from infra.compute.providers.azure.provider import AzureProvider
from infra.compute.providers.base import CapacityError, InvalidRequestError, LaunchError, PriceError, QuotaError
from infra.compute.providers.cloud import HOST_KEYS, MOUNT
from infra.compute.spec import ClusterSpec
from infra.job.plan import plan_job
from infra.job.spec import parse_job
from infra.lifecycle.sweep import sweep_clusters
from infra.node import azure_self_delete
from infra.node.preemption_notice import azure_notice

REGIONS = ("eastus", "westeurope")
IDENTITY = (f"/subscriptions/{SUBSCRIPTION}/resourceGroups/identities/providers/Microsoft.ManagedIdentity/"
            "userAssignedIdentities/trainer")
PUBLIC_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITrainpipeTestKey you@host"


class FakeToken:
    """A credential as azure-identity's are (get_token), whose token the simulated ARM accepts."""

    def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        return AccessToken("fake-token", int(time.time()) + 3600)


@pytest.fixture(scope="module")
def arm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ArmServer]:
    with ArmServer(tmp_path_factory.mktemp("arm")) as server:
        yield server


def small_catalog() -> Catalog:
    shipped = shipped_catalog()
    return Catalog(tuple(i for i in shipped.for_provider("azure")
                         if i.name in ("Standard_ND96asr_v4", "Standard_ND96amsr_A100_v4")))


def azure_provider(arm: ArmServer, catalog: Catalog | None = None, bootstrap: bool = False) -> AzureProvider:
    return AzureProvider(catalog=catalog or small_catalog(), subscription=SUBSCRIPTION, credential=FakeToken(),
                         endpoint=arm.endpoint, bootstrap=bootstrap)


def use_fake(arm: ArmServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process reaches the simulated ARM as it would Azure's: its certificate trusted, SSH opened to loopback,
    and polled in milliseconds, not in the seconds Azure needs (it answers at once)."""
    monkeypatch.setenv("TRAINPIPE_SSH_CIDR", "127.0.0.1/32")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(arm.ca_file))
    monkeypatch.setattr(azure_arm, "POLL_S", 0.005)
    monkeypatch.setattr(azure_arm, "WAIT_STEP_S", 0.005)
    monkeypatch.setattr(azure_arm, "RETRY_FIRST_S", 0.01)


@pytest.fixture
def azure(arm: ArmServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> AzureProvider:
    arm.reset()
    # Launch checks the key nodes are reached with before paying for anything; nothing answers at the simulated
    # VMs' addresses here, so bootstrap is off (tests/test_replace_cloud.py and test_kill_matrix.py reach them).
    monkeypatch.setenv("TRAINPIPE_SSH_KEY_FILE", str(unreached_key(tmp_path)))
    monkeypatch.setenv("TRAINPIPE_AZURE_SSH_PUBLIC_KEY", PUBLIC_KEY)
    use_fake(arm, monkeypatch)
    return azure_provider(arm)


def spec(**fields: Any) -> ClusterSpec:
    base = {"provider": "azure", "nodes": 2, "procs_per_node": 8, "accelerator": "A100", "local_nvme": True,
            "min_network_gbps": 400, "regions": REGIONS}
    return ClusterSpec(**{**base, **fields})


def vm_puts(arm: ArmServer, status: int | None = None) -> list[dict[str, Any]]:
    return [c.body or {} for c in arm.calls("PUT", "/virtualMachines/") if status in (None, c.status)]


def left(arm: ArmServer, cluster: str) -> list[str]:
    """The cluster's group and everything in it, if any is still there."""
    group = group_name(cluster)
    return [g["name"] for g in arm.groups() if g["name"] == group] + [r["name"] for r in arm.resources(group=group)]


def test_provider_is_registered_and_needs_no_credentials_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AZURE_SUBSCRIPTION_ID", "TRAINPIPE_AZURE_SUBSCRIPTION"):
        monkeypatch.delenv(name, raising=False)
    started = time.monotonic()
    provider = get_provider("azure")
    assert provider.name == "azure" and provider.notice_source == "azure" and provider.list_clusters() == []
    assert provider.describe("tp-nothing") is None and provider.terminate("tp-nothing") is False
    assert time.monotonic() - started < 2.0


def test_launch_places_spot_nodes_with_identity_and_addresses_then_teardown_leaves_nothing(
        azure: AzureProvider, arm: ArmServer) -> None:
    job = spec(regions=("eastus",), spot="only", max_price_per_hour=30, azure={"identity": IDENTITY})
    cluster = azure.launch("tp-az-basic", job, "run-basic")

    assert [n.rank for n in cluster.nodes] == [0, 1] and cluster.run_id == "run-basic"
    assert (cluster.instance_type, cluster.market) == ("Standard_ND96asr_v4", "spot")
    assert [a.outcome for a in azure.last_attempts] == ["launched"]
    assert all(n.workdir == f"{MOUNT}/trainpipe" for n in cluster.nodes)
    # Reached at the public IP, the fabric's traffic on the NIC's private IP: distinct, each of its kind.
    assert all(n.address.startswith("127.77.4.") and n.cluster_address.startswith("127.78.4.") for n in cluster.nodes)
    assert len({n.address for n in cluster.nodes} | {n.cluster_address for n in cluster.nodes}) == 4

    group = group_name("tp-az-basic")
    [avset] = arm.resources("availabilitySets", group)
    [ppg] = arm.resources("proximityPlacementGroups", group)
    assert avset["properties"]["proximityPlacementGroup"]["id"].lower() == ppg["id"].lower()
    [nsg] = arm.resources("networkSecurityGroups", group)
    [rule] = nsg["properties"]["securityRules"]
    assert (rule["properties"]["destinationPortRange"], rule["properties"]["sourceAddressPrefix"]) == \
        ("22", "127.0.0.1/32")
    bodies = vm_puts(arm)
    assert len(bodies) == 2
    for rank, body in enumerate(bodies):
        properties = body["properties"]
        assert (properties["priority"], properties["evictionPolicy"]) == ("Spot", "Delete")
        assert properties["billingProfile"] == {"maxPrice": 15.0}  # the cluster's cap, per VM
        assert properties["proximityPlacementGroup"]["id"].lower() == ppg["id"].lower()
        assert properties["availabilitySet"]["id"].lower() == avset["id"].lower()
        assert properties["hardwareProfile"] == {"vmSize": "Standard_ND96asr_v4"}
        # The nodes reach the store as the managed identity: no key goes to them.
        assert body["identity"] == {"type": "UserAssigned", "userAssignedIdentities": {IDENTITY: {}}}
        [nic] = properties["networkProfile"]["networkInterfaces"]
        assert nic["properties"]["deleteOption"] == "Delete"
        assert properties["osProfile"]["linuxConfiguration"]["ssh"]["publicKeys"][0]["keyData"] == PUBLIC_KEY
        script = base64.b64decode(properties["osProfile"]["customData"]).decode()
        assert "mdadm --create /dev/md0" in script and "/dev/nvme[0-9]*n1" in script
        assert body["tags"][TAG_RANK] == str(rank) and body["tags"][TAG_RUN] == "run-basic"
        assert body["tags"][TAG_HOST_KEY] == cluster.owner[HOST_KEYS][cluster.nodes[rank].name]
    [group_record] = [g for g in arm.groups() if g["name"] == group]
    assert group_record["tags"][TAG_CLUSTER] == "tp-az-basic" and TAG_HEARTBEAT in group_record["tags"]

    assert_reports_launched_cluster(azure, cluster, "tp-az-basic", "run-basic")

    arm.clear_calls()
    assert azure.terminate("tp-az-basic") is True
    assert [c.path.rsplit("/", 1)[-1] for c in arm.calls("DELETE")] == [group]
    assert left(arm, "tp-az-basic") == []
    assert azure.describe("tp-az-basic") is None
    assert azure.terminate("tp-az-basic") is False  # idempotent


def test_failover_through_capacity_and_a_partial_launch_that_is_rolled_back(azure: AzureProvider,
                                                                           arm: ArmServer) -> None:
    # Spot candidates in order: ND96asr eastus, westeurope, then ND96amsr eastus, westeurope; on-demand after.
    arm.fail("SkuNotAvailable", region="eastus", spot=True)  # refused outright (409)
    # Rank 0 is allocated, rank 1's allocation fails in its operation: rank 0 must be rolled back.
    partial = arm.fail("AllocationFailed", region="westeurope", spot=True, after=1, times=1)
    # Then the next westeurope try (ND96amsr) allocates rank 0 and fails rank 1 too (faults count in order).
    arm.fail("OverconstrainedAllocationRequest", region="westeurope", spot=True, after=2, times=1)
    cluster = azure.launch("tp-az-failover", spec(spot="prefer"), "run-failover")

    assert [(a.instance_type, a.region, a.market, a.outcome) for a in azure.last_attempts] == [
        ("Standard_ND96asr_v4", "eastus", "spot", "capacity"),
        ("Standard_ND96asr_v4", "westeurope", "spot", "capacity"),
        ("Standard_ND96amsr_A100_v4", "eastus", "spot", "capacity"),
        ("Standard_ND96amsr_A100_v4", "westeurope", "spot", "capacity"),
        ("Standard_ND96asr_v4", "eastus", "on-demand", "launched")]
    errors = [a.error or "" for a in azure.last_attempts]
    assert "SkuNotAvailable" in errors[0] and "AllocationFailed" in errors[1]
    assert "OverconstrainedAllocationRequest" in errors[3]
    assert (partial.passed, partial.fired) == (1, 1)
    assert cluster.owner["region"] == "eastus" and cluster.market == "on-demand"
    # Every failed try's group (rank 0 of the partial one included) was deleted; only the launched one is left.
    assert [g["name"] for g in arm.groups()] == [group_name("tp-az-failover")]
    assert [c.status for c in arm.calls("DELETE", "/resourcegroups/")] == [202] * 4
    assert all(vm["properties"].get("priority") == "Regular" for vm in arm.resources("virtualMachines"))
    assert azure.terminate("tp-az-failover") and left(arm, "tp-az-failover") == []


def test_quota_blocks_the_region_and_everywhere_is_one_line(azure: AzureProvider, arm: ArmServer) -> None:
    arm.fail("OperationNotAllowed", region="eastus", spot=True)  # LowPriorityCores quota: Spot only
    cluster = azure.launch("tp-az-quota", spec(spot="prefer"), "run-quota")
    assert cluster.market == "spot" and cluster.owner["region"] == "westeurope"
    assert [(a.instance_type, a.region, a.market, a.outcome) for a in azure.last_attempts] == [
        ("Standard_ND96asr_v4", "eastus", "spot", "quota"),
        ("Standard_ND96asr_v4", "westeurope", "spot", "launched")]
    assert "LowPriorityCores" in (azure.last_attempts[0].error or "")
    assert azure.terminate("tp-az-quota")

    arm.fail("OperationNotAllowed")
    with pytest.raises(QuotaEverywhere) as caught:
        azure.launch("tp-az-noquota", spec(regions=("eastus",)), "run-noquota")
    assert [a.outcome for a in caught.value.attempts] == ["quota", "skipped"]
    assert "\n" not in str(caught.value) and left(arm, "tp-az-noquota") == []


def test_permission_errors_stop_at_once_and_leave_nothing(azure: AzureProvider, arm: ArmServer) -> None:
    fault = arm.fail("AuthorizationFailed")
    with pytest.raises(AuthError) as caught:
        azure.launch("tp-az-auth", spec(spot="prefer"), "run-auth")
    message = str(caught.value)
    assert message.startswith("azure: launch tp-az-auth on Standard_ND96asr_v4 eastus spot: AuthorizationFailed: ")
    assert "Contributor" in message and "\n" not in message
    assert [a.outcome for a in azure.last_attempts] == ["invalid"] and fault.fired == 1
    assert left(arm, "tp-az-auth") == []


def test_a_users_own_group_of_the_clusters_name_survives_the_refused_launch(azure: AzureProvider,
                                                                           arm: ArmServer) -> None:
    """A group named like the cluster's but not tagged as it (the user's own) is refused, and the launch's rollback
    leaves it: before, the rollback deleted it without the tag check every other delete makes."""
    group = group_name("tp-az-foreign")
    azure.resources.resource_groups.create_or_update(group, {"location": "eastus", "tags": {"team": "ml-platform"}})
    with pytest.raises(InvalidRequestError, match=f"resource group {group} is not cluster tp-az-foreign's"):
        azure.launch("tp-az-foreign", spec(regions=("eastus",)), "run-foreign")
    assert [g["name"] for g in arm.groups()] == [group], "the user's own group was deleted"
    assert arm.calls("DELETE", "/resourcegroups/") == []


def test_spot_eviction_notice_then_the_lost_node_is_replaced_alone_in_the_placement_group(
        azure: AzureProvider, arm: ArmServer) -> None:
    cluster = azure.launch("tp-az-evict", spec(nodes=3, regions=("eastus",), spot="only"), "run-evict")
    group = cluster.owner["resource_group"]
    lost, survivor = cluster.nodes[1], cluster.nodes[0]
    before = {vm["name"]: vm for vm in arm.resources("virtualMachines", group)}

    arm.evict(group, lost.name)
    # The node's watcher reads Scheduled Events from the instance metadata service: only the named VM acts.
    notice = azure_notice(lost.name, arm.imds)
    assert notice is not None and notice.source == "azure" and "Preempt" in notice.reason
    assert 0 < notice.deadline - time.time() <= 31
    assert azure_notice(survivor.name, arm.imds) is None
    arm.complete_eviction(group, lost.name)  # eviction policy Delete: the VM goes, its NIC and IP with it
    assert not [r for r in arm.resources(group=group) if r["name"].startswith(lost.name)]
    assert azure.nodes_alive(cluster) == {n.name: n.name != lost.name for n in cluster.nodes}
    # The cluster's record still names the node it lost (the replace task replaces from it), without an address.
    described = azure.describe("tp-az-evict")
    assert described is not None and [n.name for n in described.nodes] == [n.name for n in cluster.nodes]
    assert described.nodes[1].address == "" and lost.name not in described.owner["instances"]

    replaced = azure.replace_nodes(cluster, [lost.name])
    new = next(n for n in replaced.nodes if n.name == lost.name)
    assert [(n.name, n.rank) for n in replaced.nodes] == [(n.name, n.rank) for n in cluster.nodes]
    assert replaced.owner["instances"][lost.name] != cluster.owner["instances"][lost.name]
    assert {n: i for n, i in replaced.owner["instances"].items() if n != lost.name} == \
        {n: i for n, i in cluster.owner["instances"].items() if n != lost.name}, "survivors are untouched"
    assert new.address.startswith("127.77.4.") and new.cluster_address.startswith("127.78.4.")
    assert replaced.owner[HOST_KEYS][lost.name] != cluster.owner[HOST_KEYS][lost.name]
    vms = {vm["name"]: vm for vm in arm.resources("virtualMachines", group)}
    for field in ("proximityPlacementGroup", "availabilitySet", "priority", "evictionPolicy", "hardwareProfile"):
        assert vms[lost.name]["properties"][field] == before[survivor.name]["properties"][field], field
    assert vms[lost.name]["identity"] == before[survivor.name]["identity"]
    assert vms[lost.name]["tags"][TAG_RANK] == str(lost.rank)
    [record] = [r for r in azure.list_clusters() if r.name == "tp-az-evict"]
    assert record.nodes == 3 and record.owner_alive
    assert azure.terminate("tp-az-evict") and left(arm, "tp-az-evict") == []


def test_without_capacity_in_the_placement_group_the_replacement_is_unavailable_and_leaves_nothing(
        azure: AzureProvider, arm: ArmServer) -> None:
    from infra.compute.providers.base import ReplacementUnavailable

    cluster = azure.launch("tp-az-full", spec(nodes=3, regions=("eastus",)), "run-full")
    group = cluster.owner["resource_group"]
    lost = [cluster.nodes[0].name, cluster.nodes[2].name]
    for name in lost:
        arm.complete_eviction(group, name)
    fault = arm.fail("OverconstrainedAllocationRequest", after=1)
    with pytest.raises(ReplacementUnavailable) as raised:
        azure.replace_nodes(cluster, lost)
    for part in (*lost, "proximity placement group", "OverconstrainedAllocationRequest"):
        assert part in str(raised.value), str(raised.value)
    assert (fault.passed, fault.fired) == (1, 1), "both replacements were tried"
    assert [vm["name"] for vm in arm.resources("virtualMachines", group)] == [cluster.nodes[1].name]
    assert sorted(r["name"] for r in arm.resources("networkInterfaces", group)) == [f"{cluster.nodes[1].name}-nic"]
    assert azure.terminate("tp-az-full") and left(arm, "tp-az-full") == []


def test_a_round_of_the_watch_is_one_arm_listing(azure: AzureProvider, arm: ArmServer,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The preemption watch asks for notices, then liveness, every 2 s: one VM listing answers both (ARM's read
    limits are the subscription's, shared by every run in it); the next round lists again."""
    cluster = azure.launch("tp-az-round", spec(nodes=2, regions=("eastus",)), "run-round")
    listings = f"/resourceGroups/{cluster.owner['resource_group']}/providers/Microsoft.Compute/virtualMachines$"
    arm.clear_calls()
    assert azure.preemption_notices(cluster) == []
    assert azure.nodes_alive(cluster) == {node.name: True for node in cluster.nodes}
    assert len(arm.calls("GET", listings)) == 1
    assert azure.nodes_alive(cluster) == {node.name: True for node in cluster.nodes}  # not the watch's pair: asks
    assert len(arm.calls("GET", listings)) == 2
    azure.preemption_notices(cluster)
    monkeypatch.setattr(provider_module, "LISTING_REUSE_S", -1.0)  # a listing too old to answer for now
    azure.nodes_alive(cluster)
    assert len(arm.calls("GET", listings)) == 4
    assert azure.terminate("tp-az-round")


def test_the_watchs_reads_are_asked_once_while_arm_fails_them(azure: AzureProvider, arm: ArmServer) -> None:
    """The preemption watch backs off on its own: azure-core's 4 retries under each of its reads (each waiting out
    the throttle's Retry-After) only blocked its round. Other calls keep their retries."""
    cluster = azure.launch("tp-az-watch", spec(nodes=2, regions=("eastus",)), "run-watch")
    listings = f"/resourceGroups/{cluster.owner['resource_group']}/providers/Microsoft.Compute/virtualMachines$"
    arm.clear_calls()
    arm.outage.start(60)
    try:
        with pytest.raises(LaunchError, match="ServiceUnavailable"):
            azure.preemption_notices(cluster)
        assert len(arm.calls("GET", listings)) == 1
    finally:
        arm.outage.end()
    assert azure.terminate("tp-az-watch")


def test_the_sweeper_takes_the_cluster_whose_heartbeat_expired_and_leaves_the_live_one(
        azure: AzureProvider, arm: ArmServer) -> None:
    for state in ("dead", "live"):
        azure.launch(f"tp-az-sweep-{state}", spec(nodes=1, regions=("eastus",), lease_ttl_s=10), f"sweep-{state}")
    # The dead run's orchestrator last renewed a minute ago; the live one just now.
    dead = group_name("tp-az-sweep-dead")
    tags = next(g["tags"] for g in arm.groups() if g["name"] == dead)
    azure.resources.resource_groups.update(dead, {"tags": {**tags, TAG_HEARTBEAT: f"{time.time() - 60:.0f}"}})
    records = {r.name: r for r in azure.list_clusters()}
    assert (records["tp-az-sweep-dead"].owner_alive, records["tp-az-sweep-live"].owner_alive) == (False, True)
    swept = sweep_clusters(providers=[azure])
    assert [r.name for r in swept] == ["tp-az-sweep-dead"]
    assert left(arm, "tp-az-sweep-dead") == [] and left(arm, "tp-az-sweep-live")
    assert azure.terminate("tp-az-sweep-live") and arm.groups() == []


def test_names_follow_azure_rules() -> None:
    assert group_name("tp-x") == "trainpipe-tp-x" and len(group_name("x" * 200)) == 90
    assert group_name("x" * 200) != group_name("x" * 201)
    for cluster in ("tp-abc", "Tp_Run.7", "tp-" + "a" * 80):
        name = vm_name(cluster, 15)
        assert len(name) <= 64 and name.endswith("-node-15") and all(c.isalnum() or c == "-" for c in name)


def test_the_example_plans_with_its_candidates_cost_and_fabric(tmp_path: Path, workspace: Path) -> None:
    """examples/azure.yaml as shipped, its stores moved to this machine (plan reads them; it asks no cloud API)."""
    config = yaml.safe_load((REPO / "examples" / "azure.yaml").read_text())
    config["dataset"]["url"] = make_dataset(tmp_path / "dataset", tokens=20_000, shard_tokens=10_000)
    config["checkpoints"]["url"] = f"file://{tmp_path / 'ckpt'}"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    result = run_trainpipe("plan", str(tmp_path / "job.yaml"), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "on azure: 2 nodes × 8 processes" in result.stdout
    assert "cheapest Standard_ND96asr_v4 eastus spot" in result.stdout
    assert "1600 Gbps infiniband" in result.stdout
    assert re.search(r"Standard_ND96asr_v4 +westeurope +on-demand", result.stdout), result.stdout
    assert not any(workspace.glob("*clusters")), "plan launched something"


def _http(status: int, code: str, message: str = "m") -> HttpResponseError:
    error = HttpResponseError(message=f"({code}) {message}")
    error.status_code = status
    error.error = type("E", (), {"code": code, "message": message})()  # type: ignore[assignment]
    return error


@pytest.mark.parametrize(("error", "kind"), [
    (_http(409, "SkuNotAvailable"), CapacityError),
    (_http(200, "AllocationFailed"), CapacityError),
    (_http(200, "OverconstrainedAllocationRequest"), CapacityError),
    (_http(409, "OperationNotAllowed", "exceeding approved standardNDSH100v5Family Cores quota"), QuotaError),
    (_http(409, "OperationNotAllowed", "the VM is being deleted"), InvalidRequestError),
    (_http(409, "OperationNotAllowed", "Spot max price 1.2 is lower than the current spot price"), PriceError),
    (_http(403, "AuthorizationFailed"), AuthError),
    (_http(429, "TooManyRequests"), CapacityError),
    (_http(400, "InvalidParameter"), InvalidRequestError),
])
def test_launch_errors_are_classified(error: HttpResponseError, kind: type[Exception]) -> None:
    classified = classify(error, "launch x")
    assert type(classified) is kind and str(classified).startswith(f"azure: launch x: {error.error.code}: ")


def test_errors_outside_the_api_are_transient() -> None:
    classified = classify(ServiceRequestError("connection reset"), "launch x")
    assert type(classified) is LaunchError and classified.transient and "check the network" in str(classified)


# -- end to end: `trainpipe run` on the simulated ARM, Spot-evicted once mid-training ---------------------------------


def azure_instances(arm: ArmServer) -> Any:
    """The stand-ins' view of the simulated VMs: each running VM's public IP, the boot script of its custom data and
    its NIC's private IP."""
    from cloud_nodes import Instance

    def found() -> list[Instance]:
        addresses = {ip["id"].lower(): ip["properties"].get("ipAddress", "")
                     for ip in arm.resources("publicIPAddresses")}
        nics = {nic["id"].lower(): nic for nic in arm.resources("networkInterfaces")}
        instances = []
        for vm in arm.resources("virtualMachines"):
            properties = vm["properties"]
            if properties.get("provisioningState") != "Succeeded":
                continue
            nic = nics.get(properties["networkProfile"]["networkInterfaces"][0]["id"].lower())
            ip_configuration = (nic or {}).get("properties", {}).get("ipConfigurations", [{}])[0].get("properties", {})
            public = ip_configuration.get("publicIPAddress", {}).get("id", "")
            script = base64.b64decode(properties["osProfile"]["customData"]).decode()
            instances.append(Instance(addresses.get(public.lower(), ""), vm["name"], vm["location"], script,
                                      private_address=ip_configuration.get("privateIPAddress", "")))
        return instances

    return found


STEPS_EVICTED = 300


def test_a_run_evicted_once_resumes_on_a_replacement_commits_and_leaves_nothing(
        arm: ArmServer, prefect_server: None, workspace: Path, tmp_path: Path) -> None:
    """The installed `trainpipe run`, unmodified, on the simulated ARM; the machines behind its VMs are stand-ins
    (tests/cloud_nodes.py: a real sshd per VM at its public address, the host key of its custom data). Mid-training
    Azure schedules a Spot eviction of rank 1: its watcher reads the Scheduled Event Preempt from the metadata service,
    stops the trainer (which saves) and flushes the syncer; then the VM is deleted (eviction policy Delete) and its
    machine goes. The run replaces it alone in the placement group, resumes from the commit, completes, and tears the
    cluster's resource group down."""
    import json
    import os
    import signal
    import subprocess

    from cloud_env import wait_for
    from cloud_nodes import machines
    from conftest import TRAINPIPE
    from jobs import job_config, write_config
    from sshd import require_sshd
    from test_cloud_teardown import prefect_env

    from infra.job.plan import cluster_name_for
    from infra.node.events import NodeEvent, parse

    require_sshd()
    arm.reset()
    run_id = "azure-evicted"
    cluster = cluster_name_for(run_id)
    group = group_name(cluster)
    # 50 ms a step: the eviction comes after the commit of step 40 and the watcher reads Scheduled Events every 2 s;
    # undelayed steps (10 ms on an idle machine) finished all 400 before it (CI failed so).
    config = job_config(tmp_path, make_dataset(tmp_path / "dataset", tokens=200_000), steps=STEPS_EVICTED,
                        ckpt_every=40, step_delay_s=0.05)
    config["cluster"] = {"provider": "azure", "nodes": 2, "procs_per_node": 1, "regions": ["eastus"],
                         "spot": "only", "lease_ttl_s": 30, "verify": {"bench": "off"}}
    config["recovery"] = {"confirm_s": 1}
    config_path = write_config(tmp_path / "job.yaml", config)
    log = tmp_path / "orchestrator.log"
    with machines(tmp_path / "machines", "127.77.4.", azure_instances(arm), lambda node: "") as stand_ins:
        env = {**os.environ, **prefect_env(), **arm.env(), "TRAINPIPE_SSH_KEY_FILE": str(stand_ins.client_key),
               "TRAINPIPE_SSH_USER": "root", "TRAINPIPE_SSH_CIDR": "127.0.0.1/32"}
        started = time.monotonic()
        orchestrator = subprocess.Popen([TRAINPIPE, "run", str(config_path), "--run-id", run_id], env=env,
                                        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def committed() -> bool:
                assert orchestrator.poll() is None, "the run ended before the eviction:\n" + log.read_text()[-4000:]
                assert not stand_ins.errors, stand_ins.errors
                return (tmp_path / "store" / "ckpt" / run_id / "step-00000040" / "manifest.json").is_file()

            wait_for(committed, 300, "the first commit (step 40) from the simulated Azure VMs", interval=0.2)
            evicted = vm_name(cluster, 1)
            [address] = [a for a, node in stand_ins.nodes.items() if node.instance.cloud_id == evicted]
            arm.evict(group, evicted)
            watch_log = stand_ins.root / address / "mnt/trainpipe/trainpipe/logs/watch.log"

            def noticed() -> bool:
                events = [e for e in map(parse, watch_log.read_text().splitlines()) if e]
                return any(e.kind is NodeEvent.TRAINER_STOPPED for e in events)

            wait_for(noticed, 60, "the evicted node's watcher acting on the Scheduled Event")
            arm.complete_eviction(group, evicted)
            for pid in stand_ins.processes_of(address):  # the machine goes with its VM
                os.kill(pid, signal.SIGKILL)
            orchestrator.wait(timeout=420)
        finally:
            if orchestrator.poll() is None:
                os.killpg(orchestrator.pid, signal.SIGKILL)
                orchestrator.wait()
        output = log.read_text()
        assert orchestrator.returncode == 0, output[-5000:]
        assert not stand_ins.errors, stand_ins.errors
    events = [e for e in map(parse, watch_log.read_text().splitlines()) if e]
    [notice] = [e for e in events if e.kind is NodeEvent.PREEMPTION_NOTICE]
    assert notice["source"] == "azure" and "Preempt" in notice["reason"]
    summary = json.loads((workspace / "runs" / run_id / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS_EVICTED, summary.get("error")
    [recovery] = summary["recoveries"]
    assert recovery["replaced"] == [evicted], recovery
    # The orchestrator read the notice the node's watcher acted on (before it stopped the trainer): the eviction is
    # recorded as the Scheduled Event it was, not as a node that vanished.
    assert recovery["with_notice"] and "azure scheduled event Preempt" in recovery["reason"], recovery
    # The watcher's notice let the trainer save where it stopped: nothing (or at most one interval) is redone.
    assert recovery["resumed_from_step"] >= 40 and recovery["steps_lost"] <= 40, recovery
    assert summary["nodes_left"] == 0 and summary["market"] == "spot"
    assert arm.groups() == [] and arm.resources() == [], "everything of the cluster is gone"
    # Its syncer dies with the machine under notice: restarting it waited out the SSH connect bound (60 s) first.
    assert not re.search(rf"{evicted}: checkpoint syncer exited .*: restarting it", output), \
        "the evicted node's syncer was started again on the machine being reclaimed"
    print(f"\nazure fake: launch to first step {summary['time_to_first_step_s']:.1f}s, whole run "
          f"{time.monotonic() - started:.0f}s, recovery {recovery}")


# -- a VM whose lease expires deletes itself as it powers off (infra/node/azure_self_delete.py) ------------------------


SELF_DELETE_PROGRAM = re.compile(r"<<'TRAINPIPE_SELF_DELETE'\n(.*?)TRAINPIPE_SELF_DELETE\n", re.DOTALL)
UNIT = re.compile(r"<<'TRAINPIPE_UNIT'\n(.*?)TRAINPIPE_UNIT\n", re.DOTALL)


def boot_script_of(arm: ArmServer, group: str, vm: str) -> str:
    [found] = [r for r in arm.resources("virtualMachines", group) if r["name"] == vm]
    return base64.b64decode(found["properties"]["osProfile"]["customData"]).decode()


def power_off(program: str, arm: ArmServer, group: str, vm: str, identity: str,
              tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """What the unit's stop runs on VM `vm`: the program as the custom data installed it, its IMDS this VM's."""
    installed = tmp_path / "trainpipe-delete-self"
    installed.write_text(program)
    # The simulated ARM's certificate is trusted as a proxy's would be; the node's Python reads SSL_CERT_FILE.
    return subprocess.run([sys.executable, str(installed), "--identity", identity, "--api", arm.endpoint,
                           "--metadata", arm.imds_of(group, vm)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SSL_CERT_FILE": str(arm.ca_file)})


def test_a_node_powering_off_deletes_its_own_vm_with_its_identity_and_its_nic_and_ip_go_with_it(
        azure: AzureProvider, arm: ArmServer, tmp_path: Path) -> None:
    cluster = azure.launch("tp-az-self", spec(regions=("eastus",), spot="never", azure={"identity": IDENTITY}),
                           "run-self")
    group, going, staying = group_name("tp-az-self"), vm_name("tp-az-self", 1), vm_name("tp-az-self", 0)
    script = boot_script_of(arm, group, going)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    [program] = SELF_DELETE_PROGRAM.findall(script)
    assert program == Path(azure_self_delete.__file__).read_text(), "the custom data carries the program verbatim"
    [unit] = UNIT.findall(script)
    [stop] = [line for line in unit.splitlines() if line.startswith("ExecStop=")]
    # At power-off only: the stop of a unit started at boot, skipped when the shutdown is a reboot.
    assert "ExecStart=/bin/true" in unit and "RemainAfterExit=yes" in unit and "TimeoutStopSec=" in unit
    assert "grep -q reboot.target ||" in stop
    assert f"--identity {IDENTITY} --api {arm.endpoint}'" in stop
    assert "systemctl enable --now trainpipe-delete-on-poweroff.service" in script

    arm.grant(IDENTITY)
    arm.clear_calls()
    done = power_off(program, arm, group, going, IDENTITY, tmp_path)
    assert done.returncode == 0, done.stderr
    assert {r["name"] for r in arm.resources(group=group) if r["type"].startswith("Microsoft.Network/")} == {
        "trainpipe-vnet", "trainpipe-nsg", nic_name(staying), public_ip_name(staying)}, "its NIC and IP went with it"
    assert [r["name"] for r in arm.resources("virtualMachines", group)] == [staying]
    [delete] = arm.calls("DELETE", "/virtualMachines/")
    assert delete.path.endswith(f"/resourceGroups/{group}/providers/Microsoft.Compute/virtualMachines/{going}")
    assert delete.query == {"api-version": sdk_vm_api_version(), "forceDeletion": "true"}
    assert delete.authorization.startswith("Bearer imds-"), "with the token IMDS gave the VM's identity"
    # Its replacement copies the survivor's identity (as ARM returns it), and with it the power-off that deletes it.
    azure.replace_nodes(cluster, [going])
    assert f"--identity {IDENTITY} --api {arm.endpoint}'" in boot_script_of(arm, group, going)
    assert azure.terminate("tp-az-self") is True and left(arm, "tp-az-self") == []


def sdk_vm_api_version() -> str:
    """The Microsoft.Compute API version the provider's azure-mgmt-compute sends."""
    from urllib.parse import parse_qs, urlsplit

    from azure.mgmt.compute.operations._operations import build_virtual_machines_delete_request

    return parse_qs(urlsplit(build_virtual_machines_delete_request("g", "v", "s").url).query)["api-version"][0]


def test_a_refused_token_or_a_missing_role_is_one_line_naming_the_role_and_the_vm_stays_for_the_sweeper(
        azure: AzureProvider, arm: ArmServer, tmp_path: Path) -> None:
    azure.launch("tp-az-refused", spec(regions=("eastus",), spot="never", nodes=1, azure={"identity": IDENTITY}),
                 "run-refused")
    group, vm = group_name("tp-az-refused"), vm_name("tp-az-refused", 0)
    program = Path(azure_self_delete.__file__).read_text()
    other = IDENTITY.replace("/trainer", "/not-on-this-vm")
    for identity, why in ((other, "HTTP 400"), (IDENTITY, "HTTP 403")):  # IMDS refuses the token; ARM the delete
        done = power_off(program, arm, group, vm, identity, tmp_path)
        assert done.returncode == 1 and done.stdout == ""
        [line] = done.stderr.splitlines()
        assert why in line and "trainpipe node self-delete" in line and "the sweeper deletes this VM" in line, line
    assert [r["name"] for r in arm.resources("virtualMachines", group)] == [vm]
    assert [c.status for c in arm.calls("DELETE", "/virtualMachines/")] == [403]


def test_self_delete_needs_only_the_shipped_roles_read_and_delete(azure: AzureProvider, arm: ArmServer,
                                                                  tmp_path: Path) -> None:
    """The role of examples/azure-self-delete-role.json (virtualMachines/read and /delete, nothing else) is enough;
    a role without delete is not; the fake checks the token's actions, so a broader role is not what passes."""
    role = json.loads((REPO / "examples" / "azure-self-delete-role.json").read_text())
    assert role["Actions"] == ["Microsoft.Compute/virtualMachines/read", "Microsoft.Compute/virtualMachines/delete"]
    assert role["Name"] == azure_self_delete.ROLE and not role["DataActions"]
    azure.launch("tp-az-narrow", spec(regions=("eastus",), spot="never", nodes=2, azure={"identity": IDENTITY}),
                 "run-narrow")
    group, program = group_name("tp-az-narrow"), Path(azure_self_delete.__file__).read_text()
    arm.grant(IDENTITY, ("Microsoft.Compute/virtualMachines/read",))
    refused = power_off(program, arm, group, vm_name("tp-az-narrow", 1), IDENTITY, tmp_path)
    assert refused.returncode == 1 and "HTTP 403" in refused.stderr
    assert "Microsoft.Compute/virtualMachines/delete" in refused.stderr, refused.stderr
    arm.grant(IDENTITY)  # the shipped role
    done = power_off(program, arm, group, vm_name("tp-az-narrow", 1), IDENTITY, tmp_path)
    assert done.returncode == 0, done.stderr
    assert [r["name"] for r in arm.resources("virtualMachines", group)] == [vm_name("tp-az-narrow", 0)]
    assert azure.terminate("tp-az-narrow") and left(arm, "tp-az-narrow") == []


def test_a_silent_metadata_service_times_out_into_the_one_line(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as silent:  # accepts the connection (the backlog does) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        monkeypatch.setattr(azure_self_delete, "TIMEOUT_S", 0.2)
        started = time.monotonic()
        code = azure_self_delete.main(["--identity", IDENTITY, "--metadata",
                                       f"http://127.0.0.1:{silent.getsockname()[1]}"])
    assert code == 1 and time.monotonic() - started < 5
    [line] = capsys.readouterr().err.splitlines()
    assert "timed out" in line and "azure-self-delete-role.json" in line and "sweeper" in line, line


def test_a_vm_without_an_identity_gets_no_unit_and_the_plan_says_the_sweeper_is_the_backstop(
        azure: AzureProvider, arm: ArmServer, tmp_path: Path, workspace: Path) -> None:
    azure.launch("tp-az-anon", spec(regions=("eastus",), spot="never", nodes=1), "run-anon")
    script = boot_script_of(arm, group_name("tp-az-anon"), vm_name("tp-az-anon", 0))
    assert "mdadm --create /dev/md0" in script
    assert "trainpipe-delete-on-poweroff" not in script and "TRAINPIPE_SELF_DELETE" not in script
    assert spec(azure={"identity": IDENTITY}).plan_warnings() == ()

    config = job_config(tmp_path, make_dataset(tmp_path / "dataset", tokens=20_000, shard_tokens=10_000))
    config["cluster"] = {"provider": "azure", "nodes": 2, "procs_per_node": 1, "regions": ["eastus"]}
    rendered = plan_job(parse_job(config), "az-no-identity").render()
    [warning] = [line for line in rendered.splitlines() if "cluster.azure.identity is not set" in line]
    assert warning.startswith("  warning: ") and "sweeper" in warning and "azure-self-delete-role.json" in warning


def test_the_identity_must_be_azures_own_characters_to_reach_the_unit() -> None:
    with pytest.raises(ValueError, match="is not a user-assigned identity's resource ID"):
        spec(azure={"identity": IDENTITY.replace("identities", "my group'; rm -rf /")})
    with pytest.raises(InvalidRequestError, match="the nodes' power-off"):
        poweroff_deletes_script(IDENTITY, "https://arm.example/$(id)")
    assert '"/subscriptions/s/resourceGroups/rg(1)/' in poweroff_deletes_script(IDENTITY.replace(
        f"/subscriptions/{SUBSCRIPTION}/resourceGroups/identities/", "/subscriptions/s/resourceGroups/rg(1)/"))
