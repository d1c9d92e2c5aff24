"""The image cloud nodes boot: the job's field (cluster.aws.ami, cluster.gcp.image, cluster.azure.image,
cluster.nebius.image_family) wins over the old environment variable, which wins over the cloud's GPU image, looked up
at launch where the cloud publishes it as a moving pointer (AWS's Deep Learning Base AMI in a public SSM parameter,
GCP's Deep Learning VM family); a lookup that fails is one line naming what was looked up and the field to set.

AWS runs against moto (tests/aws_server.py, which publishes the SSM parameters AWS itself owns: moto refuses to have
/aws/... put), GCP against the Compute Engine stand-in (tests/gce_server.py, which answers images.getFromFamily),
Azure against the ARM stand-in (tests/azure_arm_server.py). Azure and Nebius resolve `latest` and a family themselves
when the VM or disk is made, so there only the choice, and what reaches the API, is checked.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from aws_server import Ec2Server, moto_ec2
from azure.core.credentials import AccessToken
from azure_arm_server import SUBSCRIPTION, ArmServer
from gce_server import GceServer
from google.auth.credentials import AnonymousCredentials
from provider_checks import unreached_key

import infra.compute.providers.azure.arm as azure_arm
from infra.compute.catalog import Catalog, shipped_catalog
from infra.compute.providers.aws.config import AwsClusterSpec
from infra.compute.providers.aws.images import DLAMI_PARAMETER, boot_image
from infra.compute.providers.aws.provider import AwsProvider
from infra.compute.providers.azure.config import DEFAULT_IMAGE as AZURE_DEFAULT
from infra.compute.providers.azure.config import AzureClusterSpec
from infra.compute.providers.azure.provider import AzureProvider
from infra.compute.providers.base import InvalidRequestError
from infra.compute.providers.gcp import api as gcp_api
from infra.compute.providers.gcp.boot import DLVM_FAMILY, DLVM_PROJECT
from infra.compute.providers.gcp.provider import GcpProvider
from infra.compute.providers.nebius.config import DEFAULT_IMAGE_FAMILY, NebiusClusterSpec
from infra.compute.spec import ClusterSpec

EAST, WEST = "us-east-1", "us-west-2"
DLAMI_X86, DLAMI_ARM = "ami-0d1a000000000a86", "ami-0d1a00000000a064"
FIELD_AMI, ENV_AMI = "ami-0f1e1d00000000f1", "ami-0e4e00000000e4e0"
GCE_PROJECT = "trainpipe-test"
DLVM_IMAGE = "common-cu128-ubuntu-2204-nvidia-570-v20250101"


# -- AWS --------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ec2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ec2Server]:
    """moto with the Deep Learning Base AMI published in us-east-1 only: us-west-2's lookup fails."""
    published = {EAST: {DLAMI_PARAMETER.format(arch="x86_64"): DLAMI_X86,
                        DLAMI_PARAMETER.format(arch="arm64"): DLAMI_ARM}}
    with moto_ec2(tmp_path_factory.mktemp("moto"), public_parameters=published) as server:
        yield server


@pytest.fixture
def aws_env(ec2: Ec2Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in ec2.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL_SSM", ec2.endpoint)  # the same moto answers SSM
    monkeypatch.delenv("TRAINPIPE_AWS_AMI", raising=False)
    monkeypatch.setenv("TRAINPIPE_AWS_REGIONS", EAST)
    monkeypatch.setenv("TRAINPIPE_SSH_CIDR", "203.0.113.7/32")
    monkeypatch.setenv("TRAINPIPE_SSH_KEY_FILE", str(unreached_key(tmp_path)))


def ec2_client(region: str = EAST) -> Any:
    return boto3.client("ec2", region_name=region)


@pytest.mark.usefixtures("aws_env")
def test_aws_field_wins_over_the_env_var_which_wins_over_the_ssm_lookup() -> None:
    field = AwsClusterSpec(ami=FIELD_AMI)
    assert boot_image(field, ENV_AMI, ec2_client(), EAST, "g5.48xlarge") == FIELD_AMI
    assert boot_image(AwsClusterSpec(), ENV_AMI, ec2_client(), EAST, "g5.48xlarge") == ENV_AMI
    assert boot_image(AwsClusterSpec(), f"{WEST}={ENV_AMI}", ec2_client(), EAST, "g5.48xlarge") == DLAMI_X86
    # A per-region field names only its regions: elsewhere the env var, then the lookup, decide.
    per_region = AwsClusterSpec(ami={WEST: FIELD_AMI})
    assert boot_image(per_region, ENV_AMI, ec2_client(WEST), WEST, "g5.48xlarge") == FIELD_AMI
    assert boot_image(per_region, ENV_AMI, ec2_client(), EAST, "g5.48xlarge") == ENV_AMI
    assert boot_image(per_region, None, ec2_client(), EAST, "g5.48xlarge") == DLAMI_X86


@pytest.mark.usefixtures("aws_env")
def test_aws_graviton_types_boot_the_arm64_deep_learning_ami() -> None:
    assert boot_image(AwsClusterSpec(), None, ec2_client(), EAST, "g5g.16xlarge") == DLAMI_ARM
    assert boot_image(AwsClusterSpec(), None, ec2_client(), EAST, "p5.48xlarge") == DLAMI_X86


@pytest.mark.usefixtures("aws_env")
def test_aws_a_failed_lookup_is_one_line_naming_the_parameter_and_the_field() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        boot_image(AwsClusterSpec(), None, ec2_client(WEST), WEST, "g5.48xlarge")
    message = str(raised.value)
    assert "\n" not in message
    assert message == (f"aws: cannot read SSM parameter {DLAMI_PARAMETER.format(arch='x86_64')} in {WEST} "
                       f"(ParameterNotFound): set cluster.aws.ami (or TRAINPIPE_AWS_AMI) to an AMI id of {WEST}")


def test_aws_a_malformed_ami_is_a_config_error() -> None:
    with pytest.raises(ValueError, match=r"ami 'ubuntu' is not an AMI id: give ami-"):
        AwsClusterSpec(ami="ubuntu")
    with pytest.raises(ValueError, match=r"ami 'x' is not an AMI id"):
        AwsClusterSpec(ami={EAST: "x"})


def aws_catalog() -> Catalog:
    return Catalog(tuple(i for i in shipped_catalog().for_provider("aws") if i.name == "g5.48xlarge"))


def aws_spec(**fields: Any) -> ClusterSpec:
    base = {"provider": "aws", "nodes": 2, "procs_per_node": 8, "accelerator": "A10G", "min_network_gbps": 100,
            "local_nvme": True, "regions": (EAST,)}
    return ClusterSpec(**{**base, **fields})


def images_of(provider: AwsProvider, cluster: str) -> set[str]:
    reply = provider.client(EAST).describe_instances(Filters=[{"Name": "tag:trainpipe:cluster", "Values": [cluster]}])
    return {i["ImageId"] for r in reply["Reservations"] for i in r["Instances"]}


@pytest.mark.usefixtures("aws_env")
def test_aws_nodes_boot_the_deep_learning_ami_with_no_setting_and_the_field_when_set() -> None:
    provider = AwsProvider(catalog=aws_catalog(), bootstrap=False)
    try:
        provider.launch("tp-boot-default", aws_spec(), "run-boot-default")
        assert images_of(provider, "tp-boot-default") == {DLAMI_X86}
        provider.launch("tp-boot-field", aws_spec(aws={"ami": FIELD_AMI}), "run-boot-field")
        assert images_of(provider, "tp-boot-field") == {FIELD_AMI}
    finally:
        provider.terminate("tp-boot-default")
        provider.terminate("tp-boot-field")


# -- GCP --------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gce() -> Iterator[GceServer]:
    with GceServer(project=GCE_PROJECT) as server:
        yield server


@pytest.fixture
def gcp(gce: GceServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> GcpProvider:
    gce.reset()
    gce.public_images = {(DLVM_PROJECT, DLVM_FAMILY): DLVM_IMAGE}
    monkeypatch.setenv("TRAINPIPE_SSH_KEY_FILE", str(unreached_key(tmp_path)))
    monkeypatch.setattr(gcp_api, "POLL_FIRST_S", 0.005)
    monkeypatch.setattr(gcp_api, "POLL_MAX_S", 0.02)
    monkeypatch.setattr(gcp_api, "RETRY_FIRST_S", 0.01)
    monkeypatch.delenv("TRAINPIPE_GCP_ZONES", raising=False)
    monkeypatch.delenv("TRAINPIPE_GCP_IMAGE", raising=False)
    return gcp_provider(gce)


def gcp_provider(gce: GceServer) -> GcpProvider:
    catalog = Catalog(tuple(i for i in shipped_catalog().for_provider("gcp") if i.name == "a3-highgpu-8g"))
    return GcpProvider(catalog=catalog, project=GCE_PROJECT, credentials=AnonymousCredentials(),
                       api_endpoint=gce.endpoint, bootstrap=False)


def gcp_spec(**fields: Any) -> ClusterSpec:
    base = {"provider": "gcp", "nodes": 2, "procs_per_node": 8, "accelerator": "H100", "local_nvme": True,
            "regions": ("us-central1",)}
    return ClusterSpec(**{**base, **fields})


def boot_images(gce: GceServer) -> list[str]:
    inserts = [c.body or {} for c in gce.calls("POST", r"/zones/[^/]+/instances$") if c.status == 200]
    return [disk["initializeParams"]["sourceImage"] for body in inserts for disk in body["disks"] if disk.get("boot")]


def test_gcp_nodes_boot_the_newest_deep_learning_vm_image_looked_up_by_family(gcp: GcpProvider,
                                                                              gce: GceServer) -> None:
    try:
        gcp.launch("tp-gcp-dlvm", gcp_spec(), "run-dlvm")
    finally:
        gcp.terminate("tp-gcp-dlvm")
    looked_up = f"/projects/{DLVM_PROJECT}/global/images/family/{DLVM_FAMILY}"
    assert [c.status for c in gce.calls("GET", looked_up)] == [200]  # once per launch, not per node
    expected = f"https://www.googleapis.com/compute/v1/projects/{DLVM_PROJECT}/global/images/{DLVM_IMAGE}"
    assert boot_images(gce) == [expected, expected]


def test_gcp_field_wins_over_the_env_var_which_wins_over_the_lookup(gcp: GcpProvider, gce: GceServer,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINPIPE_GCP_IMAGE", "projects/mine/global/images/from-env")
    from_env = gcp_provider(gce)
    try:
        from_env.launch("tp-gcp-env", gcp_spec(), "run-env")
        from_env.launch("tp-gcp-field", gcp_spec(gcp={"image": "projects/mine/global/images/from-field"}),
                        "run-field")
    finally:
        from_env.terminate("tp-gcp-env")
        from_env.terminate("tp-gcp-field")
    assert boot_images(gce) == ["projects/mine/global/images/from-env"] * 2 + [
        "projects/mine/global/images/from-field"] * 2
    assert gce.calls("GET", r"/global/images/family/") == []


def test_gcp_a_failed_lookup_is_one_line_and_launches_nothing(gcp: GcpProvider, gce: GceServer) -> None:
    gce.public_images = {}
    with pytest.raises(InvalidRequestError) as raised:
        gcp.launch("tp-gcp-nofamily", gcp_spec(), "run-nofamily")
    assert str(raised.value) == (
        f"gcp: cannot look up the newest image of family {DLVM_FAMILY} in project {DLVM_PROJECT} (notFound): set "
        "cluster.gcp.image (or TRAINPIPE_GCP_IMAGE) to an image (projects/P/global/images/NAME)")
    assert gce.instances() == []


# -- Azure, Nebius ----------------------------------------------------------------------------------------------------

def test_azure_field_wins_over_the_env_var_which_wins_over_the_hpc_image() -> None:
    env = "Canonical:0001-com-ubuntu-server-jammy:22_04-lts-gen2:latest"
    assert AzureClusterSpec(image="a:b:c:1.2.3").image_reference(env) == {
        "publisher": "a", "offer": "b", "sku": "c", "version": "1.2.3"}
    assert AzureClusterSpec().image_reference(env)["offer"] == "0001-com-ubuntu-server-jammy"
    assert ":".join(AzureClusterSpec().image_reference(None).values()) == AZURE_DEFAULT == (
        "microsoft-dsvm:ubuntu-hpc:2204:latest")
    with pytest.raises(ValueError, match=r"^TRAINPIPE_AZURE_IMAGE 'ubuntu': give PUBLISHER:OFFER:SKU:VERSION"):
        AzureClusterSpec().image_reference("ubuntu")


def test_nebius_field_wins_over_the_env_var_which_wins_over_the_cuda_family() -> None:
    assert NebiusClusterSpec(image_family="mine").boot_image_family("from-env") == "mine"
    assert NebiusClusterSpec().boot_image_family("from-env") == "from-env"
    assert NebiusClusterSpec().boot_image_family(None) == DEFAULT_IMAGE_FAMILY == "ubuntu22.04-cuda12"


class FakeToken:
    """A credential as azure-identity's are (get_token), whose token the ARM stand-in accepts."""

    def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        return AccessToken("fake-token", 2**31 - 1)


@pytest.fixture(scope="module")
def arm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ArmServer]:
    with ArmServer(tmp_path_factory.mktemp("arm")) as server:
        yield server


def test_azure_vms_get_the_field_the_env_var_or_the_hpc_image(arm: ArmServer, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.setenv("TRAINPIPE_SSH_KEY_FILE", str(unreached_key(tmp_path)))
    monkeypatch.setenv("TRAINPIPE_AZURE_SSH_PUBLIC_KEY", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITrainpipeTestKey t@h")
    monkeypatch.setenv("TRAINPIPE_SSH_CIDR", "127.0.0.1/32")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(arm.ca_file))
    monkeypatch.setattr(azure_arm, "POLL_S", 0.005)
    monkeypatch.setattr(azure_arm, "WAIT_STEP_S", 0.005)
    monkeypatch.setattr(azure_arm, "RETRY_FIRST_S", 0.01)
    catalog = Catalog(tuple(i for i in shipped_catalog().for_provider("azure") if i.name == "Standard_ND96asr_v4"))
    provider = AzureProvider(catalog=catalog, subscription=SUBSCRIPTION, credential=FakeToken(),
                             endpoint=arm.endpoint, bootstrap=False)
    base = {"provider": "azure", "nodes": 1, "procs_per_node": 8, "accelerator": "A100", "local_nvme": True,
            "min_network_gbps": 400, "regions": ("eastus",)}
    env_urn, field_urn = "Canonical:ubuntu-jammy:22_04-gen2:latest", "mine:gpu-images:2204:1.2.3"
    launches = [("tp-az-default", {}, None), ("tp-az-env", {}, env_urn),
                ("tp-az-field", {"azure": {"image": field_urn}}, env_urn)]
    try:
        for name, fields, env in launches:
            if env:
                monkeypatch.setenv("TRAINPIPE_AZURE_IMAGE", env)
            provider.launch(name, ClusterSpec(**{**base, **fields}), f"run-{name}")
    finally:
        for name, _, _ in launches:
            provider.terminate(name)
    puts = [c.body or {} for c in arm.calls("PUT", "/virtualMachines/") if c.status in (200, 201)]
    images = [":".join(body["properties"]["storageProfile"]["imageReference"].values()) for body in puts]
    assert images == [AZURE_DEFAULT, env_urn, field_urn]

    monkeypatch.setenv("TRAINPIPE_AZURE_IMAGE", "ubuntu")
    with pytest.raises(InvalidRequestError, match=r"^azure: TRAINPIPE_AZURE_IMAGE 'ubuntu': give PUBLISHER:OFFER:SKU"):
        provider.launch("tp-az-bad", ClusterSpec(**base), "run-bad")
    assert [g["name"] for g in arm.groups() if "tp-az" in g["name"]] == []
