"""The job's `cluster.azure:` section: what the nodes themselves are allowed to do, and what they boot.

Nodes read the dataset and write checkpoints with their own credentials, never the orchestrator's: on Azure those
are a managed identity the VMs carry. Azure's instance metadata service hands a VM's processes tokens for it
(azure-identity's ManagedIdentityCredential, inside DefaultAzureCredential), so no key is ever written to a node.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from infra.compute.providers.section import ProviderSection
from infra.node.azure_self_delete import ROLE, ROLE_FILE

# Azure's own characters only (a group name may hold . ( ), never a quote or a space): the ID is passed to the
# nodes' power-off unit.
IDENTITY_ID = re.compile(r"^/subscriptions/[-\w]+/resourceGroups/[-\w.()]+/providers/Microsoft\.ManagedIdentity/"
                         r"userAssignedIdentities/[-\w]+$", re.IGNORECASE)
IMAGE_URN = re.compile(r"^[^:\s]+:[^:\s]+:[^:\s]+:[^:\s]+$")
# Microsoft's HPC/AI image for Ubuntu 22.04 (the DSVM publisher's ubuntu-hpc): NVIDIA driver, CUDA, the Mellanox
# OFED stack that InfiniBand needs, Docker and the NVIDIA container toolkit. `latest` is resolved by Azure at creation.
DEFAULT_IMAGE = "microsoft-dsvm:ubuntu-hpc:2204:latest"
IMAGE_ENV = "TRAINPIPE_AZURE_IMAGE"
NO_IDENTITY = ("cluster.azure.identity is not set: a VM whose lease expires powers off but cannot delete itself (a "
               "system-assigned identity is born with its VM, so no role can have been granted to it), and a stopped "
               "VM is billed until the sweeper (`trainpipe sweep`) deletes its cluster: set a user-assigned identity "
               f"with the role '{ROLE}' ({ROLE_FILE}) on the subscription")


class AzureClusterSpec(ProviderSection):
    identity: str | None = Field(
        None, description="The user-assigned managed identity the VMs carry (its resource ID, /subscriptions/SUB/"
        "resourceGroups/RG/providers/Microsoft.ManagedIdentity/userAssignedIdentities/NAME): grant it Storage Blob "
        "Data Contributor on the job's storage account, once, and every node reaches the store without a key; "
        "and the role of examples/azure-self-delete-role.json (virtualMachines/read and /delete only) on the "
        "subscription, and a VM whose lease expires deletes itself as it powers off. None: each VM gets a "
        "system-assigned identity, which exists only once the VM does, so nothing can have been granted to it: "
        "az:// stores then are refused at plan, and only the sweeper deletes a VM whose lease expired.")
    image: str | None = Field(None, description="The VM image as PUBLISHER:OFFER:SKU:VERSION (VERSION may be "
                              "latest). It needs the NVIDIA driver and, for training.image, a container engine and the "
                              f"NVIDIA container toolkit. None: {IMAGE_ENV}, else {DEFAULT_IMAGE} (Microsoft's HPC/AI "
                              "image: those, and the InfiniBand (OFED) stack the ND-series needs).")

    @field_validator("identity")
    @classmethod
    def _identity_id(cls, value: str | None) -> str | None:
        if value is not None and not IDENTITY_ID.match(value):
            raise ValueError(f"identity {value!r} is not a user-assigned identity's resource ID: give /subscriptions/"
                             "SUB/resourceGroups/RG/providers/Microsoft.ManagedIdentity/userAssignedIdentities/NAME "
                             "(az identity show --query id)")
        return value

    @field_validator("image")
    @classmethod
    def _image_urn(cls, value: str | None) -> str | None:
        if value is not None and not IMAGE_URN.match(value):
            raise ValueError(f"image {value!r}: give PUBLISHER:OFFER:SKU:VERSION (az vm image list)")
        return value

    def image_reference(self, env_value: str | None = None) -> dict[str, str]:
        """ARM's imageReference of this section's image, else of env_value (TRAINPIPE_AZURE_IMAGE's), else of the
        HPC/AI image."""
        urn = self.image or env_value or DEFAULT_IMAGE
        if not IMAGE_URN.match(urn):
            raise ValueError(f"{IMAGE_ENV} {urn!r}: give PUBLISHER:OFFER:SKU:VERSION (az vm image list), or set "
                             "cluster.azure.image")
        publisher, offer, sku, version = urn.split(":")
        return {"publisher": publisher, "offer": offer, "sku": sku, "version": version}

    def plan_warnings(self) -> tuple[str, ...]:
        """What the plan warns of: without an identity, only the sweeper ends a VM whose lease expired."""
        return (NO_IDENTITY,) if self.identity is None else ()

    def vm_identity(self) -> dict[str, object]:
        """The VM's `identity` in ARM's shape."""
        if self.identity is None:
            return {"type": "SystemAssigned"}
        return {"type": "UserAssigned", "userAssignedIdentities": {self.identity: {}}}
