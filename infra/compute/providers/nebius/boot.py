"""What a Nebius node boots with: its cloud-init user data, a script cloud-init runs once at first boot.

In order: the cluster's host key (cloud.boot_script puts it first), the login user with the orchestrator's public key
and passwordless sudo, the local disks (Nebius passes them through as NVMe devices beside the virtio boot disk)
RAID0 into one filesystem at MOUNT, the shared filesystem (virtiofs, by its mount tag) at /mnt/filesystem, and the
stop notice.

The stop notice is what Nebius gives a preemptible VM: it stops it (PreemptibleSpec.on_preemption STOP) by a guest
shutdown, and publishes no metadata notice. So the script installs a unit whose stop, at a shutdown that is not a
reboot, writes the node's preemption notice file (infra.node.preemption_notice, read by the node's watcher: notice
source `file`) and gives the watcher NOTICE_S to stop the trainer and flush the last checkpoint before the guest goes
on shutting down. The orchestrator sees the same preemption in the API (the instance STOPPING, then STOPPED).
"""

from __future__ import annotations

import re
import shlex

from infra.compute.access.hostkeys import HostKey
from infra.compute.providers.cloud import MOUNT, boot_script
from infra.compute.providers.nebius.errors import InvalidRequestError
from infra.compute.providers.nvme_boot import nvme_script
from infra.node.preemption_notice import NOTICE_FILE

FILESYSTEM_MOUNT = "/mnt/filesystem"
FILESYSTEM_TAG = "trainpipe-fs"  # the mount tag the shared filesystem is attached with
NOTICE_S = 30.0  # how long the stop waits for the watcher to stop the trainer and ship its checkpoint
NOTICE_UNIT = "trainpipe-stop-notice.service"
WORKDIR = f"{MOUNT}/trainpipe"
USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")

# Nebius passes the local disks through as NVMe devices; the boot disk is virtio, so every NVMe disk is local.
DISKS_SCRIPT = nvme_script(
    "mapfile -t devices < <(lsblk -dpno NAME,TYPE | awk '$2 == \"disk\" && $1 ~ /nvme/ {print $1}')")

FILESYSTEM_SCRIPT = f"""mkdir -p {FILESYSTEM_MOUNT}
mountpoint -q {FILESYSTEM_MOUNT} || mount -t virtiofs {FILESYSTEM_TAG} {FILESYSTEM_MOUNT}
chmod 1777 {FILESYSTEM_MOUNT}
"""


def user_script(user: str, public_key: str) -> str:
    """The login user trainpipe reaches the node as, with the orchestrator's key and passwordless sudo (the lease
    watchdog powers the node off with sudo)."""
    if not USER_NAME.match(user):
        raise InvalidRequestError(f"nebius: SSH user {user!r} is not a valid login name")
    if "\n" in public_key.strip() or not public_key.strip().startswith(("ssh-", "ecdsa-")):
        raise InvalidRequestError("nebius: the SSH public key is not one OpenSSH public key line")
    key = shlex.quote(public_key.strip())
    return f"""id -u {user} >/dev/null 2>&1 || useradd -m -s /bin/bash {user}
home=$(getent passwd {user} | cut -d: -f6)
install -d -m 0700 -o {user} -g {user} "$home/.ssh"
grep -qxF {key} "$home/.ssh/authorized_keys" 2>/dev/null || printf '%s\\n' {key} >> "$home/.ssh/authorized_keys"
chown {user}:{user} "$home/.ssh/authorized_keys"
chmod 0600 "$home/.ssh/authorized_keys"
printf '%s ALL=(ALL) NOPASSWD:ALL\\n' {user} > /etc/sudoers.d/90-trainpipe
chmod 0440 /etc/sudoers.d/90-trainpipe
"""


NOTICE_PROGRAM = "/usr/local/sbin/trainpipe-stop-notice"


def notice_script() -> str:
    """The unit that turns a stop (how Nebius preempts) into the node's preemption notice. Skipped on a reboot."""
    notice = f"{WORKDIR}/{NOTICE_FILE}"
    return f"""cat > {NOTICE_PROGRAM} <<'TRAINPIPE_NOTICE'
#!/usr/bin/env python3
import json, os, time
notice = {{"reason": "nebius: instance stopping (preemptible)", "deadline": time.time() + {NOTICE_S:g},
          "source": "nebius"}}
with open("{notice}.tmp", "w") as out:
    out.write(json.dumps(notice))
os.replace("{notice}.tmp", "{notice}")
time.sleep({NOTICE_S:g})  # the watcher stops the trainer, the syncer ships the last checkpoint
TRAINPIPE_NOTICE
chmod 0755 {NOTICE_PROGRAM}
cat > /etc/systemd/system/{NOTICE_UNIT} <<'TRAINPIPE_UNIT'
[Unit]
Description=trainpipe: a stop of this instance (how Nebius preempts) is the node's preemption notice
After=network-online.target systemd-user-sessions.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/true
ExecStop=/bin/sh -c 'systemctl list-jobs | grep -q reboot.target || exec {NOTICE_PROGRAM}'
TimeoutStopSec={NOTICE_S + 15:g}

[Install]
WantedBy=multi-user.target
TRAINPIPE_UNIT
systemctl daemon-reload
systemctl enable --now {NOTICE_UNIT}
"""


def user_data(host_key: HostKey, user: str, public_key: str, filesystem: bool) -> str:
    """The instance's cloud-init user data. Anyone who may read instances in the project can read it, host private
    key included: see infra.compute.access.hostkeys."""
    body = user_script(user, public_key) + DISKS_SCRIPT + (FILESYSTEM_SCRIPT if filesystem else "") + notice_script()
    return boot_script(host_key, body)
