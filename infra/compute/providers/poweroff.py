"""What makes a cloud node's power-off end its instance where the cloud only stops it (GCE, Azure): a boot script
piece that installs a self-contained program and a systemd unit whose stop runs it at a shutdown that is not a reboot,
while the network is still up. The program (infra.node.gce_self_delete, infra.node.azure_self_delete) deletes the
instance through the cloud's API with the instance's own identity."""

from __future__ import annotations

import re
from collections.abc import Sequence

SELF_DELETE = "/usr/local/sbin/trainpipe-delete-self"
POWEROFF_UNIT = "trainpipe-delete-on-poweroff.service"
# What an argument may hold: it lands inside `sh -c '…'` inside a systemd ExecStop line, whose quoting rules differ.
PLAIN = re.compile(r"[\w:/.()-]+")
BARE = re.compile(r"[\w:/.-]+")  # needs no quotes in sh either


def _sh_word(argument: str) -> str:
    if not PLAIN.fullmatch(argument):
        raise ValueError(f"{argument!r} cannot be passed to the power-off unit: it holds a character beside letters, "
                         "digits and : / . ( ) _ -")
    return argument if BARE.fullmatch(argument) else f'"{argument}"'  # sh reads ( ) as syntax unless quoted


def poweroff_deletes_script(program: str, arguments: Sequence[str], description: str) -> str:
    """Bash that installs program (Python source) and a unit that runs it with arguments when the machine powers off
    (its stop at shutdown, skipped on a reboot). Idempotent: GCE runs its startup script at every boot.
    description: the unit's, saying why this cloud needs it."""
    command = " ".join([f"/usr/bin/python3 {SELF_DELETE}", *map(_sh_word, arguments)])
    return f"""cat > {SELF_DELETE} <<'TRAINPIPE_SELF_DELETE'
{program}TRAINPIPE_SELF_DELETE
chmod 0755 {SELF_DELETE}
cat > /etc/systemd/system/{POWEROFF_UNIT} <<'TRAINPIPE_UNIT'
[Unit]
Description={description}
Wants=network-online.target
After=network-online.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/true
ExecStop=/bin/sh -c 'systemctl list-jobs | grep -q reboot.target || exec {command}'
TimeoutStopSec=60

[Install]
WantedBy=multi-user.target
TRAINPIPE_UNIT
systemctl daemon-reload
systemctl enable --now {POWEROFF_UNIT}
"""
