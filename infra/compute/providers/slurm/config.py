"""The job's `cluster.slurm:` section: which allocation to ask the site's Slurm for, and where on a node to work.

Validated with the rest of the job spec, before anything is submitted: names are Slurm's own shapes, the scratch
path is absolute with at most a `{node}` in it, the time limit is one of sbatch's formats, and extra sbatch options
never set what trainpipe owns (the job's name and comment, its node count, signal, requeue policy, output and the
options this section has a field for).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from infra.compute.access.agent_env import home_or_absolute
from infra.compute.providers.section import ProviderSection
from infra.compute.providers.ssh.config import SSH_FINGERPRINT
from infra.strict_model import readable_file

NAME = r"^[A-Za-z0-9_.+-]+$"  # a partition, account, QOS or reservation name
CONSTRAINT = r"^[A-Za-z0-9_.&|,*:\[\]()!-]+$"  # features joined by sbatch's operators (&, |, [a|b], a*2)
# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
TIME_LIMIT = r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$"
NODE_PLACEHOLDER = "{node}"
LOGIN = r"^[A-Za-z0-9_.-]+@[A-Za-z0-9_.-]+(:\d{1,5})?$"  # user@host[:port]

# sbatch options trainpipe sets itself (or that would break the allocation it holds), long form first; each value is
# what to use instead. An extra option is refused when its name is one of these, or an unambiguous prefix sbatch
# would accept for one (sbatch takes --part for --partition).
OWNED_OPTIONS: dict[str, str] = {
    "--nodes": "cluster.nodes",
    "--job-name": "trainpipe names the job after the cluster (the sweeper finds it by that name)",
    "--comment": "trainpipe tags the job with its run in the comment",
    "--signal": "cluster.slurm.signal_lead_s",
    "--no-kill": "trainpipe keeps the allocation when a node fails, and replaces that node alone",
    "--requeue": "trainpipe relaunches a preempted allocation itself (--no-requeue)",
    "--no-requeue": "trainpipe relaunches a preempted allocation itself (--no-requeue)",
    "--partition": "cluster.slurm.partition",
    "--account": "cluster.slurm.account",
    "--qos": "cluster.slurm.qos",
    "--reservation": "cluster.slurm.reservation",
    "--constraint": "cluster.slurm.constraint",
    "--gres": "cluster.slurm.gpus_per_node",
    "--gpus-per-node": "cluster.slurm.gpus_per_node",
    "--gpus": "cluster.slurm.gpus_per_node",
    "--exclusive": "cluster.slurm.exclusive",
    "--time": "cluster.slurm.time_limit",
    "--output": "trainpipe keeps the holder's log in the head node's workdir",
    "--error": "trainpipe keeps the holder's log in the head node's workdir",
    "--ntasks": "trainpipe runs one job step per node agent",
    "--ntasks-per-node": "trainpipe runs one job step per node agent",
    "--array": "one allocation is one cluster",
    "--wrap": "trainpipe submits its own holder script",
    "--hold": "a held allocation never starts: the run would wait out queue_timeout_s",
    "--parsable": "trainpipe reads sbatch's answer itself",
    "--wait": "trainpipe waits for the allocation itself, with cluster.slurm.queue_timeout_s",
    "--test-only": "trainpipe needs a real allocation",
    "--export": "trainpipe passes each job step its environment itself",
    "--chdir": "every job step runs in its node's workdir",
}


def _owned(name: str) -> str | None:
    if name in OWNED_OPTIONS:
        return name
    matches = [owned for owned in OWNED_OPTIONS if owned.startswith(name) and len(name) > 3]
    return matches[0] if matches else None


class SlurmClusterSpec(ProviderSection):
    """provider slurm: one allocation (an sbatch job holding cluster.nodes nodes) is the cluster; every node agent
    runs in it as a job step (srun --overlap). sbatch, srun, squeue, scontrol and scancel run on this machine, which
    must then be a login node of the site (SLURM_CONF, when set, names its configuration), or over SSH on the login
    node `login` names."""

    partition: str | None = Field(None, pattern=NAME, description="Partition to submit to (sbatch --partition); "
                                  "none: the site's default.")
    account: str | None = Field(None, pattern=NAME, description="Account charged (sbatch --account).")
    qos: str | None = Field(None, pattern=NAME, description="Quality of service (sbatch --qos).")
    reservation: str | None = Field(None, pattern=NAME, description="Advance reservation to run in "
                                    "(sbatch --reservation).")
    constraint: str | None = Field(None, pattern=CONSTRAINT, description="Node features the nodes must have, with "
                                   "sbatch's operators (sbatch --constraint), e.g. ib&nvme.")
    gpus_per_node: int | None = Field(None, ge=1, le=64, description="GPUs each node must give the job, asked for "
                                      "as GRES (sbatch --gres=gpu:N); none asks for no GRES.")
    exclusive: bool = Field(True, description="Whole nodes only (sbatch --exclusive): no other job shares them.")
    time_limit: str = Field("24:00:00", pattern=TIME_LIMIT, description="Walltime of the allocation (sbatch "
                            "--time), so it never outlives a run that lost its orchestrator: minutes, HH:MM:SS or "
                            "D-HH:MM:SS.")
    signal_lead_s: int = Field(120, ge=10, le=65535, description="Seconds before the allocation ends (walltime, "
                               "or preemption where the site sends the signal early) that its holder gets USR1 "
                               "(sbatch --signal=B:USR1@N) and raises every node's preemption notice.")
    scratch: str = Field("/tmp/trainpipe/{node}", description="Node-local dir to stage into and checkpoint to "
                         "(absolute, no comma; `{node}` becomes the Slurm node name, needed where several nodes "
                         "share a host): each cluster gets <scratch>/<cluster>/{data,ckpt,logs}.")
    python: str = Field("python3", min_length=1, description="The nodes' Python (CPython >= 3.11 with venv): it "
                        "makes the node agent's own environment (nothing is installed into it) and is the training's "
                        "interpreter when the job names neither training.image nor training.python (it then needs "
                        "torch).")
    agent_dir: str = Field("/tmp/trainpipe/agent", description="Node-local dir (absolute, `{node}` allowed) where "
                           "each node keeps the agent's environments by content (made once, found ready by the next "
                           "run); off the shared filesystem, like SkyPilot's runtime.")
    agent_bundle_dir: str = Field("~/.cache/trainpipe/agent-bundles", description="Dir the login node and the "
                                  "nodes share (the same path on both; ~ is the user's home, shared on most sites): "
                                  "the login node puts the agent's wheels there once, and each node installs from "
                                  "it, asking no package index.")
    containers: Literal["pyxis", "oci"] | None = Field(None, description="How a job's training.image runs on "
                                                       "the nodes: pyxis (srun --container-image, where the site "
                                                       "has Pyxis and enroot) or oci (Slurm's own OCI containers: "
                                                       "oci.conf with runc; training.image is then an OCI bundle "
                                                       "dir on the nodes); none: the job names no image.")
    queue_timeout_s: float = Field(1800.0, gt=0, description="How long the allocation may stay pending (its "
                                   "reason is logged as it changes) before the launch gives up and cancels it.")
    sbatch_options: tuple[str, ...] = Field((), description="Further sbatch options, each one long option with its "
                                            "value (e.g. --mail-type=END); those trainpipe sets are refused.")
    price_per_gpu_hour: float = Field(0.0, ge=0, description="What the site charges per GPU-hour, USD, for the run's "
                                      "cost (0: already paid for).")
    login: str | None = Field(None, pattern=LOGIN, description="user@host or user@host:port of a login node of the "
                              "site: every sinfo, sbatch, srun, squeue, scontrol and scancel runs there over SSH; "
                              "none: this machine is a login node.")
    login_key_file: str | None = Field(None, description="Private key that logs in to the login node (no "
                                       "passphrase; ssh-agent is not used).")
    login_host_key: str | None = Field(None, pattern=SSH_FINGERPRINT, description="Pinned SHA256 fingerprint of "
                                       "the login node's host key; without it the key must be in login_known_hosts.")
    login_known_hosts: str | None = Field(None, description="known_hosts file with the login node's host key; an "
                                          "unknown or changed key is refused, never added.")

    @field_validator("scratch")
    @classmethod
    def _scratch_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"scratch '{value}' is not absolute: give the full path of a node-local dir "
                             "(e.g. /tmp/trainpipe/{node} or /mnt/local/{node})")
        if "," in value:
            raise ValueError(f"scratch '{value}' has a comma: the node's workdir is passed to its job steps in srun's "
                             "--export list, which a comma would split: choose a path without one")
        others = set(re.findall(r"\{[^}]*\}", value)) - {NODE_PLACEHOLDER}
        if others or value.replace(NODE_PLACEHOLDER, "").count("{") or value.replace(NODE_PLACEHOLDER, "").count("}"):
            raise ValueError(f"scratch '{value}': the only placeholder it may hold is {NODE_PLACEHOLDER} (the Slurm "
                             "node name)")
        return value.rstrip("/") or "/"

    @field_validator("agent_dir")
    @classmethod
    def _agent_dir_path(cls, value: str) -> str:
        if not value.startswith("/") or set(re.findall(r"\{[^}]*\}", value)) - {NODE_PLACEHOLDER}:
            raise ValueError(f"agent_dir '{value}': give an absolute node-local path, with at most {NODE_PLACEHOLDER} "
                             "in it (e.g. /tmp/trainpipe/agent)")
        return value.rstrip("/") or "/"

    @field_validator("agent_bundle_dir")
    @classmethod
    def _bundle_dir_path(cls, value: str) -> str:
        return home_or_absolute(value, "agent_bundle_dir", "~/.cache/trainpipe/agent-bundles (a path the login node "
                                "and the nodes share)")

    @field_validator("sbatch_options")
    @classmethod
    def _not_owned(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for option in value:
            if not re.match(r"^--[a-z][a-z0-9-]*(=.*)?$", option):
                raise ValueError(f"sbatch option '{option}': give each option in its long form with its value "
                                 "(--name=value), one per entry")
            owned = _owned(option.split("=", 1)[0])
            if owned is not None:
                raise ValueError(f"sbatch option '{option}': trainpipe sets {owned} itself: {OWNED_OPTIONS[owned]}")
        return value

    @field_validator("login_key_file", "login_known_hosts")
    @classmethod
    def _login_file_readable(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return readable_file(value, "login file", "give the path of an existing, readable file (the private key "
                             "that logs in to the login node, or a known_hosts file with its host key)")

    @model_validator(mode="after")
    def _login_complete(self) -> SlurmClusterSpec:
        ssh_fields = [name for name in ("login_key_file", "login_host_key", "login_known_hosts")
                      if getattr(self, name) is not None]
        if self.login is None:
            if ssh_fields:
                raise ValueError(f"{', '.join(ssh_fields)} set without cluster.slurm.login: name the login node "
                                 "(user@host) or drop them")
            return self
        if self.login_key_file is None:
            raise ValueError(f"cluster.slurm.login {self.login}: set login_key_file (the private key that logs in)")
        if self.login_host_key is None and self.login_known_hosts is None:
            raise ValueError(f"cluster.slurm.login {self.login}: its host key cannot be verified: set "
                             "login_host_key (SHA256:...) or login_known_hosts")
        return self

    def node_agent_dir(self, node: str) -> str:
        """Where node keeps the agent's environments."""
        return self.agent_dir.replace(NODE_PLACEHOLDER, node)

    def node_workdir(self, node: str, cluster_name: str) -> str:
        """Where a node of this cluster works: <scratch with {node}>/<cluster>."""
        return f"{self.scratch.replace(NODE_PLACEHOLDER, node).rstrip('/')}/{cluster_name}"

