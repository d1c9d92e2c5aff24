"""What an Azure node boots with: the custom data cloud-init runs at first boot, which installs the cluster's host key,
then RAIDs the VM's local NVMe disks (the ND-series' temporary NVMe, one device each) into one filesystem at MOUNT."""

from __future__ import annotations

import base64

from infra.compute.access.hostkeys import HostKey
from infra.compute.providers.cloud import MOUNT, boot_script

# The OS disk is SCSI on the ND-series, so every NVMe namespace is a local temporary disk. Each step is skipped
# when already done (a reboot finds the array assembled; a deallocation empties the disks, and mkfs runs again).
NVME_SCRIPT = f"""shopt -s nullglob
mkdir -p {MOUNT}
if ! mountpoint -q {MOUNT}; then
  devices=(/dev/nvme[0-9]*n1)
  target=""
  if [ -e /dev/md0 ]; then
    target=/dev/md0
  elif [ "${{#devices[@]}}" -gt 1 ]; then
    command -v mdadm >/dev/null || {{ apt-get update -qq && apt-get install -y -qq mdadm; }}
    mdadm --create /dev/md0 --run --force --level=0 --raid-devices="${{#devices[@]}}" "${{devices[@]}}"
    target=/dev/md0
  elif [ "${{#devices[@]}}" -eq 1 ]; then
    target="${{devices[0]}}"
  fi
  if [ -n "$target" ]; then
    if ! blkid "$target" >/dev/null 2>&1; then
      if command -v mkfs.xfs >/dev/null; then mkfs.xfs -f -K "$target"; else mkfs.ext4 -F -E nodiscard "$target"; fi
    fi
    mount -o noatime "$target" {MOUNT}
  fi
fi
mkdir -p {MOUNT}/trainpipe/data {MOUNT}/trainpipe/ckpt {MOUNT}/trainpipe/logs
chmod -R 1777 {MOUNT}/trainpipe
"""


def custom_data(host_key: HostKey) -> str:
    """The VM's customData (base64, as ARM takes it). Anyone allowed to read the VM's model in the subscription can
    read it, host private key included: see infra.compute.access.hostkeys."""
    return base64.b64encode(boot_script(host_key, NVME_SCRIPT).encode()).decode()
