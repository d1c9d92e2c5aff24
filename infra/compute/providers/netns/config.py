"""The job's `cluster.netns:` section: how the emulated links between the namespaces are shaped."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from infra.compute.providers.section import ProviderSection


class NetnsClusterSpec(ProviderSection):
    """provider netns: an emulated multi-host cluster on this Linux machine (root), one network namespace a node."""

    link_mbit: float | None = Field(None, gt=0, description="Shape every node's link (both directions) to this many "
                                    "Mbit/s with tc tbf; none leaves the links unshaped.")
    relaunch: Literal["same-machines", "new-machines"] = Field(
        "same-machines", description="What a recovery's whole relaunch gets: the same machines again (each node's "
        "data dir and dataset cache kept, as local and ssh nodes do), or new machines, empty, as a cloud's new "
        "instances are (what `trainpipe bench staging` compares replace-one against).")
