"""What the site has, asked at plan: an allocation that can never start is refused before anything is submitted.

`sinfo -N` lists every node of every partition with its features and GRES. The cluster's partition (or the site's
default) must exist and hold cluster.nodes nodes that have every feature of the constraint and gpus_per_node GPUs
(GRES gpu). A constraint with operators other than AND (`&`, `,`) is left to sbatch. Nodes count whatever their
state now: a node down for maintenance comes back, and the wait for it is bounded by queue_timeout_s.

An account is checked where the site checks accounts: with slurmdbd (AccountingStorageType accounting_storage/slurmdbd)
enforcing associations (AccountingStorageEnforce), the account must be one of the user's associations on this cluster
(sacctmgr; one slurmdbd often serves several clusters, and an association on another is refused here by sbatch as an
invalid account); elsewhere Slurm takes any account name (sbatch accepts --account=anything) and there is nothing to
refuse.
"""

from __future__ import annotations

import getpass
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


def parse_config(text: str) -> dict[str, str]:
    """`scontrol show config`'s `Key = Value` lines."""
    pairs = (line.split("=", 1) for line in text.splitlines() if " = " in line)
    return {key.strip(): value.strip() for key, value in pairs}


def site_config(login: Login) -> dict[str, str]:
    """The site's slurmctld configuration, as `scontrol show config` prints it."""
    return parse_config(cli.run(login, ["scontrol", "show", "config"]).stdout)


def signals_preemption_early(config: dict[str, str]) -> bool:
    """Whether slurmctld sends a preempted job its --signal when the preemption starts (preempt_send_user_signal);
    without it the job hears nothing before the SIGTERM at the end of the grace time."""
    return "preempt_send_user_signal" in [flag.strip() for flag in config.get("SlurmctldParameters", "").split(",")]


def enforces_associations(config: dict[str, str]) -> bool:
    """Whether the site refuses a job whose account is not one of the user's associations (slurmdbd enforcing them)."""
    enforced = [flag.strip() for flag in config.get("AccountingStorageEnforce", "").lower().split(",")]
    return config.get("AccountingStorageType", "").endswith("slurmdbd") and "associations" in enforced


def accounts_of(associations: str, user: str) -> set[str]:
    """The accounts `sacctmgr -nP show associations ... format=account,user` lists for user."""
    rows = (line.split("|") for line in associations.splitlines())
    return {row[0] for row in rows if len(row) == 2 and row[1] == user and row[0]}


def check_account(login: Login, account: str) -> None:
    """SiteMismatch when the site enforces associations and the account is not one of the user's."""
    config = site_config(login)
    if not enforces_associations(config):
        return  # the site takes any account name: nothing to refuse
    user = login.endpoint.user if login.remote else getpass.getuser()
    # This cluster's associations only: ClusterName is what slurmctld checks the job's account against.
    where = [f"users={user}", *([f"clusters={config['ClusterName']}"] if config.get("ClusterName") else [])]
    listed = cli.run(login, ["sacctmgr", "-nP", "show", "associations", "where", *where, "format=account,user"]).stdout
    accounts = accounts_of(listed, user)
    if account not in accounts:
        raise SiteMismatch(f"cluster.slurm.account '{account}': {user} has no such account at the site: use one of "
                           f"{', '.join(sorted(accounts)) or '(none)'} (sacctmgr show associations where "
                           f"{' '.join(where)})")


def check_site(config: SlurmClusterSpec, nodes: int) -> None:
    """Raise SiteMismatch naming the partition and what it has unless it can hold `nodes` nodes as asked, or naming
    the account when the site refuses it."""
    login = login_of(config)
    try:
        listed = site_nodes(login)
        if config.account:
            check_account(login, config.account)
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
