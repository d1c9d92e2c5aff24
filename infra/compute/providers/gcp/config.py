"""The job's `cluster.gcp:` section: what the nodes themselves are allowed to do.

Nodes read the dataset and write checkpoints with their own credentials, never the orchestrator's: on Compute Engine
those are the VM's service account, limited by its access scopes.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from infra.compute.providers.section import ProviderSection
from infra.strict_model import StrictModel

CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
# The scopes under which a VM's service account may read and write Cloud Storage objects.
STORAGE_SCOPES = (CLOUD_PLATFORM, "https://www.googleapis.com/auth/devstorage.read_write",
                  "https://www.googleapis.com/auth/devstorage.full_control")
_SCOPE_PREFIX = "https://www.googleapis.com/auth/"


class GcpServiceAccount(StrictModel):
    email: str | None = Field(None, min_length=1, description="The service account the VMs run as (e.g. "
                              "trainer@PROJECT.iam.gserviceaccount.com); none: TRAINPIPE_GCP_SERVICE_ACCOUNT, else "
                              "the project's Compute Engine default account. It needs storage.objects.* on the job's "
                              "buckets and compute.instances.delete on its own VMs (an expired lease deletes them).")
    scopes: tuple[str, ...] = Field((CLOUD_PLATFORM,), min_length=1, description="Its access scopes (full URLs or "
                                    "short names like devstorage.read_write); reaching gs:// stores needs "
                                    "cloud-platform or devstorage.read_write.")

    @field_validator("scopes")
    @classmethod
    def _full_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(scope if scope.startswith("https://") else _SCOPE_PREFIX + scope for scope in value)

    def reaches_storage(self) -> bool:
        return any(scope in STORAGE_SCOPES for scope in self.scopes)


class GcpClusterSpec(ProviderSection):
    image: str | None = Field(None, min_length=1, description="The image the nodes boot (projects/P/global/images/"
                              "NAME, or an image family: projects/P/global/images/family/FAMILY). It needs the NVIDIA "
                              "driver and, for training.image, a container engine and the NVIDIA container toolkit. "
                              "None: TRAINPIPE_GCP_IMAGE, else the newest image of Google's Deep Learning VM family "
                              "common-cu128-ubuntu-2204-nvidia-570 (project deeplearning-platform-release), looked "
                              "up at launch.")
    service_account: GcpServiceAccount = Field(
        default_factory=GcpServiceAccount, description="The VMs' service account and access scopes: how the nodes "
        "reach the dataset and checkpoint buckets.")
