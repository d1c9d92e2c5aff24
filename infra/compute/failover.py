"""Try candidates in order until one launches; learn from each failure what else is worth trying.

A capacity failure blocks that zone (or the whole region when the provider picked the zone) for that instance type
and market; a quota failure blocks the region for that market; an auth or invalid-request failure stops at once,
because nowhere else would do better. Every attempt is recorded for the run summary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from infra.compute.optimizer import Candidate
from infra.compute.providers.base import (
    Attempt,
    CapacityError,
    Cluster,
    InvalidRequestError,
    LaunchError,
    PriceError,
    QuotaError,
)

log = logging.getLogger(__name__)

LaunchCandidate = Callable[[Candidate], Cluster]


class NoCapacityAnywhere(CapacityError):
    """Every candidate failed for capacity: transient, so the provision step may retry the list later."""

    def __init__(self, message: str, attempts: list[Attempt]) -> None:
        super().__init__(message)
        self.attempts = attempts


class QuotaEverywhere(QuotaError):
    def __init__(self, message: str, attempts: list[Attempt]) -> None:
        super().__init__(message)
        self.attempts = attempts


@dataclass(frozen=True)
class Launched:
    cluster: Cluster
    candidate: Candidate
    attempts: list[Attempt]

    def recorded_cluster(self) -> Cluster:
        """The cluster with what it runs on, its price and every attempt it took: what the run summary reports."""
        return replace(self.cluster, instance_type=self.candidate.instance_type, market=self.candidate.market,
                       price_per_hour=round(self.candidate.cluster_per_hour, 4),
                       attempts=tuple(attempt.to_dict() for attempt in self.attempts))


def attempts_of(exc: BaseException) -> list[dict[str, Any]]:
    """The launch attempts a failed launch made (failover attaches them to its error), as dicts."""
    return [attempt.to_dict() if isinstance(attempt, Attempt) else dict(attempt)
            for attempt in getattr(exc, "attempts", [])]


def _outcome(exc: LaunchError) -> str:
    if isinstance(exc, CapacityError):
        return "capacity"
    if isinstance(exc, QuotaError):
        return "quota"
    if isinstance(exc, PriceError):
        return "price"
    return "invalid" if isinstance(exc, InvalidRequestError) else "error"


class _Blocks:
    def __init__(self) -> None:
        self.zones: set[tuple[str, str, str, str]] = set()
        self.regions: set[tuple[str, str, str]] = set()
        self.quota: set[tuple[str, str]] = set()

    def reason(self, c: Candidate) -> str | None:
        if (c.region, c.market) in self.quota:
            return f"quota exhausted in {c.region} ({c.market})"
        if (c.instance_type, c.region, c.market) in self.regions:
            return f"no {c.market} capacity for {c.instance_type} in {c.region}"
        if c.zone and (c.instance_type, c.region, c.zone, c.market) in self.zones:
            return f"no {c.market} capacity for {c.instance_type} in {c.zone}"
        return None

    def learn(self, c: Candidate, exc: LaunchError) -> None:
        if isinstance(exc, QuotaError):
            self.quota.add((c.region, c.market))
        elif c.zone:
            self.zones.add((c.instance_type, c.region, c.zone, c.market))
        else:
            self.regions.add((c.instance_type, c.region, c.market))


def launch_with_failover(candidates: Sequence[Candidate], launch: LaunchCandidate) -> Launched:
    """The first candidate that launches; raises the most actionable LaunchError when none does."""
    if not candidates:
        raise InvalidRequestError("no candidates to launch: the plan found none (see `trainpipe plan`)")
    attempts: list[Attempt] = []
    blocks = _Blocks()
    for candidate in candidates:
        blocked = blocks.reason(candidate)
        if blocked:
            attempts.append(_attempt(candidate, "skipped", blocked, 0.0))
            continue
        started = time.monotonic()
        try:
            cluster = launch(candidate)
        except InvalidRequestError as exc:
            # Bad request or credentials: nowhere else would succeed, so stop before paying for more attempts.
            attempts.append(_attempt(candidate, _outcome(exc), str(exc), time.monotonic() - started))
            exc.attempts = attempts  # type: ignore[attr-defined] - the run summary lists them on failure too
            raise
        except LaunchError as exc:
            attempts.append(_attempt(candidate, _outcome(exc), str(exc), time.monotonic() - started))
            log.warning("launch on %s failed (%s): %s; trying the next candidate", candidate.label(),
                        _outcome(exc), exc)
            blocks.learn(candidate, exc)
            continue
        attempts.append(_attempt(candidate, "launched", None, time.monotonic() - started))
        log.info("launched on %s after %d attempts", candidate.label(), len(attempts))
        return Launched(cluster, candidate, attempts)
    tried = [a for a in attempts if a.outcome != "skipped"]
    summary = "; ".join(f"{a.instance_type} {a.zone or a.region} {a.market}: {a.outcome}" for a in tried)
    if any(a.outcome == "quota" for a in tried):
        raise QuotaEverywhere(f"no candidate launched ({summary}): raise the quota or widen regions", attempts)
    raise NoCapacityAnywhere(f"no candidate launched ({summary}): widen regions/zones, allow spot or on-demand, "
                             "or retry later", attempts)


def _attempt(c: Candidate, outcome: str, error: str | None, seconds: float) -> Attempt:
    return Attempt(candidate=c.key, instance_type=c.instance_type, region=c.region, zone=c.zone, market=c.market,
                   outcome=outcome, error=error, seconds=round(seconds, 3))
