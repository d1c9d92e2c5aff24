"""The job's `cluster.ssh:` section: the machines, how to log in and how their host keys are verified.

Validated with the rest of the job spec, before anything runs: every key file readable, every workdir absolute,
every host key verifiable (pinned or in known_hosts), and at least as many hosts as the cluster has nodes.
"""

from __future__ import annotations

import ipaddress
import re
import socket

from pydantic import Field, field_validator, model_validator

from infra.compute.access.agent_env import DEFAULT_AGENT_DIR, home_or_absolute
from infra.compute.providers.section import ProviderSection
from infra.strict_model import StrictModel, readable_file

SSH_FINGERPRINT = r"^SHA256:[A-Za-z0-9+/]{43}$"
# Networks a cluster's own traffic may bind without the user saying so: RFC 1918, loopback, link-local, CGNAT
# (RFC 6598) and IPv6 unique-local. Anything else may face the internet.
CLUSTER_NETWORKS = tuple(ipaddress.ip_network(net) for net in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "127.0.0.0/8", "169.254.0.0/16", "100.64.0.0/10",
    "::1/128", "fe80::/10", "fc00::/7"))


def public_addresses(address: str) -> list[str]:
    """The addresses `address` stands for (itself, or what the name resolves to here) outside CLUSTER_NETWORKS."""
    try:
        found = [ipaddress.ip_address(address)]
    except ValueError:
        try:
            found = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in socket.getaddrinfo(address, None)]
        except OSError as exc:
            raise ValueError(f"cluster address {address} does not resolve here ({exc.strerror or exc}): set its "
                             "cluster_address to its IP address") from exc
    return sorted({str(ip) for ip in found if not any(ip in net for net in CLUSTER_NETWORKS)})


def _known_hosts_names(host: str, port: int) -> list[str]:
    # How OpenSSH writes a host in known_hosts: bare for port 22, [host]:port otherwise.
    return [host] if port == 22 else [f"[{host}]:{port}"]


class SshHostSpec(StrictModel):
    host: str = Field(min_length=1, description="Address or DNS name of the machine.")
    port: int = Field(22, ge=1, le=65535, description="Its SSH port.")
    user: str = Field(min_length=1, description="User to log in as (key authentication only).")
    key_file: str = Field(description="Private key that logs in as that user (no passphrase; ssh-agent is not used).")
    workdir: str = Field(description="Absolute path on the machine's local NVMe: each cluster gets "
                         "<workdir>/<cluster>/{data,ckpt,logs}; the machine's reservation and its dataset cache "
                         "(<workdir>/dataset-cache, kept across runs) live here.")
    python: str = Field("python3", min_length=1, description="The machine's own Python (CPython >= 3.11): trainpipe "
                        "makes its node agent's environment from it (a venv under agent_dir; nothing is installed into "
                        "this interpreter), and it is the training interpreter when the job names neither "
                        "training.image nor training.python, e.g. /opt/venv/bin/python.")
    agent_dir: str = Field(DEFAULT_AGENT_DIR, min_length=1, description="Where on the machine the node agent's "
                           "environments live, one per content hash, kept across runs (the next run installs "
                           "nothing): an absolute path or one under ~ (the login user's home).")
    host_key: str | None = Field(None, description="Pinned SHA256 fingerprint of the machine's host key "
                                 "(ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub on it); without it the key must "
                                 "be in cluster.ssh.known_hosts.")
    cluster_address: str | None = Field(None, min_length=1, description="The machine's address on the network its "
                                        "peers share (e.g. its private or InfiniBand interface): node-to-node traffic "
                                        "(fan-out staging, peer replicas, torchrun's rendezvous) binds and dials it; "
                                        "default: host. A public one is refused unless "
                                        "cluster.ssh.allow_public_cluster_address is true.")

    @property
    def peer_address(self) -> str:
        """What the other nodes reach this one by."""
        return self.cluster_address or self.host

    @field_validator("key_file")
    @classmethod
    def _key_readable(cls, value: str) -> str:
        return readable_file(value, "key file", "give the path of the private key that logs in to the host "
                              "(ssh-keygen -t ed25519 creates one) and make it readable")

    @field_validator("workdir")
    @classmethod
    def _absolute_workdir(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"workdir '{value}' is not absolute: give the full path of a dir on the host's NVMe")
        return value.rstrip("/") or "/"

    @field_validator("agent_dir")
    @classmethod
    def _agent_dir_shape(cls, value: str) -> str:
        return home_or_absolute(value, "agent_dir", "~/.trainpipe/agent or /opt/trainpipe/agent")

    @field_validator("host_key")
    @classmethod
    def _fingerprint_shape(cls, value: str | None) -> str | None:
        if value is not None and not re.match(SSH_FINGERPRINT, value):
            raise ValueError(f"host_key '{value}' is not a SHA256 fingerprint: copy the 'SHA256:...' part of "
                             "`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` run on the host")
        return value


class SshClusterSpec(ProviderSection):
    hosts: tuple[SshHostSpec, ...] = Field((), description="The machines, in rank order: a cluster of N nodes uses "
                                           "the first N.")
    known_hosts: str | None = Field(None, description="known_hosts file with the hosts' keys (for hosts without "
                                    "host_key); unknown or changed keys are refused, never added.")
    allow_public_cluster_address: bool = Field(False, description="Let node-to-node traffic (the peer servers, "
                                               "torchrun's rendezvous) bind a public cluster address (one outside "
                                               "RFC 1918, loopback, link-local, CGNAT and IPv6 unique-local): only "
                                               "for hosts that share no private network, behind a firewall of yours.")

    @model_validator(mode="before")
    @classmethod
    def _null_is_no_hosts(cls, value: object) -> object:
        # Configs dumped while the section was optional say `ssh: null`.
        return {} if value is None else value

    @field_validator("known_hosts")
    @classmethod
    def _known_hosts_readable(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return readable_file(value, "known_hosts file", "point cluster.ssh.known_hosts at an existing file "
                              "(ssh-keyscan -p PORT HOST >> FILE, after checking the fingerprints)")

    @model_validator(mode="after")
    def _every_host_verifiable(self) -> SshClusterSpec:
        seen: set[tuple[str, int, str]] = set()
        for index, host in enumerate(self.hosts):
            where = f"hosts[{index}] ({host.host}:{host.port})"
            if (host.host, host.port, host.workdir) in seen:
                raise ValueError(f"{where}: listed twice with the same workdir: two nodes would share one dir")
            seen.add((host.host, host.port, host.workdir))
            if host.host_key is None and not self._in_known_hosts(host):
                source = (f"cluster.ssh.known_hosts ({self.known_hosts}) has no entry for it" if self.known_hosts
                          else "cluster.ssh.known_hosts is not set")
                raise ValueError(f"{where}: no way to verify its host key: {source}: set its host_key to the "
                                 "SHA256 fingerprint or add it to known_hosts (ssh-keyscan, after checking the key)")
        return self

    def _in_known_hosts(self, host: SshHostSpec) -> bool:
        if self.known_hosts is None:
            return False
        # Imported here: paramiko is only needed by ssh configs, and spec.py is imported by every command.
        from paramiko.hostkeys import HostKeys

        known = HostKeys(self.known_hosts)
        return any(known.lookup(name) for name in _known_hosts_names(host.host, host.port))

    def check_fits(self, nodes: int) -> None:
        """Raise ValueError naming the fix unless these hosts can hold a cluster of `nodes` nodes."""
        if not self.hosts:
            raise ValueError("provider ssh needs cluster.ssh.hosts: list the machines (host, user, key_file, "
                             "workdir; see examples/ssh.yaml)")
        if len(self.hosts) < nodes:
            raise ValueError(f"cluster.nodes is {nodes} but cluster.ssh.hosts lists {len(self.hosts)}: add hosts "
                             "or lower cluster.nodes")
        if nodes > 1 and not self.allow_public_cluster_address:
            for index, host in enumerate(self.hosts[:nodes]):
                try:
                    public = public_addresses(host.peer_address)
                except ValueError as exc:
                    raise ValueError(f"cluster.ssh.hosts[{index}] ({host.host}): {exc}") from exc
                if public:
                    resolved = "" if public == [host.peer_address] else f" (resolves to {', '.join(public)})"
                    raise ValueError(
                        f"cluster.ssh.hosts[{index}] ({host.host}): cluster address {host.peer_address} is public"
                        f"{resolved}, and the peer servers and torchrun's rendezvous would listen on it: set its "
                        "cluster_address to its private address, or cluster.ssh.allow_public_cluster_address: true")
