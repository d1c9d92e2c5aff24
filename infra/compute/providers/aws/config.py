"""The job's `cluster.aws:` section: what the nodes themselves are allowed to do.

Nodes read the dataset and write checkpoints with their own credentials, never the orchestrator's: on EC2 those come
from an instance profile (an IAM role the instances carry), named here and passed to run_instances.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator

from infra.compute.providers.section import ProviderSection

# IAM's own rules for an instance profile's name, and its ARN (a path may come before the name).
PROFILE_NAME = re.compile(r"^[A-Za-z0-9_+=,.@-]{1,128}$")
PROFILE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::[0-9]{12}:instance-profile/[A-Za-z0-9_+=,.@/-]{1,640}$")
AMI_ID = re.compile(r"^ami-[0-9a-f]{8,17}$")


class AwsClusterSpec(ProviderSection):
    instance_profile: str | None = Field(
        None, description="The IAM instance profile the nodes run with "
        "(its name, or its arn:aws:iam::ACCOUNT:instance-profile/NAME): its role must read the dataset's bucket and "
        "write the checkpoints' (s3:GetObject, s3:PutObject, s3:ListBucket, s3:DeleteObject). Without it the nodes "
        "have no AWS credentials, and plan refuses s3:// stores.")
    ami: str | dict[str, str] | None = Field(
        None, description="The image the nodes boot: one AMI id, or one per region ({us-east-1: ami-..., us-west-2: "
        "ami-...}; AMI ids are regional). It needs the NVIDIA driver and, for training.image, a container engine and "
        "the NVIDIA container toolkit. None (or a region not named): TRAINPIPE_AWS_AMI, else the region's Deep "
        "Learning Base AMI (OSS NVIDIA driver, Ubuntu 22.04; arm64 for Graviton types), read from its public SSM "
        "parameter at launch.")

    @field_validator("instance_profile")
    @classmethod
    def _name_or_arn(cls, value: str | None) -> str | None:
        if value is not None and not (PROFILE_NAME.match(value) or PROFILE_ARN.match(value)):
            raise ValueError(f"instance_profile {value!r} is neither an instance profile name nor its ARN: give the "
                             "name (aws iam list-instance-profiles) or arn:aws:iam::ACCOUNT:instance-profile/NAME")
        return value

    @field_validator("ami")
    @classmethod
    def _ami_ids(cls, value: str | dict[str, str] | None) -> str | dict[str, str] | None:
        for ami in [value] if isinstance(value, str) else (value or {}).values():
            if not AMI_ID.match(ami):
                raise ValueError(f"ami {ami!r} is not an AMI id: give ami-... (aws ec2 describe-images), or leave it "
                                 "out for the region's Deep Learning Base AMI")
        return value

    def ami_for(self, region: str) -> str | None:
        """The AMI this section names for region, None when it names none there."""
        return self.ami if isinstance(self.ami, str) else (self.ami or {}).get(region)

    def iam_instance_profile(self) -> dict[str, Any] | None:
        """run_instances' IamInstanceProfile for this section, None when it names none."""
        if self.instance_profile is None:
            return None
        return {"Arn" if self.instance_profile.startswith("arn:") else "Name": self.instance_profile}
