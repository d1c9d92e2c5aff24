"""What the site has, asked at plan: an allocation that can never start is refused before anything is submitted.

`sinfo -N` lists every node of every partition with its features and GRES. The cluster's partition (or the site's
default) must exist and hold cluster.nodes nodes that have every feature of the constraint and gpus_per_node GPUs
(GRES gpu). A constraint with operators other than AND (`&`, `,`) is left to sbatch. Nodes count whatever their
state now: a node down for maintenance comes back, and the wait for it is bounded by queue_timeout_s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from infra.compute.providers.base import LaunchError
from infra.compute.providers.slurm import cli
from infra.compute.providers.slurm.config import SlurmClusterSpec
from infra.compute.providers.slurm.login import Login, login_of

_PLAIN_FEATURES = re.compile(r"^[A-Za-z0-9_.:-]+([&,][A-Za-z0-9_.:-]+)*$")


class SiteMismatch(ValueError):
    """The site cannot hold the cluster as asked: the message names the partition and what it has."""


@dataclass(frozen=True)
class SiteNode:
    name: str
    partition: str  # without the default's '*'
    default: bool
    features: frozenset[str]
    gpus: int


def gpu_count(gres: str) -> int:
    """GPUs in sinfo's GRES field: gpu:2, gpu:h100:8(S:0-1), several entries comma separated, (null) for none."""
    total = 0
    for entry in re.split(r",(?![^()]*\))", gres):
        parts = re.sub(r"\(.*\)$", "", entry.strip()).split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def site_nodes(login: Login) -> list[SiteNode]:
    if not cli.configured(login):
        raise SiteMismatch("provider slurm: no Slurm configuration here (squeue on PATH and SLURM_CONF or "
                           "/etc/slurm/slurm.conf): plan and run on a login node of the site")
    out = cli.run(login, ["sinfo", "-h", "-N", "-o", "%N|%P|%f|%G"]).stdout
    nodes = []
    for line in out.splitlines():
        fields = line.split("|")
        if len(fields) != 4:
            continue
        name, partition, features, gres = fields
        nodes.append(SiteNode(name=name, partition=partition.rstrip("*"), default=partition.endswith("*"),
                              features=frozenset(f for f in features.split(",") if f and f != "(null)"),
                              gpus=gpu_count(gres)))
    return nodes


def check_site(config: SlurmClusterSpec, nodes: int) -> None:
    """Raise SiteMismatch naming the partition and what it has unless it can hold `nodes` nodes as asked."""
    try:
        listed = site_nodes(login_of(config))
    except LaunchError as exc:
        raise SiteMismatch(f"provider slurm: cannot ask the site what it has: {exc}") from None
    partitions = sorted({node.partition for node in listed})
    default = next((node.partition for node in listed if node.default), None)
    partition = config.partition or default
    if partition is None:
        raise SiteMismatch(f"cluster.slurm.partition is not set and the site has no default partition: use one of "
                           f"{', '.join(partitions) or '(none)'}")
    if partition not in partitions:
        raise SiteMismatch(f"cluster.slurm.partition '{partition}': the site has no such partition: use one of "
                           f"{', '.join(partitions) or '(none)'}")
    members = [node for node in listed if node.partition == partition]
    wanted = []
    if config.constraint and _PLAIN_FEATURES.match(config.constraint):
        features = set(re.split(r"[&,]", config.constraint))
        members = [node for node in members if features <= node.features]
        wanted.append(f"features {config.constraint}")
    if config.gpus_per_node:
        members = [node for node in members if node.gpus >= config.gpus_per_node]
        wanted.append(f"{config.gpus_per_node} GPUs (GRES gpu)")
    if len(members) < nodes:
        offered = sorted({f for node in listed if node.partition == partition for f in node.features})
        total = sum(node.partition == partition for node in listed)
        what = f" with {' and '.join(wanted)}" if wanted else ""
        raise SiteMismatch(f"cluster.nodes is {nodes} but partition {partition} has {len(members)} nodes{what} "
                           f"({total} nodes in all, features {', '.join(offered) or 'none'}): lower cluster.nodes "
                           "or change cluster.slurm (partition, constraint, gpus_per_node)")
