"""The boot script's local NVMe step, one for every cloud: RAID0 over the node's local disks (one disk is used as is),
one filesystem, mounted at MOUNT, with trainpipe's folders on it. Only how the disks are found differs by cloud.

Every step is skipped when already done, so the same script serves a cloud that runs it at every boot (GCE's
startup-script; an Azure reboot finds the array assembled) and one that runs it once (cloud-init user data): a mounted
filesystem is kept, an assembled array is reused, a disk that already holds a filesystem is not formatted again. It
follows the host key install (cloud.boot_script), so the node is reachable while mdadm and mkfs run."""

from __future__ import annotations

from infra.compute.providers.cloud import MOUNT


def nvme_script(find_devices: str) -> str:
    """The NVMe step of a boot script; `find_devices` is the bash that fills the array `devices` with the local
    disks' paths (a glob, under nullglob, matches nothing rather than itself)."""
    return f"""shopt -s nullglob
mkdir -p {MOUNT}
if ! mountpoint -q {MOUNT}; then
  {find_devices}
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
