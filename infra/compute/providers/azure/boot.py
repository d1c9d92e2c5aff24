"""What an Azure node boots with: the custom data cloud-init runs at first boot, which installs the cluster's host key,
then RAIDs the VM's local NVMe disks (the ND-series' temporary NVMe, one device each) into one filesystem at MOUNT,
then, when the VM carries a user-assigned identity, makes its power-off delete it."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from infra.compute.access.hostkeys import HostKey
from infra.compute.providers import poweroff
from infra.compute.providers.azure.errors import InvalidRequestError
from infra.compute.providers.cloud import boot_script
from infra.compute.providers.nvme_boot import nvme_script
from infra.node import azure_self_delete

# The OS disk is SCSI on the ND-series, so every NVMe namespace is a local temporary disk (a deallocation empties
# them, and the next boot formats them again).
NVME_SCRIPT = nvme_script("devices=(/dev/nvme[0-9]*n1)")


def user_identity(vm_identity: dict[str, Any]) -> str | None:
    """The user-assigned identity (resource ID) of a VM's `identity` in ARM's shape: trainpipe gives a VM one at
    most (cluster.azure.identity); None for a system-assigned one."""
    return next(iter(vm_identity.get("userAssignedIdentities") or {}), None)


def poweroff_deletes_script(identity: str, api_endpoint: str | None = None) -> str:
    """Makes powering the VM off delete it (infra.node.azure_self_delete says why Azure needs this), with the
    identity's token, through the Resource Manager endpoint the nodes call."""
    api = api_endpoint or azure_self_delete.API
    try:
        return poweroff.poweroff_deletes_script(
            Path(azure_self_delete.__file__).read_text(), ["--identity", identity, "--api", api],
            "trainpipe: delete this VM when it powers off (Azure only stops it, and bills it)")
    except ValueError as exc:
        raise InvalidRequestError(f"azure: the nodes' power-off: {exc}") from None


def custom_data(host_key: HostKey, identity: str | None = None, api_endpoint: str | None = None) -> str:
    """The VM's customData (base64, as ARM takes it): with a user-assigned identity (its resource ID), the VM deletes
    itself as it powers off, through api_endpoint (default Azure's Resource Manager); without one nothing can, and the
    sweeper is the backstop (config.NO_IDENTITY). Anyone allowed to read the VM's model in the subscription can read
    it, host private key included: see infra.compute.access.hostkeys."""
    body = NVME_SCRIPT + (poweroff_deletes_script(identity, api_endpoint) if identity is not None else "")
    return base64.b64encode(boot_script(host_key, body).encode()).decode()
