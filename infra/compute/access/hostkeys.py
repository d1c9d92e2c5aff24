"""SSH host keys the orchestrator makes for cloud nodes, so that their first connection is already verified.

A freshly launched instance generates its own host key at boot, which the orchestrator cannot know in advance; an
unknown key must never be accepted. So the orchestrator generates an ed25519 key pair per cluster at launch, hands
the private half to the nodes in their boot script (which installs it as sshd's ed25519 host key before anything
else) and keeps only the fingerprint, which every runner of the cluster pins.

The boot script (EC2 user-data, GCE startup-script) is readable by anyone allowed to describe the instance in that
account or project, so this key proves "a node this account launched", not more: the same trust boundary as the
account's SSH key pair, which anyone with those rights can usually replace anyway.
"""

from __future__ import annotations

import base64
import hashlib
import shlex
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

SSH_DIR = "/etc/ssh"
KEY_NAME = "ssh_host_ed25519_key"  # the name sshd's default HostKey list loads
COMMENT = "trainpipe-node"
HEREDOC_END = "TRAINPIPE_HOST_KEY"


@dataclass(frozen=True)
class HostKey:
    """One node host key pair in OpenSSH formats, and the SHA256 fingerprint runners pin."""

    private_openssh: str = field(repr=False)  # never in a repr, so never in a log line or a traceback
    public_openssh: str
    fingerprint: str


def fingerprint_of(public_openssh: str) -> str:
    """SHA256:<base64 of the sha256 of the key blob, unpadded>: what `ssh-keygen -lf` prints and paramiko compares."""
    try:
        blob = base64.b64decode(public_openssh.split()[1], validate=True)
    except (IndexError, ValueError) as exc:
        raise ValueError(f"not an OpenSSH public key line ({exc}): expected 'TYPE BASE64 [comment]'") from None
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def generate_host_key(comment: str = COMMENT) -> HostKey:
    """A new ed25519 key pair: the private key in OpenSSH format (unencrypted: sshd reads it unattended)."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH).decode()
    return HostKey(private_openssh=private, public_openssh=f"{public} {comment}", fingerprint=fingerprint_of(public))


def install_script(key: HostKey, ssh_dir: str = SSH_DIR) -> str:
    """Bash that installs key as sshd's ed25519 host key in ssh_dir (private 0600, public 0644) and restarts sshd so
    it serves it. Both files are written beside their targets and renamed over them, so sshd never reads half a key;
    the private one is created under umask 077, so it is never readable by others, not even for a moment."""
    if HEREDOC_END in key.private_openssh or "'" in key.public_openssh or "\n" in key.public_openssh:
        raise ValueError("host key text would break the install script's quoting")
    private = shlex.quote(f"{ssh_dir}/{KEY_NAME}")
    public = shlex.quote(f"{ssh_dir}/{KEY_NAME}.pub")
    return f"""# The orchestrator's host key for this node (infra/compute/access/hostkeys.py);
# runners pin {key.fingerprint}.
mkdir -p {shlex.quote(ssh_dir)}
(
  umask 077
  cat > {private}.trainpipe <<'{HEREDOC_END}'
{key.private_openssh.rstrip()}
{HEREDOC_END}
)
chmod 0600 {private}.trainpipe
printf '%s\\n' '{key.public_openssh}' > {public}.trainpipe
chmod 0644 {public}.trainpipe
mv -f {private}.trainpipe {private}
mv -f {public}.trainpipe {public}
# sshd loads host keys when it starts: restart it (Debian/Ubuntu call the unit ssh, others sshd).
systemctl restart ssh || systemctl restart sshd
"""
