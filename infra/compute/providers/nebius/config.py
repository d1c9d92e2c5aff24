"""The job's `cluster.nebius:` section: the InfiniBand fabric the GPU cluster is made in, the project's subnet, the
nodes' disks and shared filesystem, and the service account they run as.

Where clusters live (the project of each region) and how the API is reached are settings of the machine that runs
trainpipe, not of a job (TRAINPIPE_NEBIUS_PROJECTS, TRAINPIPE_NEBIUS_ENDPOINT): a sweeper elsewhere needs them too.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from infra.compute.providers.section import ProviderSection

# The fabrics Nebius lists for its 8-GPU presets (docs.nebius.com/compute/clusters/gpu), by region and platform: the
# fabric a GPU cluster is made in when the job names none for the region.
DEFAULT_FABRICS = {
    ("eu-north1", "gpu-h100-sxm"): "fabric-3",
    ("eu-north1", "gpu-h200-sxm"): "fabric-6",
    ("eu-west1", "gpu-h200-sxm"): "fabric-5",
    ("us-central1", "gpu-h200-sxm"): "us-central1-a",
}
# A Nebius resource id: a prefix naming the kind (project, subnet, computefilesystem, serviceaccount) and an id.
RESOURCE_ID = re.compile(r"^[a-z][a-z0-9]*-[a-z0-9]{4,}$")
# Nebius's public CUDA image family (NVIDIA driver, CUDA, Docker and the NVIDIA container toolkit); Nebius makes the
# boot disk from its newest image (SourceImageFamily), so nothing here names a version.
DEFAULT_IMAGE_FAMILY = "ubuntu22.04-cuda12"
IMAGE_FAMILY_ENV = "TRAINPIPE_NEBIUS_IMAGE_FAMILY"
DISK_TYPES = ("network_ssd", "network_ssd_non_replicated", "network_ssd_io_m3", "network_hdd")


def _resource_ids(values: dict[str, str] | str | None, field: str, kind: str) -> None:
    items = values.values() if isinstance(values, dict) else [values] if values else []
    for value in items:
        if not RESOURCE_ID.match(value):
            raise ValueError(f"{field} {value!r} is not a Nebius resource id (like {kind}-e00abc123): copy it from "
                             "the console or the nebius CLI")


class NebiusClusterSpec(ProviderSection):
    fabrics: dict[str, str] = Field(
        default_factory=dict, description="The InfiniBand fabric of the GPU cluster, by region (e.g. {eu-north1: "
        "fabric-3}); a region not named uses the fabric Nebius lists for the platform there (eu-north1: fabric-3 "
        "for H100, fabric-6 for H200; eu-west1: fabric-5; us-central1: us-central1-a).")
    subnets: dict[str, str] = Field(
        default_factory=dict, description="The subnet the nodes' network interface is in, by region (a vpcsubnet "
        "id); a region not named uses the project's first subnet (every project has a default one).")
    boot_disk_gb: int = Field(200, ge=50, le=8192, description="Size of each node's boot disk (network SSD) in GiB; "
                              "without local disks the job's data and checkpoints live on it.")
    boot_disk_type: str = Field("network_ssd", description=f"The boot disk's type: one of {', '.join(DISK_TYPES)}.")
    image_family: str | None = Field(None, min_length=1, description="The public image family the boot disk is "
                                     "made from (its newest image). It needs the NVIDIA driver and, for "
                                     "training.image, a container engine and the NVIDIA container toolkit. None: "
                                     f"{IMAGE_FAMILY_ENV}, else {DEFAULT_IMAGE_FAMILY} (those included).")
    filesystem_id: str | None = Field(None, description="An existing shared filesystem (computefilesystem id) "
                                      "attached read-write to every node and mounted at /mnt/filesystem; none: no "
                                      "shared filesystem.")
    service_account_id: str | None = Field(None, description="The service account the nodes run as "
                                           "(serviceaccount id); none: the nodes get no Nebius identity.")
    preemptible_priority: int = Field(3, ge=1, le=5, description="Priority of preemptible nodes among the "
                                      "project's preemptible VMs (5 is preempted last).")

    @field_validator("boot_disk_type")
    @classmethod
    def _disk_type(cls, value: str) -> str:
        if value not in DISK_TYPES:
            raise ValueError(f"boot_disk_type {value!r}: use one of {', '.join(DISK_TYPES)}")
        return value

    @field_validator("subnets")
    @classmethod
    def _subnet_ids(cls, value: dict[str, str]) -> dict[str, str]:
        _resource_ids(value, "subnets", "vpcsubnet")
        return value

    @field_validator("filesystem_id")
    @classmethod
    def _filesystem_id(cls, value: str | None) -> str | None:
        _resource_ids(value, "filesystem_id", "computefilesystem")
        return value

    @field_validator("service_account_id")
    @classmethod
    def _service_account_id(cls, value: str | None) -> str | None:
        _resource_ids(value, "service_account_id", "serviceaccount")
        return value

    def boot_image_family(self, env_value: str | None = None) -> str:
        """This section's image family, else env_value (TRAINPIPE_NEBIUS_IMAGE_FAMILY's), else the CUDA family."""
        return self.image_family or env_value or DEFAULT_IMAGE_FAMILY

    def fabric(self, region: str, platform: str) -> str | None:
        """The fabric a GPU cluster of this platform is made in, in region: the job's, else Nebius's listed one."""
        return self.fabrics.get(region) or DEFAULT_FABRICS.get((region, platform))
