"""What an Azure node boots with: the custom data cloud-init runs at first boot, which installs the cluster's host key,
then RAIDs the VM's local NVMe disks (the ND-series' temporary NVMe, one device each) into one filesystem at MOUNT."""

from __future__ import annotations

import base64

from infra.compute.access.hostkeys import HostKey
from infra.compute.providers.cloud import boot_script
from infra.compute.providers.nvme_boot import nvme_script

# The OS disk is SCSI on the ND-series, so every NVMe namespace is a local temporary disk (a deallocation empties
# them, and the next boot formats them again).
NVME_SCRIPT = nvme_script("devices=(/dev/nvme[0-9]*n1)")


def custom_data(host_key: HostKey) -> str:
    """The VM's customData (base64, as ARM takes it). Anyone allowed to read the VM's model in the subscription can
    read it, host private key included: see infra.compute.access.hostkeys."""
    return base64.b64encode(boot_script(host_key, NVME_SCRIPT).encode()).decode()
