"""A hung training: no rank reports a new step and no new complete checkpoint appears for training.hang_timeout_s.

A rank stuck in a collective (a dead GPU, a NIC that drops, a deadlock in the script) raises nothing and never
exits: the other ranks wait in their all-reduce. Progress is what says so: the steps the head's script reports (its
metrics file or its framework's log lines) and the checkpoints its syncer finds complete. The clock is armed by the
attempt's first step or checkpoint; before it, training.timeout_s bounds a script that never gets going (and a script
that reports neither is told so once, since nothing can arm the clock then).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from infra.compute.providers import Cluster
from infra.lifecycle.preemption_watch import Preempted, TrainingProgress

HUNG = "hung"  # the reason's first word, in the recovery record and the summary


def hang_reason(timeout_s: float, step: int) -> str:
    return f"{HUNG}: no step for {timeout_s:g} s after step {step}"


class HangClock:
    """Since when nothing moved: (the newest step reported, how many checkpoints were found complete)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self._clock = timeout_s, clock
        self.started = self.since = clock()
        self._seen: tuple[int, int] = (0, 0)

    def saw(self, step: int, checkpoints: int) -> None:
        if (step, checkpoints) != self._seen:
            self._seen, self.since = (step, checkpoints), self._clock()

    @property
    def armed(self) -> bool:
        return self._seen != (0, 0)

    def hung(self) -> bool:
        return self.timeout_s > 0 and self.armed and self._clock() - self.since >= self.timeout_s

    def unarmed_past_timeout(self) -> bool:
        """The timeout passed with no step and no checkpoint at all: detection cannot work for this script."""
        return self.timeout_s > 0 and not self.armed and self._clock() - self.started >= self.timeout_s


class Hung(Preempted):
    """Training hung: the flow stops the ranks everywhere (after they printed their stacks) and restarts them on the
    same nodes from the latest commit. Nothing is lost: every node stays, so `lost` is empty."""

    def __init__(self, cluster: Cluster, timeout_s: float, progress: TrainingProgress, stacks: str | None) -> None:
        super().__init__(cluster, [node.name for node in cluster.nodes], hang_reason(timeout_s, progress.last_step),
                         False, progress)
        where = f"; the ranks' stacks are in {stacks}" if stacks else "; the ranks' stacks could not be had"
        self.args = (f"training hung: no step and no new checkpoint for {timeout_s:g}s after step "
                     f"{progress.last_step} (training.hang_timeout_s): the ranks were stopped on every node{where}",)
        self.stacks = stacks

    @property
    def lost(self) -> tuple[str, ...]:
        return ()
