"""What a GCP node boots with: an image (cluster.gcp.image, else TRAINPIPE_GCP_IMAGE, else the newest of Google's Deep
Learning VM family, looked up at launch), its boot disk, its local SSDs (attached by GCE itself on the series that
bundle them) mounted as one filesystem, the cluster's host key, and a power-off that deletes the instance; all from
the startup-script, which GCE runs at every boot."""

from __future__ import annotations

import re
from pathlib import Path

from infra.compute.access.hostkeys import HostKey
from infra.compute.providers import poweroff
from infra.compute.providers.cloud import boot_script
from infra.compute.providers.gcp.errors import InvalidRequestError
from infra.compute.providers.nvme_boot import nvme_script
from infra.node import gce_self_delete

IMAGE_ENV = "TRAINPIPE_GCP_IMAGE"
# Google's Deep Learning VM images: the default boot image is the newest of this family (images.getFromFamily).
DLVM_PROJECT = "deeplearning-platform-release"
DLVM_FAMILY = "common-cu128-ubuntu-2204-nvidia-570"
BOOT_DISK_GB = 200
BOOT_DISK_TYPE = "pd-balanced"
# Series that come with their local SSDs attached; earlier ones (A2 standard, N1, G2) take SCRATCH disks in the
# request (cloud.google.com/compute/docs/disks/add-local-ssd).
BUNDLED_SSD_SERIES = ("a2-ultragpu-", "a3-", "a4-", "a4x-", "a5x-", "z3-", "z4d-", "z4m-")

# Local SSDs, as GCE names them; GCE runs the startup script on every boot, which nvme_script allows for.
NVME_SCRIPT = nvme_script("devices=(/dev/disk/by-id/google-local-nvme-ssd-*)")


def poweroff_deletes_script(api_endpoint: str | None = None) -> str:
    """Makes powering the instance off delete it (infra.node.gce_self_delete says why GCE needs this), with the Compute
    API the nodes call."""
    api = api_endpoint or gce_self_delete.API
    if not re.fullmatch(r"[A-Za-z0-9:/._-]+", api):
        raise InvalidRequestError(f"gcp: API endpoint {api!r}: give a plain http(s)://host[:port] URL")
    return poweroff.poweroff_deletes_script(
        Path(gce_self_delete.__file__).read_text(), ["--api", api],
        "trainpipe: delete this instance when it powers off (GCE only stops it, and bills its disks)")


def startup_script(host_key: HostKey, api_endpoint: str | None = None) -> str:
    """The instance's startup-script: the cluster's host key installed first, then the local SSD mount, then what makes
    a power-off delete the instance (api_endpoint: the Compute API the nodes call, default Google's). Anyone who may
    read instance metadata in the project (compute.instances.get) can read it, host private key included: see
    infra.compute.access.hostkeys."""
    return boot_script(host_key, NVME_SCRIPT + poweroff_deletes_script(api_endpoint))


def bundles_local_ssd(machine_type: str) -> bool:
    return machine_type.startswith(BUNDLED_SSD_SERIES) or machine_type.endswith("-lssd")
