"""The AWS provider against a simulated EC2: a real `moto_server` process (tests/aws_server.py); no real EC2 is reached.

Capacity, quota and auth failures are injected on the client with a botocore `before-call` hook that raises the
ClientError EC2 would, so failover runs through the candidate list against the simulated endpoint.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from aws_server import Ec2Server, moto_ec2
from botocore.exceptions import ClientError
from provider_checks import assert_reports_launched_cluster, unreached_key

from infra.compute.catalog import Catalog, shipped_catalog
from infra.compute.failover import QuotaEverywhere
from infra.compute.providers import get_provider
from infra.compute.providers.aws.errors import AuthError, classify
from infra.compute.providers.aws.provider import TAG_CLUSTER, TAG_CREATED, TAG_OWNER, TAG_RUN, AwsProvider
from infra.compute.providers.base import CapacityError, InvalidRequestError, LaunchError, QuotaError
from infra.compute.spec import ClusterSpec

REGIONS = ("us-east-1", "us-west-2")
SSH_CIDR = "203.0.113.7/32"


@pytest.fixture(scope="module")
def ec2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ec2Server]:
    with moto_ec2(tmp_path_factory.mktemp("moto")) as server:
        yield server


def small_catalog() -> Catalog:
    shipped = shipped_catalog()
    return Catalog(tuple(i for i in shipped.for_provider("aws") if i.name in ("g5.48xlarge", "g5.12xlarge")))


@pytest.fixture(scope="module")
def images(ec2_server: Ec2Server) -> str:
    """TRAINPIPE_AWS_AMI for the test regions: an image registered in each (AMI ids are regional)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ec2_server.env().items():
            patch.setenv(name, value)
        ids = {region: boto3.client("ec2", region_name=region).register_image(
            Name="trainpipe-test", RootDeviceName="/dev/sda1")["ImageId"] for region in REGIONS}
    return ",".join(f"{region}={image}" for region, image in ids.items())


@pytest.fixture
def aws(ec2_server: Ec2Server, images: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> AwsProvider:
    for name, value in ec2_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAINPIPE_AWS_REGIONS", ",".join(REGIONS))
    monkeypatch.setenv("TRAINPIPE_SSH_CIDR", SSH_CIDR)
    monkeypatch.setenv("TRAINPIPE_AWS_AMI", images)
    # Launch checks the key nodes are reached with before paying for anything; moto's instances are never reached
    # (no machine behind them), so the key is only read, and bootstrap is off (tests/test_cloud_ssh.py covers it).
    monkeypatch.setenv("TRAINPIPE_SSH_KEY_FILE", str(unreached_key(tmp_path)))
    return AwsProvider(catalog=small_catalog(), bootstrap=False)


def spec(**fields: Any) -> ClusterSpec:
    base = {"provider": "aws", "nodes": 2, "procs_per_node": 8, "accelerator": "A10G", "min_network_gbps": 100,
            "local_nvme": True, "regions": REGIONS}
    return ClusterSpec(**{**base, **fields})


def record_calls(aws: AwsProvider) -> list[tuple[str, str, dict[str, Any]]]:
    """(region, operation, params) of every EC2 call the provider makes from now on."""
    calls: list[tuple[str, str, dict[str, Any]]] = []
    for region in REGIONS:
        def hook(model: Any, params: dict[str, Any], region: str = region, **_: Any) -> None:
            calls.append((region, model.name, params))
        aws.client(region).meta.events.register("before-parameter-build.ec2.*", hook)
    return calls


def inject_run_instances(aws: AwsProvider, script: list[str | None]) -> list[str | None]:
    """RunInstances answers in script order: None lets it through to moto, a code raises that EC2 error."""
    remaining = list(script)

    def hook(**_: Any) -> None:
        code = remaining.pop(0) if remaining else None
        if code is not None:
            raise ClientError({"Error": {"Code": code, "Message": f"injected {code}"}}, "RunInstances")

    for region in REGIONS:
        aws.client(region).meta.events.register("before-call.ec2.RunInstances", hook)
    return remaining


def live(aws: AwsProvider, region: str, cluster: str) -> list[dict[str, Any]]:
    return [i for r in aws.client(region).describe_instances(Filters=[
        {"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]},
        {"Name": "instance-state-name", "Values": ["pending", "running"]}])["Reservations"] for i in r["Instances"]]


def groups_left(aws: AwsProvider, cluster: str) -> list[str]:
    tagged = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]}]
    left = []
    for region in REGIONS:
        ec2 = aws.client(region)
        left += [g["GroupId"] for g in ec2.describe_security_groups(Filters=tagged)["SecurityGroups"]]
        left += [g["GroupName"] for g in ec2.describe_placement_groups(Filters=tagged)["PlacementGroups"]]
    return left


def test_provider_is_registered_and_needs_no_credentials_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    provider = get_provider("aws")
    assert provider.name == "aws" and provider.list_clusters() == []


def test_launch_describe_tags_groups_then_teardown_leaves_nothing(aws: AwsProvider) -> None:
    calls = record_calls(aws)
    cluster = aws.launch("tp-aws-basic", spec(regions=("us-east-1",)), "run-basic")

    assert [n.rank for n in cluster.nodes] == [0, 1] and cluster.run_id == "run-basic"
    assert [a.outcome for a in aws.last_attempts] == ["launched"]
    runs = [params for _, op, params in calls if op == "RunInstances"]
    assert len(runs) == 2 and len({p["ClientToken"] for p in runs}) == 2
    for params in runs:
        assert params["InstanceType"] == "g5.48xlarge"  # the only A10G type with ≥100 Gbps (EFA)
        assert params["InstanceInitiatedShutdownBehavior"] == "terminate"
        assert params["Placement"] == {"GroupName": "tp-aws-basic"}
        assert "InstanceMarketOptions" not in params
        assert "IamInstanceProfile" not in params  # none named: the nodes get no credentials (plan refuses s3://)
        [nic] = params["NetworkInterfaces"]
        assert nic["InterfaceType"] == "efa" and nic["SubnetId"] and nic["Groups"]
        assert "mdadm --create /dev/md0" in base64.b64decode(params["UserData"]).decode()
        assert {s["ResourceType"] for s in params["TagSpecifications"]} == {"instance", "volume", "network-interface"}

    instances = live(aws, "us-east-1", "tp-aws-basic")
    assert len(instances) == 2 and {i["Placement"]["AvailabilityZone"] for i in instances} == {"us-east-1a"}
    for instance in instances:
        tags = {t["Key"]: t["Value"] for t in instance["Tags"]}
        assert tags[TAG_RUN] == "run-basic" and tags[TAG_OWNER] and tags[TAG_CREATED]
    ec2 = aws.client("us-east-1")
    [group] = ec2.describe_security_groups(Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": ["tp-aws-basic"]}])[
        "SecurityGroups"]
    rules = group["IpPermissions"]
    assert any(r["IpProtocol"] == "-1" and r["UserIdGroupPairs"][0]["GroupId"] == group["GroupId"] for r in rules)
    assert any(r.get("FromPort") == 22 and r["IpRanges"] == [{"CidrIp": SSH_CIDR,
                                                              "Description": "trainpipe orchestrator"}] for r in rules)
    [placement] = ec2.describe_placement_groups(GroupNames=["tp-aws-basic"])["PlacementGroups"]
    assert placement["Strategy"] == "cluster"

    assert_reports_launched_cluster(aws, cluster, "tp-aws-basic", "run-basic")

    calls.clear()
    assert aws.terminate("tp-aws-basic") is True
    order = [op for _, op, _ in calls]
    assert order.index("TerminateInstances") < order.index("DeletePlacementGroup")
    assert order.index("TerminateInstances") < order.index("DeleteSecurityGroup")
    assert live(aws, "us-east-1", "tp-aws-basic") == [] and groups_left(aws, "tp-aws-basic") == []
    assert aws.describe("tp-aws-basic") is None
    assert aws.nodes_alive(cluster) == {n.name: False for n in cluster.nodes}
    assert aws.terminate("tp-aws-basic") is False  # idempotent



def test_nodes_carry_the_instance_profile_the_cluster_names(aws: AwsProvider, ec2_server: Ec2Server) -> None:
    """The nodes reach the dataset and checkpoints with their own credentials: the instance profile of
    cluster.aws.instance_profile, which the instances carry (by name, or by ARN)."""
    iam = boto3.client("iam", region_name="us-east-1", endpoint_url=ec2_server.endpoint)  # moto serves IAM too
    arn = iam.create_instance_profile(InstanceProfileName="tp-test-node")["InstanceProfile"]["Arn"]
    calls = record_calls(aws)
    aws.launch("tp-aws-profile", spec(regions=("us-east-1",), aws={"instance_profile": "tp-test-node"}), "run-prof")
    try:
        runs = [params for _, op, params in calls if op == "RunInstances"]
        assert [p["IamInstanceProfile"] for p in runs] == [{"Name": "tp-test-node"}] * 2
        assert [i["IamInstanceProfile"]["Arn"] for i in live(aws, "us-east-1", "tp-aws-profile")] == [arn] * 2
    finally:
        assert aws.terminate("tp-aws-profile")
    assert spec(aws={"instance_profile": arn}).aws.iam_instance_profile() == {"Arn": arn}

def test_spot_parameters_and_idempotent_relaunch(aws: AwsProvider) -> None:
    calls = record_calls(aws)
    job = spec(spot="only", zones=("us-west-2b",), max_price_per_hour=20.0)
    first = aws.launch("tp-aws-spot", job, "run-spot")
    runs = [params for _, op, params in calls if op == "RunInstances"]
    assert [p["InstanceMarketOptions"] for p in runs] == [{"MarketType": "spot", "SpotOptions": {
        "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate", "MaxPrice": "10.0000"}}] * 2
    assert all("spot-instances-request" in {s["ResourceType"] for s in p["TagSpecifications"]} for p in runs)
    assert {i["Placement"]["AvailabilityZone"] for i in live(aws, "us-west-2", "tp-aws-spot")} == {"us-west-2b"}

    # A retried launch (same cluster, same candidate, same tokens) adopts what is running: no second cluster.
    calls.clear()
    again = aws.launch("tp-aws-spot", job, "run-spot")
    assert again.owner["instances"] == first.owner["instances"]
    assert "RunInstances" not in [op for _, op, _ in calls]
    assert len(live(aws, "us-west-2", "tp-aws-spot")) == 2

    # After a teardown the same name launches fresh instances, not the ended ones its old tokens named.
    assert aws.terminate("tp-aws-spot")
    relaunched = aws.launch("tp-aws-spot", job, "run-spot")
    assert set(relaunched.owner["instances"].values()).isdisjoint(first.owner["instances"].values())
    assert aws.terminate("tp-aws-spot") and groups_left(aws, "tp-aws-spot") == []


def test_failover_through_capacity_and_a_partial_launch_that_is_rolled_back(aws: AwsProvider) -> None:
    # Spot candidates in order: us-east-1a, 1b, 1c, us-west-2a, 2b (same price; region preference breaks ties).
    inject_run_instances(aws, [
        "InsufficientInstanceCapacity",  # us-east-1a rank 0
        None, "InsufficientInstanceCapacity",  # us-east-1b: rank 0 starts, rank 1 refused → roll back rank 0
        "MaxSpotInstanceCountExceeded",  # us-east-1c rank 0
        None, None,  # us-west-2a: both ranks
    ])
    cluster = aws.launch("tp-aws-failover", spec(spot="prefer"), "run-failover")
    assert [(a.zone, a.market, a.outcome) for a in aws.last_attempts] == [
        ("us-east-1a", "spot", "capacity"), ("us-east-1b", "spot", "capacity"), ("us-east-1c", "spot", "capacity"),
        ("us-west-2a", "spot", "launched")]
    assert "InsufficientInstanceCapacity" in (aws.last_attempts[1].error or "")
    assert cluster.owner["region"] == "us-west-2" and len(live(aws, "us-west-2", "tp-aws-failover")) == 2
    # The partial launch in us-east-1b was rolled back: no instance and no group left in us-east-1.
    ec2 = aws.client("us-east-1")
    ended = [i for r in ec2.describe_instances(Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": ["tp-aws-failover"]}])[
        "Reservations"] for i in r["Instances"]]
    assert [i["State"]["Name"] for i in ended] == ["terminated"]
    assert live(aws, "us-east-1", "tp-aws-failover") == []
    assert not ec2.describe_security_groups(Filters=[{"Name": f"tag:{TAG_CLUSTER}",
                                                      "Values": ["tp-aws-failover"]}])["SecurityGroups"]
    assert aws.terminate("tp-aws-failover") and groups_left(aws, "tp-aws-failover") == []


def test_quota_blocks_the_region_and_prefer_falls_back_to_on_demand(aws: AwsProvider) -> None:
    inject_run_instances(aws, [
        "InsufficientInstanceCapacity",  # us-east-1a spot
        "VcpuLimitExceeded",  # us-east-1b spot: the spot quota of us-east-1 → 1c spot is not tried
        "InsufficientInstanceCapacity", "SpotMaxPriceTooLow",  # us-west-2a, 2b spot
        None, None,  # us-east-1a on-demand (on-demand quota is separate from spot's)
    ])
    cluster = aws.launch("tp-aws-quota", spec(spot="prefer"), "run-quota")
    assert [(a.zone, a.market, a.outcome) for a in aws.last_attempts] == [
        ("us-east-1a", "spot", "capacity"), ("us-east-1b", "spot", "quota"), ("us-east-1c", "spot", "skipped"),
        ("us-west-2a", "spot", "capacity"), ("us-west-2b", "spot", "capacity"),
        ("us-east-1a", "on-demand", "launched")]
    assert cluster.owner["region"] == "us-east-1"
    assert aws.terminate("tp-aws-quota") and groups_left(aws, "tp-aws-quota") == []


def test_quota_everywhere_is_one_line_and_leaves_nothing(aws: AwsProvider) -> None:
    inject_run_instances(aws, ["InstanceLimitExceeded"] * 2)
    with pytest.raises(QuotaEverywhere) as caught:
        aws.launch("tp-aws-noquota", spec(regions=REGIONS, zones=("us-east-1a", "us-west-2a")), "run-noquota")
    assert [a.outcome for a in caught.value.attempts] == ["quota", "quota"]
    assert str(caught.value).startswith("no candidate launched (g5.48xlarge us-east-1a on-demand: quota; ")
    assert "\n" not in str(caught.value) and groups_left(aws, "tp-aws-noquota") == []


@pytest.mark.parametrize(("code", "error"), [("UnauthorizedOperation", AuthError),
                                             ("InvalidParameterValue", Exception)])
def test_auth_and_invalid_requests_stop_at_once(aws: AwsProvider, code: str, error: Callable[..., Exception]) -> None:
    remaining = inject_run_instances(aws, [code, None, None])
    with pytest.raises(error) as caught:
        aws.launch("tp-aws-stop", spec(spot="prefer"), "run-stop")
    assert code in str(caught.value) and "\n" not in str(caught.value)
    assert [a.outcome for a in aws.last_attempts] == ["invalid"]
    assert remaining == [None, None]  # no further candidate was tried
    assert groups_left(aws, "tp-aws-stop") == [] and aws.describe("tp-aws-stop") is None


def test_catalog_refresh_rebuilds_the_aws_part(aws: AwsProvider, tmp_path: Path) -> None:
    from infra.compute.catalog import load_catalog
    from infra.compute.catalog.aws_refresh import refresh_aws

    path = refresh_aws(regions=("us-east-1",), refreshed=tmp_path, pricing=False)  # the Price List API is not simulated
    refreshed = load_catalog(tmp_path)
    p4d = refreshed.get("aws", "p4d.24xlarge")
    assert path == tmp_path / "aws.json" and p4d is not None
    # Hardware figures come from DescribeInstanceTypes (moto's copy of EC2's data); prices keep their source.
    assert (p4d.gpus, p4d.accelerator, p4d.vcpus) == (8, "A100", 96)
    assert "DescribeInstanceTypes" in p4d.source and p4d.regions["us-east-1"].on_demand
    assert refreshed.for_provider("gcp") == shipped_catalog().for_provider("gcp")


def test_catalog_refresh_command(aws: AwsProvider, workspace: Path) -> None:
    from typer.testing import CliRunner

    from trainpipe.cli import app

    result = CliRunner().invoke(app, ["catalog", "refresh", "aws", "--regions", "us-west-2", "--no-prices"])
    assert result.exit_code == 0, result.output
    assert f"instance types written to {workspace / 'catalog' / 'aws.json'}" in result.output
    shown = CliRunner().invoke(app, ["catalog", "show", "aws"])
    assert "EC2 DescribeInstanceTypes" in shown.output and "us-east-1" not in shown.output


@pytest.mark.parametrize(("code", "kind"), [
    *[(code, CapacityError) for code in ("InsufficientInstanceCapacity", "InsufficientHostCapacity",
                                         "MaxSpotInstanceCountExceeded", "SpotMaxPriceTooLow", "Unsupported",
                                         "UnfulfillableCapacity", "InsufficientCapacity")],
    ("VcpuLimitExceeded", QuotaError), ("InstanceLimitExceeded", QuotaError),
    ("UnauthorizedOperation", AuthError), ("AuthFailure", AuthError), ("InvalidAMIID.NotFound", InvalidRequestError),
])
def test_launch_errors_are_classified(code: str, kind: type[Exception]) -> None:
    error = classify(ClientError({"Error": {"Code": code, "Message": "m"}}, "RunInstances"), "launch x")
    assert type(error) is kind and str(error).startswith(f"aws: launch x: {code}: m: ")


@pytest.mark.parametrize(("code", "status"), [("InternalError", 500), ("Unavailable", 503), ("SomethingNew", 502)])
def test_ec2_server_errors_are_transient_not_a_request_to_fix(code: str, status: int) -> None:
    """Before, a 500 InternalError was "fix the request": not transient, so the teardown task did not try again."""
    from infra.errors import is_transient

    error = classify(ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {
        "HTTPStatusCode": status}}, "DescribeInstances"), "tear down x")
    assert is_transient(error) and not isinstance(error, InvalidRequestError), error
    assert str(error) == f"aws: tear down x: {code}: m: EC2 failed, retry later"


def test_the_watchs_reads_are_asked_once_while_ec2_fails_them(aws: AwsProvider, ec2_server: Ec2Server) -> None:
    """The preemption watch backs off on its own: botocore's standard retries under its reads (up to 20 s a retry,
    21 s measured for one throttled read) only blocked its round. Other calls keep their retries."""
    cluster = aws.launch("tp-aws-watch", spec(regions=("us-east-1",)), "run-watch")
    sent: list[str] = []
    # Sent: once per attempt (botocore's retries happen after before-call).
    aws.watch_client("us-east-1").meta.events.register("before-send.ec2.*", lambda **kw: sent.append(
        kw["event_name"].rsplit(".", 1)[-1]))
    try:
        ec2_server.start_outage(60)
        for read in (aws.nodes_alive, aws.preemption_notices):
            with pytest.raises(LaunchError, match="EC2 failed, retry later"):
                read(cluster)
        assert sent == ["DescribeInstances", "DescribeSpotInstanceRequests"], sent
    finally:
        ec2_server.start_outage(0)
    assert aws.terminate("tp-aws-watch")


def test_terminate_goes_to_the_clusters_region_first_and_past_a_region_that_fails(
        aws: AwsProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    import infra.compute.providers.aws.provider as aws_provider

    def failing(region: str) -> AwsProvider:
        """A fresh provider (as the teardown task builds one) whose calls to region are throttled away."""
        fresh = AwsProvider(catalog=small_catalog(), bootstrap=False)

        def hook(**_: Any) -> None:
            raise ClientError({"Error": {"Code": "RequestLimitExceeded", "Message": "injected"}}, "DescribeInstances")

        fresh.client(region).meta.events.register("before-call.ec2.DescribeInstances", hook)
        return fresh

    # Launched in us-west-2, the second region asked: the first, us-east-1, does not answer.
    aws.launch("tp-aws-region", spec(regions=("us-west-2",)), "run-region")
    fresh = failing("us-east-1")
    calls = record_calls(fresh)
    with pytest.raises(CapacityError, match="tear down tp-aws-region in us-east-1"):
        fresh.terminate("tp-aws-region")
    assert calls[0][0] == "us-west-2", "the cluster's own region is torn down first"
    assert live(aws, "us-west-2", "tp-aws-region") == [] and groups_left(aws, "tp-aws-region") == []

    # A process that never saw the cluster asks the regions in order: the failing one does not stop the next.
    aws.launch("tp-aws-region", spec(regions=("us-west-2",)), "run-region")
    monkeypatch.setattr(aws_provider, "_known_regions", {})
    fresh = failing("us-east-1")
    with pytest.raises(CapacityError) as failed:
        fresh.terminate("tp-aws-region")
    assert failed.value.transient, "throttling is worth the teardown's retry"
    assert live(aws, "us-west-2", "tp-aws-region") == [] and groups_left(aws, "tp-aws-region") == []
