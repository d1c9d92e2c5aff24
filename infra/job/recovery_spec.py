"""What a job does when nodes are taken away: the recovery policy, and the preemptions a test injects on purpose."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from infra.strict_model import StrictModel


class RecoverySpec(StrictModel):
    max_recoveries: int = Field(3, ge=0, le=100, description="Re-provisions after preemptions before the run fails.")
    deadline_s: float = Field(24 * 3600.0, gt=0, description="The run fails when this many seconds have passed "
                              "since it started, however many recoveries are left.")
    failover: Literal["same_zone_first", "eager_next_region"] = Field(
        "same_zone_first", description="same_zone_first: retry where the preempted cluster ran, then move on; "
        "eager_next_region: block the preempted region for the next attempt at once.")
    replace: Literal["nodes", "cluster"] = Field(
        "nodes", description="nodes: replace only the lost nodes in the cluster's own placement (survivors keep their "
        "staged data, code and local checkpoints), and relaunch the whole cluster only when that placement cannot "
        "take a new node; cluster: relaunch the whole cluster after every preemption.")
    confirm_s: float = Field(5.0, ge=0, le=300, description="A node that vanishes without notice counts as "
                             "preempted after it stays gone this long.")
    control_plane_outage_s: float = Field(
        600.0, ge=0, le=86400, description="During training, a provider's control plane that does not answer the "
        "liveness and notice calls (an error, a throttle, a timeout) is unknown, not dead: training goes on while the "
        "nodes' own signals (trainers running, their output read) say so, for up to this long; past it the run "
        "stops, naming the control plane. 0: the first unanswered call stops it.")


class PreemptSpec(StrictModel):
    node: int = Field(ge=0, description="Rank of the node to preempt.")
    attempt: int = Field(0, ge=0, description="Which attempt of the run it hits: 0 is the first, 1 the first "
                         "recovery, and so on.")
    at_step: int | None = Field(None, ge=1, description="Preempt once training has reached this step ...")
    after_s: float | None = Field(None, ge=0, description="... or this many seconds after training started.")
    notice_s: float = Field(0.0, ge=0, le=600, description="Seconds of notice before the node goes away (a spot "
                            "notice); 0 kills it without notice.")

    @model_validator(mode="after")
    def _one_trigger(self) -> PreemptSpec:
        if (self.at_step is None) == (self.after_s is None):
            raise ValueError("give exactly one of at_step and after_s: when the preemption happens")
        return self


class ChaosSpec(StrictModel):
    """Preemptions injected on the local and ssh providers, so the whole recovery path runs without a cloud."""

    preempt: tuple[PreemptSpec, ...] = Field((), description="Preemptions to inject, each on one node.")
