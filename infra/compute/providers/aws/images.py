"""The image an AWS node boots: cluster.aws.ami, else TRAINPIPE_AWS_AMI, else the region's Deep Learning Base AMI.

AWS publishes the newest Deep Learning Base AMI of each region as a public SSM parameter, so the default is looked up
at launch rather than written here (AMI ids are regional and replaced every few weeks). That image carries what a
job's training.image needs on the host: the NVIDIA driver, Docker, the NVIDIA container toolkit, EFA and NCCL's OFI
plugin. Graviton types (g5g, the Grace-based p6e-gb200) boot its arm64 build.
"""

from __future__ import annotations

from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from infra.compute.providers.aws.config import AwsClusterSpec
from infra.compute.providers.aws.errors import InvalidRequestError

AMI_ENV = "TRAINPIPE_AWS_AMI"
DLAMI_PARAMETER = "/aws/service/deeplearning/ami/{arch}/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"


def env_ami(value: str | None, region: str) -> str | None:
    """TRAINPIPE_AWS_AMI's AMI for region: the one id it names, or region's of `us-east-1=ami-1,us-west-2=ami-2`."""
    if not value:
        return None
    if "=" not in value:
        return value
    return dict(item.split("=", 1) for item in value.split(",") if "=" in item).get(region)


def architecture(ec2: Any, instance_type: str) -> str:
    """arm64 for a type whose processors are ARM only (Graviton, Grace), else x86_64: as EC2 describes the type."""
    try:
        described = ec2.describe_instance_types(InstanceTypes=[instance_type])["InstanceTypes"]
    except (ClientError, BotoCoreError) as exc:
        raise InvalidRequestError(f"aws: cannot describe instance type {instance_type} ({exc}): set cluster.aws.ami "
                                  f"(or {AMI_ENV}) to an AMI id") from None
    arches = described[0]["ProcessorInfo"]["SupportedArchitectures"] if described else ["x86_64"]
    return "arm64" if "x86_64" not in arches and "arm64" in arches else "x86_64"


def deep_learning_ami(region: str, arch: str) -> str:
    """The region's newest Deep Learning Base AMI for arch, from its public SSM parameter."""
    name = DLAMI_PARAMETER.format(arch=arch)
    try:
        ssm = boto3.session.Session().client("ssm", region_name=region)
        return str(ssm.get_parameter(Name=name)["Parameter"]["Value"])
    except (ClientError, BotoCoreError) as exc:
        reason = exc.response["Error"].get("Code", "error") if isinstance(exc, ClientError) else type(exc).__name__
        raise InvalidRequestError(f"aws: cannot read SSM parameter {name} in {region} ({reason}): set "
                                  f"cluster.aws.ami (or {AMI_ENV}) to an AMI id of {region}") from None


def boot_image(section: AwsClusterSpec, env_value: str | None, ec2: Any, region: str, instance_type: str) -> str:
    """The job's AMI for region, else TRAINPIPE_AWS_AMI's, else the Deep Learning Base AMI for the type's processors."""
    return (section.ami_for(region) or env_ami(env_value, region)
            or deep_learning_ami(region, architecture(ec2, instance_type)))
