"""Bookkeeping for recoveries from preemption: when to give up, where to go next, and what each one cost.

For each recovery the run summary gets: the nodes and reason, the path it took (only the lost nodes replaced, or
the whole cluster relaunched, and why a replacement fell back), the step training had reached and the committed
step it resumed from (steps_lost is the work redone), and the time from the detection to training resumed,
split into teardown, provision, verify, stage and restore (a replacement has no teardown; its provision is the
provider's replace_nodes), with the extra cost of that time at the cluster's price.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any

from infra.compute.catalog import Catalog
from infra.compute.optimizer import NoCandidateError, candidates
from infra.compute.spec import ClusterSpec
from infra.job.recovery_spec import RecoverySpec
from infra.job.summary import timed_into

RECOVERY_PHASES = ("teardown", "provision", "verify", "stage", "restore")
REPLACED = "replaced-nodes"  # only the lost nodes replaced, the survivors kept
RELAUNCHED = "relaunched-cluster"  # the whole cluster torn down and launched again
RESTARTED = "restarted-in-place"  # nothing lost (a hang): the same nodes train again from the commit


class RecoveryExhausted(RuntimeError):
    """No recovery left (max_recoveries or the deadline): the run fails, its commits stay for a later rerun."""


@dataclass
class RecoveryRecord:
    number: int
    node: str
    reason: str
    with_notice: bool
    step_reached: int
    detected_at: float
    resumed_from_step: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # per RECOVERY_PHASES
    reused_bytes: int = 0  # staged data the relaunched nodes still had (same machines): not downloaded again
    # the resume's checkpoint bytes, every node's, by where they came from: store, peer, local, replica
    restore_bytes: dict[str, int] = field(default_factory=dict)
    notice_to_resume_s: float | None = None
    steps_lost: int | None = None
    extra_cost_usd: float | None = None
    time_to_first_step_s: float | None = None  # from detection to the end of the first step trained after it
    nodes: list[str] = field(default_factory=list)  # every node lost (node is the first, the one that decided it)
    path: str = RELAUNCHED  # REPLACED or RELAUNCHED
    replaced: list[str] = field(default_factory=list)  # the nodes replaced on their own (path REPLACED)
    fallback: str | None = None  # why the lost nodes could not be replaced alone (ReplacementUnavailable)
    hung: bool = False  # training hung (infra/lifecycle/hang.py): the nodes are the ones stopped, none lost

    def replaced_nodes(self, names: Sequence[str]) -> None:
        self.path, self.replaced = REPLACED, list(names)

    def restarted_in_place(self) -> None:
        self.path = RESTARTED

    def fell_back(self, why: str) -> None:
        self.path, self.fallback = RELAUNCHED, why

    def phase(self, name: str) -> AbstractContextManager[None]:
        return timed_into(self.seconds, name)

    def resumed(self, step: int | None, price_per_hour: float) -> None:
        """Training restarts now, from the committed step `step` (None: from scratch)."""
        self.resumed_from_step = step
        self.notice_to_resume_s = round(time.time() - self.detected_at, 3)
        # The step training restarts at is step + 1; everything after the commit up to step_reached is redone.
        self.steps_lost = max(0, self.step_reached - (step or 0))
        self.extra_cost_usd = round(price_per_hour * self.notice_to_resume_s / 3600, 4)

    def first_step(self, at: float | None) -> None:
        """The relaunched training's first step ended at `at` (unix time)."""
        if at is not None:
            self.time_to_first_step_s = round(at - self.detected_at, 3)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Recoveries:
    def __init__(self, policy: RecoverySpec) -> None:
        self.policy = policy
        self.started = time.monotonic()
        self.records: list[RecoveryRecord] = []
        self.blocked: list[tuple[str, str | None]] = []  # (region, zone or None for the whole region)
        self._preempted_in: list[tuple[str, str | None]] = []

    def begin(self, nodes: Sequence[str], reason: str, with_notice: bool, step_reached: int,
              detected_at: float, hung: bool = False) -> RecoveryRecord:
        """A new recovery, or RecoveryExhausted naming why not. hung: training hung (nothing lost); a second hang
        at the same step is not recovered, since restarting from the same commit would hang there again."""
        what = f"training {reason}" if hung else f"{', '.join(nodes)} preempted ({reason})"
        if hung and any(r.hung and r.step_reached == step_reached for r in self.records):
            raise RecoveryExhausted(f"{what}, the second time at step {step_reached}: the script hangs there; its "
                                    "ranks' stacks are in the run folder (stacks/)")
        if len(self.records) >= self.policy.max_recoveries:
            raise RecoveryExhausted(f"{what} after {len(self.records)} recoveries: "
                                    "recovery.max_recoveries is spent: raise it or rerun with the same run id")
        elapsed = time.monotonic() - self.started
        if elapsed >= self.policy.deadline_s:
            raise RecoveryExhausted(f"{what} {elapsed:.0f}s into the run, past "
                                    "recovery.deadline_s: raise it or rerun with the same run id")
        record = RecoveryRecord(len(self.records) + 1, nodes[0], reason, with_notice, step_reached, detected_at,
                                nodes=list(nodes), hung=hung)
        self.records.append(record)
        return record

    def block(self, region: str | None, zone: str | None) -> None:
        """Learn from where the preempted cluster ran: eager_next_region leaves its region at once; same_zone_first
        tries the same zone once more and leaves the zone after a second preemption there."""
        if region is None:
            return  # a provider without regions (local, ssh): nowhere else to go
        if self.policy.failover == "eager_next_region":
            self.blocked.append((region, None))
        elif (region, zone) in self._preempted_in:
            self.blocked.append((region, zone))
        self._preempted_in.append((region, zone))


def narrowed(spec: ClusterSpec, catalog: Catalog, blocked: list[tuple[str, str | None]]) -> ClusterSpec:
    """The cluster spec with the blocked regions and zones taken out of where failover may launch."""
    if not blocked:
        return spec
    regions_out = {region for region, zone in blocked if zone is None}
    zones_out = {zone for _, zone in blocked if zone is not None}
    try:
        found = candidates(spec, catalog, hours=1.0)
    except NoCandidateError:
        return spec  # plan already refused this spec; nothing to narrow
    kept = [c for c in found if c.region not in regions_out and (c.zone is None or c.zone not in zones_out)]
    if not kept:
        raise RecoveryExhausted(f"every candidate region/zone is blocked after preemptions ({sorted(regions_out)} "
                                f"{sorted(zones_out)}): widen cluster.regions/zones or use failover same_zone_first")
    regions = tuple(dict.fromkeys(c.region for c in kept))
    zones = tuple(dict.fromkeys(c.zone for c in kept if c.zone is not None))
    return spec.model_copy(update={"regions": regions, "zones": zones})
