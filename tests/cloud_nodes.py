"""Stand-ins for the machines behind simulated cloud instances (tests/aws_server.py, tests/gce_server.py), so that an
unmodified orchestrator (`trainpipe run`) reaches its cloud nodes over SSH and starts its lease watchdogs on them.

What is real: an OpenSSH sshd per node, listening on the instance's public address (the simulated clouds hand out
127.77.x.y addresses) at port 22, serving the host key the orchestrator generated and put in the instance's boot
script; the node's own /mnt (its "local NVMe") and /run (where the boot script leaves its status), private to it in a
mount namespace, so two nodes on this one machine never share a workdir; every trainpipe process on it.

The node's user has a home of its own (this machine's root has a ~/.bashrc that puts another Python first on the
PATH), whose PATH leads to this test's interpreter as the image's python3.

What is faked, because no machine boots here: booting (instead of running the boot script, which would install a host
key into this machine's /etc/ssh and systemd units into its /etc/systemd, the stand-in takes the key out of the
instance's boot script, starts its sshd with it and writes the boot status), and powering off. The node's PATH starts
with a `shutdown` that does what the machine and its cloud do when the OS powers off: every process of the node ends
(SIGKILL to everything in its mount namespace, sshd included) and the cloud acts as it would on a real power-off:
EC2 terminates an instance launched with InstanceInitiatedShutdownBehavior=terminate (and only stops one launched
otherwise); on GCE, the unit the startup script installs runs the program that script installs (taken verbatim from
it) with the Compute API endpoint of the unit's ExecStop line and a stand-in metadata server answering for this
instance (its name, zone, project and a token of its own).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from sshd import PRIVSEP_DIR, answers_at, keygen, sshd_config

PRIVATE_KEY = re.compile(r"-----BEGIN OPENSSH PRIVATE KEY-----\n.*?-----END OPENSSH PRIVATE KEY-----\n", re.DOTALL)
PUBLIC_KEY = re.compile(r"'(ssh-ed25519 [A-Za-z0-9+/=]+ trainpipe-node)'")
SELF_DELETE = re.compile(r"<<'TRAINPIPE_SELF_DELETE'\n(.*?)TRAINPIPE_SELF_DELETE\n", re.DOTALL)
EXEC_STOP_API = re.compile(r"--api (\S+?)'")
BOOT_STATUS = "trainpipe-boot-status"
SSH_USER = "root"  # sshd logs users in as themselves, and this test machine's user is root


@dataclass
class Instance:
    """What the stand-in needs to know of one instance: where it is and what it boots."""

    address: str
    cloud_id: str  # EC2 instance id, or GCE instance name
    zone: str
    boot_script: str


@dataclass
class Node:
    instance: Instance
    root: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def pid_file(self) -> Path:
        return self.root / "sshd.pid"


@dataclass
class Machines:
    """Boots a stand-in for every instance found() lists with an address under prefix; stop() powers all off."""

    root: Path
    prefix: str
    found: Callable[[], list[Instance]]
    power_off: Callable[[Node], str]  # the `shutdown` program's body (shell) for this node
    client_key: Path = field(init=False)
    nodes: dict[str, Node] = field(default_factory=dict)
    booted_at: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.client_key = keygen(self.root / "client_ed25519", "trainpipe-orchestrator")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="cloud-machines", daemon=True)

    def start(self) -> Machines:
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            try:
                for instance in self.found():
                    if instance.address.startswith(self.prefix) and instance.address not in self.nodes:
                        self.nodes[instance.address] = self._boot(instance)
                        self.booted_at[instance.address] = time.monotonic()
            except Exception as exc:  # surfaced by the test through `errors`
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def _boot(self, instance: Instance) -> Node:
        node = Node(instance, self.root / instance.address)
        for sub in ("mnt/trainpipe/trainpipe/data", "mnt/trainpipe/trainpipe/ckpt", "mnt/trainpipe/trainpipe/logs",
                    "run/sshd", "ssh", "bin", "home"):
            (node.root / sub).mkdir(parents=True, exist_ok=True)
        [private] = PRIVATE_KEY.findall(instance.boot_script)
        [public] = PUBLIC_KEY.findall(instance.boot_script)
        host_key = node.root / "ssh" / "ssh_host_ed25519_key"
        host_key.write_text(private)
        host_key.chmod(0o600)
        host_key.with_suffix(".pub").write_text(public + "\n")
        shutdown = node.root / "bin" / "shutdown"
        shutdown.write_text("#!/bin/bash\n" + self.power_off(node) + _KILL_NODE)
        shutdown.chmod(0o755)
        path = ":".join([str(node.root / "bin"), str(Path(sys.executable).parent), "/usr/local/sbin", "/usr/local/bin",
                         "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
        (node.root / "sshd_config").write_text(sshd_config(
            22, host_key, self.client_key.with_suffix(".pub"), node.pid_file, listen=instance.address,
            more=f"SetEnv PATH={path} HOME={node.root / 'home'}{_python_path()}\n"))
        (node.root / "run" / BOOT_STATUS).write_text("0\n")
        PRIVSEP_DIR.mkdir(parents=True, exist_ok=True)
        mount = (f"mount --bind {shlex.quote(str(node.root / 'mnt'))} /mnt && "
                 f"mount --bind {shlex.quote(str(node.root / 'run'))} /run && "
                 f"exec /usr/sbin/sshd -D -e -f {shlex.quote(str(node.root / 'sshd_config'))}")
        with (node.root / "sshd.log").open("ab") as log:
            node.process = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", mount],
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while not answers_at(instance.address, 22):
            if node.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd for {instance.address} did not start: "
                                   f"{(node.root / 'sshd.log').read_text()[-1500:]}")
            time.sleep(0.05)
        return node

    def processes_of(self, address: str) -> list[int]:
        """Every process of a node: everything in its mount namespace."""
        node = self.nodes[address]
        if node.process is None or node.process.poll() is not None:
            return []
        try:
            namespace = os.readlink(f"/proc/{node.process.pid}/ns/mnt")
        except OSError:
            return []
        return [pid for pid in _pids() if _namespace(pid) == namespace]

    def stop(self) -> None:
        """Power every stand-in off (what is left of a test that failed half way)."""
        self._stop.set()
        self._thread.join(timeout=5)
        for node in self.nodes.values():
            for pid in self.processes_of(node.instance.address):
                _kill(pid)
            if node.process is not None:
                node.process.wait(timeout=10)


def _python_path() -> str:
    # The worktree under test first, as for the tests' own processes (sshd passes none of its environment on).
    found = os.environ.get("PYTHONPATH")
    return f" PYTHONPATH={found}" if found else ""


# After the cloud was told: the power goes, for everything on the node (this script included).
_KILL_NODE = """
me=$(readlink /proc/$$/ns/mnt)
# Only ever inside a stand-in's own namespace: in this machine's, it would end everything on it.
[ "$me" = "$(readlink /proc/1/ns/mnt)" ] && { echo "not in a node's namespace: refusing to power off" >&2; exit 1; }
for proc in /proc/[0-9]*; do
  pid=${proc#/proc/}
  [ "$pid" = "$$" ] && continue
  [ "$(readlink "$proc/ns/mnt" 2>/dev/null)" = "$me" ] && kill -KILL "$pid" 2>/dev/null
done
kill -KILL $$
"""


def _pids() -> Iterator[int]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def _namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return


# -- what each cloud does when a node powers off --------------------------------------------------------------------


def ec2_power_off(endpoint: str, region: str, key: str, secret: str) -> Callable[[Node], str]:
    """EC2: InstanceInitiatedShutdownBehavior decides: terminate, or stop (what EC2 does when none was given)."""

    def body(node: Node) -> str:
        program = f"""
import boto3
ec2 = boto3.client("ec2", endpoint_url={endpoint!r}, region_name={region!r}, aws_access_key_id={key!r},
                   aws_secret_access_key={secret!r})
instance = {node.instance.cloud_id!r}
behaviour = ec2.describe_instance_attribute(InstanceId=instance, Attribute="instanceInitiatedShutdownBehavior")
if behaviour["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate":
    ec2.terminate_instances(InstanceIds=[instance])
else:
    ec2.stop_instances(InstanceIds=[instance])
"""
        return f"{shlex.quote(sys.executable)} -c {shlex.quote(program)} >> {node.root}/poweroff.log 2>&1\n"

    return body


def ec2_instances(endpoint: str, region: str, key: str, secret: str) -> Callable[[], list[Instance]]:
    import boto3

    ec2 = boto3.client("ec2", endpoint_url=endpoint, region_name=region, aws_access_key_id=key,
                       aws_secret_access_key=secret)

    def found() -> list[Instance]:
        instances = []
        pages = ec2.get_paginator("describe_instances").paginate(
            Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
        for page in pages:
            for reservation in page["Reservations"]:
                for item in reservation["Instances"]:
                    data = ec2.describe_instance_attribute(InstanceId=item["InstanceId"], Attribute="userData")
                    script = base64.b64decode(data.get("UserData", {}).get("Value", "")).decode()
                    instances.append(Instance(item.get("PublicIpAddress", ""), item["InstanceId"],
                                              item["Placement"]["AvailabilityZone"], script))
        return instances

    return found


class MetadataServer:
    """GCE's metadata server for every stand-in at once: http://127.0.0.1:PORT/<address> is that node's."""

    def __init__(self, project: str, nodes: Callable[[], dict[str, Node]]) -> None:
        self.project = project
        self.tokens: dict[str, str] = {}  # address → the access token its service account got
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                return

            def do_GET(self) -> None:
                address, _, path = self.path.lstrip("/").partition("/")
                node = nodes().get(address)
                answer = None if node is None or self.headers.get("Metadata-Flavor") != "Google" else \
                    server.answer(node, path)
                data = (answer or "").encode()
                self.send_response(200 if answer is not None else 404)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, name="gce-metadata", daemon=True).start()

    def url(self, address: str) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/{address}"

    def answer(self, node: Node, path: str) -> str | None:
        if path == "computeMetadata/v1/instance/service-accounts/default/token":
            token = self.tokens.setdefault(node.instance.address, f"ya29.node-{node.instance.cloud_id}")
            return json.dumps({"access_token": token, "expires_in": 3599, "token_type": "Bearer"})
        return {"computeMetadata/v1/project/project-id": self.project,
                "computeMetadata/v1/instance/zone": f"projects/123456789/zones/{node.instance.zone}",
                "computeMetadata/v1/instance/name": node.instance.cloud_id}.get(path)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def gce_power_off(metadata: MetadataServer) -> Callable[[Node], str]:
    """GCE: the unit the startup script installed runs the program that script installed, as the guest powers off."""

    def body(node: Node) -> str:
        [program] = SELF_DELETE.findall(node.instance.boot_script)
        [api] = EXEC_STOP_API.findall(node.instance.boot_script)
        installed = node.root / "trainpipe-delete-self"
        installed.write_text(program)
        return (f"python3 {installed} --api {shlex.quote(api)} --metadata {metadata.url(node.instance.address)} "
                f">> {node.root}/poweroff.log 2>&1\n")

    return body


def gce_instances(gce: object) -> Callable[[], list[Instance]]:
    def found() -> list[Instance]:
        instances = []
        for item in gce.instances():  # type: ignore[attr-defined]
            if item["status"] != "RUNNING":
                continue
            meta = {entry["key"]: entry["value"] for entry in item["metadata"].get("items", [])}
            address = item["networkInterfaces"][0]["accessConfigs"][0]["natIP"]
            instances.append(Instance(address, item["name"], item["zone"].rsplit("/", 1)[-1],
                                      meta.get("startup-script", "")))
        return instances

    return found


@contextmanager
def machines(root: Path, prefix: str, found: Callable[[], list[Instance]],
             power_off: Callable[[Node], str]) -> Iterator[Machines]:
    stand_ins = Machines(root, prefix, found, power_off).start()
    try:
        yield stand_ins
    finally:
        stand_ins.stop()
