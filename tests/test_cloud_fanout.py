"""Fan-out staging on the simulated clouds, whose instances have a public address (where trainpipe reaches them over
SSH) and a distinct private one (their VPC subnet's): a 3-node cluster launched on each, its machines stand-ins
(tests/cloud_nodes.py), stages one replicated dataset with every node's peer server on its private address; the
store (rclone serve s3 behind a proxy that counts what it serves) sends the dataset about once, and the run summary's
verdict, made from the nodes' events, is `ran`.

A peer server bound to the public address would serve here (every 127/8 address binds on loopback) though it could not
on a real instance: the stand-ins read what each node's peer servers said they bound (`Machines.wrong_binds`).

A cloud is one entry of CLOUDS: a function that sets its fake up inside the test's ExitStack and says, in a CloudCase,
where its stand-ins answer, how it launches and what its API says each node's private address is.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import test_azure_provider as azure_tests
import test_fanout_stage as fanout_tests
import test_nebius_provider as nebius_tests
import test_replace_cloud as replace_tests
from azure_arm_server import ArmServer
from cloud_env import ec2_client
from cloud_nodes import Instance, MetadataServer, ec2_instances, ec2_power_off, gce_instances, gce_power_off
from cloud_nodes import Node as StandIn
from gce_server import PROJECT, GceServer
from nebius_server import NebiusServer, nebius_instances, nebius_power_off, private_address
from servers import S3Server
from sshd import require_sshd
from test_cloud_teardown import AWS_PREFIX, AWS_PRIVATE_PREFIX, GCP_PREFIX, GCP_PRIVATE_PREFIX, REGION

from infra.compute.access.agent import NodeAgent
from infra.compute.providers import Cluster, provider_of
from infra.compute.providers.cloud import CloudProvider
from infra.compute.providers.nebius.provider import NebiusProvider
from infra.dataset.stagecache import node_cache_dir
from infra.node.events import NodeEvent
from infra.node.fanout import SHARE_DIR
from infra.node.protocol import PeerExchange, StageRequest
from tasks import fanout
from tasks.node_output import last_event
from tasks.results import Staged, StagedNode

# The fixtures this module's tests use, from the modules that define them.
ec2, image, gce = replace_tests.ec2, replace_tests.image, replace_tests.gce
aws_setup, gcp_setup = replace_tests.aws_setup, replace_tests.gcp_setup
dataset, credentials = fanout_tests.dataset, fanout_tests.credentials
NODES = 3


def stage_with_fanout(cluster: Cluster, snapshot_url: str, store_env: dict[str, str]) -> tuple[list[str], list[Staged]]:
    """Every node stages the whole dataset through the orchestrator's peer servers (tasks.fanout.peer_servers); the
    peers' URLs handed out, and each node's `staged` event."""
    provider = provider_of(cluster)
    with fanout.peer_servers(cluster) as (urls, peer_env):
        def stage(rank: int) -> Staged:
            node = cluster.nodes[rank]
            request = StageRequest(rank=rank, nodes=len(cluster.nodes), workdir=node.workdir,
                                   cache=node_cache_dir(cluster.provider, node.workdir), run=cluster.run_id,
                                   snapshot=snapshot_url, dest=node.data_dir,
                                   peers=PeerExchange(urls=tuple(urls), share_dir=node.path(SHARE_DIR)))
            result = NodeAgent(provider.runner(cluster, node), node.python, store_env).run(
                request, env=peer_env, timeout=240)
            return Staged.from_event(last_event(result.output, NodeEvent.STAGED))

        assert urls, "the peer servers did not start (see the log's warning)"
        with ThreadPoolExecutor(max_workers=len(cluster.nodes)) as pool:
            return urls, list(pool.map(stage, range(len(cluster.nodes))))


@dataclass
class CloudCase:
    """One simulated cloud as this test uses it: where its stand-ins answer (public) and what its subnet hands out
    (private), a provider that bootstraps what it launches, what the stand-ins boot, and what the cloud's API says each
    node's private address is."""

    public: str
    private: str
    found: Callable[[], list[Instance]]
    power_off: Callable[[StandIn], str]
    launch: Callable[[str], Cluster]  # a NODES-node cluster of this name
    private_ips: Callable[[Cluster], dict[str, str]]  # node name → its private address, from the cloud's API
    provider: CloudProvider


def aws_case(request: pytest.FixtureRequest, stack: ExitStack, booted: Callable[[], dict[str, StandIn]]) -> CloudCase:
    request.getfixturevalue("aws_setup")
    server = request.getfixturevalue("ec2")
    creds = server.env()
    keys = (server.endpoint, REGION, creds["AWS_ACCESS_KEY_ID"], creds["AWS_SECRET_ACCESS_KEY"])
    provider = replace_tests.aws_provider(bootstrap=True)

    def private_ips(cluster: Cluster) -> dict[str, str]:
        ids = cluster.owner["instances"]
        described = ec2_client(server, REGION).describe_instances(InstanceIds=list(ids.values()))
        by_id = {i["InstanceId"]: i["PrivateIpAddress"] for r in described["Reservations"] for i in r["Instances"]}
        return {name: by_id[ids[name]] for name in ids}

    return CloudCase(AWS_PREFIX, AWS_PRIVATE_PREFIX, ec2_instances(*keys), ec2_power_off(*keys),
                     lambda name: replace_tests.launch(provider, name, nodes=NODES), private_ips, provider)


def gcp_case(request: pytest.FixtureRequest, stack: ExitStack, booted: Callable[[], dict[str, StandIn]]) -> CloudCase:
    request.getfixturevalue("gcp_setup")
    server: GceServer = request.getfixturevalue("gce")
    metadata = MetadataServer(PROJECT, booted)
    stack.callback(metadata.close)
    provider = replace_tests.gcp_provider(server, bootstrap=True)

    def private_ips(cluster: Cluster) -> dict[str, str]:
        return {i["name"]: i["networkInterfaces"][0]["networkIP"] for i in server.instances()
                if i["name"] in cluster.owner["instances"]}

    return CloudCase(GCP_PREFIX, GCP_PRIVATE_PREFIX, gce_instances(server), gce_power_off(metadata),
                     lambda name: replace_tests.launch(provider, name, nodes=NODES), private_ips, provider)


def nebius_case(request: pytest.FixtureRequest, stack: ExitStack,
                booted: Callable[[], dict[str, StandIn]]) -> CloudCase:
    server = stack.enter_context(NebiusServer())
    nebius_tests.use_fake(server, request.getfixturevalue("monkeypatch"))
    provider = NebiusProvider(catalog=nebius_tests.nebius_catalog(), bootstrap=True)
    spec = nebius_tests.spec(nodes=NODES, regions=("eu-north1",))

    def private_ips(cluster: Cluster) -> dict[str, str]:
        return {name: private_address(server.fake.instances[instance])
                for name, instance in cluster.owner["instances"].items()}

    return CloudCase(server.fake.public_prefix, server.fake.private_prefix, nebius_instances(server),
                     nebius_power_off(server), lambda name: provider.launch(name, spec, f"run-{name}"), private_ips,
                     provider)


def azure_case(request: pytest.FixtureRequest, stack: ExitStack,
               booted: Callable[[], dict[str, StandIn]]) -> CloudCase:
    arm = stack.enter_context(ArmServer(request.getfixturevalue("tmp_path") / "arm"))
    azure_tests.use_fake(arm, request.getfixturevalue("monkeypatch"))
    provider = azure_tests.azure_provider(arm, bootstrap=True)
    spec = azure_tests.spec(nodes=NODES, procs_per_node=1, regions=("eastus",))

    def private_ips(cluster: Cluster) -> dict[str, str]:
        return {instance.cloud_id: instance.private_address for instance in found()  # a VM's name is its node's
                if instance.cloud_id in {node.name for node in cluster.nodes}}

    found = azure_tests.azure_instances(arm)
    return CloudCase(arm.public_prefix, arm.private_prefix, found, lambda node: "",
                     lambda name: provider.launch(name, spec, f"run-{name}"), private_ips, provider)


# Each cloud's case, set up inside the test's ExitStack; `booted` lists the stand-ins booted so far.
CLOUDS: dict[str, Callable[[pytest.FixtureRequest, ExitStack, Callable[[], dict[str, StandIn]]], CloudCase]] = {
    "aws": aws_case, "gcp": gcp_case, "nebius": nebius_case, "azure": azure_case}


@pytest.mark.parametrize("cloud", list(CLOUDS))
def test_a_cloud_cluster_fans_out_on_its_private_addresses(
        cloud: str, request: pytest.FixtureRequest, s3_server: S3Server, dataset: tuple[str, dict[str, bytes]],
        credentials: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_sshd()
    snapshot_url, files = dataset
    unique = fanout_tests.stored_bytes(files) - len(files["shard-00.bin"])  # the same bytes twice are fetched once
    with ExitStack() as stack:
        case = CLOUDS[cloud](request, stack, lambda: stand_ins.nodes)
        public, private, provider = case.public, case.private, case.provider
        stand_ins = stack.enter_context(replace_tests.reachable(tmp_path, public, case.found, case.power_off))
        cluster = case.launch(f"tp-fanout-{cloud}")
        stack.callback(provider.terminate, cluster.name)

        # trainpipe reaches each node at its public address; the cluster's own traffic goes to the private one.
        assert all(node.address.startswith(public) for node in cluster.nodes), cluster.nodes
        assert {node.name: node.cluster_address for node in cluster.nodes} == case.private_ips(cluster)
        assert all(node.cluster_address.startswith(private) for node in cluster.nodes)

        with fanout_tests.counted_store(s3_server, monkeypatch) as store:
            store_env = {**s3_server.env(), "AWS_ENDPOINT_URL": store.endpoint}
            urls, staged = stage_with_fanout(cluster, snapshot_url, store_env)
        assert [url.removeprefix("http://").rpartition(":")[0] for url in urls] == \
            [node.cluster_address for node in cluster.nodes], "the peers' URLs are their private addresses"
        assert stand_ins.wrong_binds() == {}, "a peer server bound the public address, which no real instance has"
        assert all(stand_ins.served_at(node.address) for node in cluster.nodes), "every node's peer server ran"

        print(f"\n{cloud}: the store served {store.served:,} bytes for a dataset of {unique:,} "
              f"({store.served / unique:.3f}x) to {NODES} nodes")
        assert store.served <= 1.05 * unique, store.served
        assert sum(s.store_bytes for s in staged) == unique
        assert sum(s.peer_bytes for s in staged) == (NODES - 1) * unique
        assert fanout.outcome(True, "dataset.fanout is on", True, urls, [StagedNode(s, {}) for s in staged], []) \
            == "ran"
        assert stand_ins.errors == []

