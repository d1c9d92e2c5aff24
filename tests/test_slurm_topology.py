"""The survivors' leaf switch for a lone node's replacement (infra/compute/providers/slurm/topology.py): parsing
`scontrol show topology`, the switch chosen and the hosts excluded. No Slurm needed: the login answers as a site
would (the real site's answers are checked in test_slurm_provider.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from infra.compute.providers import ReplacementUnavailable
from infra.compute.providers.slurm import topology
from infra.compute.providers.slurm.cli import SlurmError
from infra.compute.providers.slurm.login import Result

# What scontrol 22.05 prints on a topology/tree site: leaves (level 0) name nodes, upper switches name switches.
TREE = """\
SwitchName=s1 Level=0 LinkSpeed=1 Nodes=gpu[1-2]
SwitchName=s2 Level=0 LinkSpeed=1 Nodes=gpu[3-4],cpu7
SwitchName=top Level=1 LinkSpeed=1 Switches=s[1-2]
"""
HOSTNAMES = {"gpu[1-2]": "gpu1\ngpu2\n", "gpu[3-4],cpu7": "gpu3\ngpu4\ncpu7\n"}


class SiteLogin:
    """A login node whose Slurm commands answer with canned output."""

    label = "a canned site"

    def __init__(self, topology_result: Result) -> None:
        self.topology_result = topology_result

    def run(self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str], stdin: str | None = None) -> Result:
        if list(argv[:3]) == ["scontrol", "show", "topology"]:
            return self.topology_result
        if list(argv[:3]) == ["scontrol", "show", "hostnames"]:
            return Result(0, HOSTNAMES[argv[3]], "")
        raise AssertionError(f"unexpected command {argv}")


def test_leaf_switches_are_the_level_0_lines_node_lists_expanded_by_slurm() -> None:
    assert topology.leaf_node_lists(TREE) == {"s1": "gpu[1-2]", "s2": "gpu[3-4],cpu7"}
    login = SiteLogin(Result(0, TREE, ""))
    assert topology.leaf_switches(login) == {"s1": frozenset({"gpu1", "gpu2"}),  # type: ignore[arg-type]
                                             "s2": frozenset({"gpu3", "gpu4", "cpu7"})}


@pytest.mark.parametrize("answer", [Result(0, "", "scontrol: error: No topology information available\n"),  # 22.05
                                    Result(1, "", "slurm_load_topo error: No topology information available"),
                                    Result(0, "", "")])
def test_a_site_without_topology_has_no_switches(answer: Result) -> None:
    assert topology.leaf_switches(SiteLogin(answer)) == {}  # type: ignore[arg-type]


def test_a_failing_topology_query_is_an_error_not_no_topology() -> None:
    with pytest.raises(SlurmError, match="Unable to contact slurm controller"):
        topology.leaf_switches(SiteLogin(Result(1, "", "Unable to contact slurm controller (connect failure)")))  # type: ignore[arg-type]


LEAVES = {"s1": frozenset({"gpu1", "gpu2"}), "s2": frozenset({"gpu3", "gpu4", "gpu5"}), "s3": frozenset({"gpu6"})}
PARTITION = ["gpu1", "gpu2", "gpu3", "gpu4", "gpu5", "gpu6"]


def test_the_replacement_is_pinned_to_the_survivors_switch_by_excluding_every_other_node() -> None:
    # every node off the switch, and the survivors' own: the replacement never shares a survivor's host
    assert topology.replacement_excludes(LEAVES, PARTITION, ["gpu3", "gpu4"], "gpu1") == (
        "s2", ["gpu1", "gpu2", "gpu3", "gpu4", "gpu6"])
    # the lost host is excluded even when it stood under the chosen switch, and listed once
    assert topology.replacement_excludes(LEAVES, PARTITION, ["gpu3"], "gpu4") == ("s2", ["gpu4", "gpu1", "gpu2",
                                                                                         "gpu3", "gpu6"])


def test_survivors_on_several_switches_keep_to_the_one_holding_most_the_heads_on_a_tie() -> None:
    assert topology.survivors_switch(LEAVES, ["gpu1", "gpu3", "gpu4"]) == "s2"  # most, though not the head's
    assert topology.survivors_switch(LEAVES, ["gpu3", "gpu1"]) == "s2"  # a tie: the head's
    assert topology.survivors_switch(LEAVES, ["gpu1", "gpu3"]) == "s1"


def test_no_free_node_under_the_switch_is_unavailable_at_once_naming_it() -> None:
    with pytest.raises(ReplacementUnavailable, match=r"switch s1 .* no node for the replacement of gpu2"):
        topology.replacement_excludes(LEAVES, PARTITION, ["gpu1"], "gpu2")
    with pytest.raises(ReplacementUnavailable, match="switch s3"):
        topology.replacement_excludes(LEAVES, PARTITION, ["gpu6", "gpu1"], "gpu2")


def test_without_topology_or_a_survivor_under_a_switch_the_lost_host_and_the_survivors_are_excluded() -> None:
    """Before, only the lost host: on a site sharing nodes (exclusive: false) the replacement could land on a
    survivor's host and share its workdir."""
    assert topology.replacement_excludes({}, [], ["gpu1", "gpu2"], "gpu3") == (None, ["gpu3", "gpu1", "gpu2"])
    assert topology.replacement_excludes(LEAVES, PARTITION, ["gpu9"], "gpu3") == (None, ["gpu3", "gpu9"])
