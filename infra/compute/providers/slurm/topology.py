"""The site's switch topology (topology/tree), asked when one lost node is replaced alone: the replacement's one-node
job may only land under the leaf switch that holds the survivors, so its traffic to them crosses no more switches
than theirs does.

`scontrol show topology` prints one line per switch (`SwitchName=s1 Level=0 LinkSpeed=1 Nodes=gpu[1-2]`; level 0
switches are the leaves, which name nodes; the upper ones name `Switches=`). A site without a topology plugin prints
nothing, or fails saying it has no topology: then there is no switch to keep to.

Slurm's `--switches=count[@max-wait]` only bounds how many leaf switches a job's own nodes span: it cannot name a
switch, and a one-node job always spans one. Excluding every node of the partition that is not under the chosen leaf
switch is what pins the replacement to it.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from infra.compute.providers.base import ReplacementUnavailable
from infra.compute.providers.slurm import cli
from infra.compute.providers.slurm.login import Login

_FIELD = re.compile(r"(\w+)=(\S*)")


def leaf_node_lists(out: str) -> dict[str, str]:
    """Each leaf switch's node list (a Slurm hostlist expression, not yet expanded), from `scontrol show topology`."""
    leaves = {}
    for line in out.splitlines():
        fields = dict(_FIELD.findall(line))
        if "SwitchName" in fields and fields.get("Level") == "0" and fields.get("Nodes"):
            leaves[fields["SwitchName"]] = fields["Nodes"]
    return leaves


def leaf_switches(login: Login) -> dict[str, frozenset[str]]:
    """The site's leaf switches and the hosts under each; empty where the site has no topology."""
    done = cli.run(login, ["scontrol", "show", "topology"], check=False)
    said = f"{done.stdout}\n{done.stderr}"
    if done.returncode != 0:
        if "topology" in said.lower():  # "No topology information available" and kin: no topology plugin
            return {}
        raise cli.error_of(["scontrol", "show", "topology"], said.strip())
    return {switch: frozenset(cli.hostnames(login, nodes)) for switch, nodes in leaf_node_lists(done.stdout).items()}


def partition_hosts(login: Login, partition: str) -> list[str]:
    """Every node of the partition, whatever its state."""
    out = cli.run(login, ["sinfo", "-h", "-N", "-p", partition, "-o", "%N"]).stdout
    return sorted({line.strip() for line in out.splitlines() if line.strip()})


def survivors_switch(leaves: Mapping[str, frozenset[str]], survivors: Sequence[str]) -> str | None:
    """The leaf switch holding most of the survivors, the first survivor's (the head's) on a tie; None when no
    leaf switch holds any of them."""
    held = Counter(switch for host in survivors for switch, hosts in leaves.items() if host in hosts)
    if not held:
        return None
    most = max(held.values())
    head_switches = [switch for switch, hosts in leaves.items() if survivors[0] in hosts and held[switch] == most]
    return head_switches[0] if head_switches else min(switch for switch, count in held.items() if count == most)


def replacement_excludes(leaves: Mapping[str, frozenset[str]], partition: Iterable[str], survivors: Sequence[str],
                         lost_host: str) -> tuple[str | None, list[str]]:
    """The switch a replacement for lost_host must land under and the hosts to --exclude for it: the lost host, the
    survivors' hosts (on a site that shares nodes, exclusive: false, Slurm would place it beside a survivor, in its
    workdir) and every partition node not under that switch. No topology (or survivors under none of its switches):
    no switch, the lost host and the survivors'. ReplacementUnavailable, naming the switch, when no node under it can
    be free (every one is the allocation's or lost)."""
    switch = survivors_switch(leaves, survivors)
    taken = set(survivors) - {lost_host}
    if switch is None:
        return None, [lost_host, *sorted(taken)]
    under = leaves[switch]
    if not under - {*survivors, lost_host}:
        raise ReplacementUnavailable(f"switch {switch} (the survivors' leaf switch) has no node for the replacement "
                                     f"of {lost_host}: {', '.join(sorted(under))} are the allocation's or lost")
    return switch, [lost_host, *sorted((set(partition) - under | taken) - {lost_host})]
