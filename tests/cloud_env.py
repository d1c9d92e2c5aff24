"""The environment a trainpipe command of its own (an orchestrator, a sweeper) needs to use the simulated clouds as it
would use the real ones: EC2's endpoint and keys for boto3 (moto accepts any pair), and for google-auth a service
account key file whose token_uri is the simulated GCE's OAuth endpoint, so the command gets an access token the way
it would from Google."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from aws_server import Ec2Server
from gce_server import PROJECT, GceServer


def gcp_key_file(path: Path, gce: GceServer) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    path.write_text(json.dumps({
        "type": "service_account", "project_id": PROJECT, "private_key_id": "0123456789abcdef", "private_key": pem,
        "client_email": f"trainpipe@{PROJECT}.iam.gserviceaccount.com", "client_id": "1234567890",
        "token_uri": f"{gce.endpoint}/token"}))
    path.chmod(0o600)
    return path


def aws_env(ec2: Ec2Server, image: str, region: str = "us-east-1") -> dict[str, str]:
    return {**ec2.env(), "TRAINPIPE_AWS_REGIONS": region, "TRAINPIPE_AWS_AMI": image,
            "TRAINPIPE_SSH_CIDR": "127.0.0.1/32"}


def gcp_env(gce: GceServer, key_file: Path) -> dict[str, str]:
    return {"GOOGLE_APPLICATION_CREDENTIALS": str(key_file), "TRAINPIPE_GCP_PROJECT": PROJECT,
            "TRAINPIPE_GCP_ENDPOINT": gce.endpoint}


def register_image(ec2: Ec2Server, region: str = "us-east-1") -> str:
    import boto3

    with pytest.MonkeyPatch.context() as patch:
        for name, value in ec2.env().items():
            patch.setenv(name, value)
        return str(boto3.client("ec2", region_name=region).register_image(
            Name="trainpipe-test", RootDeviceName="/dev/sda1")["ImageId"])


def ec2_client(ec2: Ec2Server, region: str = "us-east-1") -> Any:
    import boto3

    env = ec2.env()
    return boto3.client("ec2", endpoint_url=ec2.endpoint, region_name=region,
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])


def aws_left(ec2: Ec2Server, cluster: str, region: str = "us-east-1") -> dict[str, list[str]]:
    """What of the cluster EC2 still has: instances not terminated (shutting-down counts: it still bills), its
    security and placement groups."""
    client = ec2_client(ec2, region)
    tagged = [{"Name": "tag:trainpipe:cluster", "Values": [cluster]}]
    instances = [f"{i['InstanceId']}:{i['State']['Name']}" for r in client.describe_instances(Filters=tagged)[
        "Reservations"] for i in r["Instances"] if i["State"]["Name"] != "terminated"]
    groups = [g["GroupId"] for g in client.describe_security_groups(Filters=tagged)["SecurityGroups"]]
    placements = [g["GroupName"] for g in client.describe_placement_groups(Filters=tagged)["PlacementGroups"]]
    return {k: v for k, v in {"instances": instances, "security groups": groups,
                              "placement groups": placements}.items() if v}


def gcp_left(gce: GceServer, cluster: str) -> dict[str, list[str]]:
    from infra.compute.providers.gcp.labels import LABEL_CLUSTER, resource_name

    instances = [f"{i['name']}:{i['status']}" for i in gce.instances()
                 if i["labels"].get(LABEL_CLUSTER) == cluster]
    policies = [p["name"] for p in gce.policies() if p["name"] == resource_name(cluster, "compact")]
    return {k: v for k, v in {"instances": instances, "placement policies": policies}.items() if v}


def wait_for(check: Any, timeout: float, what: str, interval: float = 0.1) -> float:
    """Seconds until check() is true; fails naming what did not happen."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"{what} did not happen within {timeout:.0f}s"
        time.sleep(interval)
    return time.monotonic() - started
