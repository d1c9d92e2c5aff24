"""The training wait's hang check: past training.hang_timeout_s without progress, every node's ranks print their
stacks into the run folder and Hung is raised, which the flow recovers on the same nodes (infra/lifecycle/hang.py)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from infra.compute.access.agent import NodeAgent
from infra.compute.access.remote import Process, Runner
from infra.compute.providers import Cluster
from infra.compute.providers.hosts import in_parallel
from infra.lifecycle.hang import HangClock, Hung
from infra.lifecycle.preemption_watch import TrainingProgress
from infra.node.protocol import StacksRequest
from infra.workspace import run_dir

STACKS_DIR = "stacks"  # in the run folder: attempt-N/<node>.txt, each node's trainer output with its ranks' stacks
STACKS_GRACE_S = 10.0  # what the ranks get to print their stacks and exit
STACKS_WITHIN_S = 60.0  # the whole dump, every node at once: best effort, never holds the recovery up for longer
OUTPUT_LINES = 2000  # of each trainer's output, kept with the stacks (one rank's stack is a few dozen lines)


class HangCheck:
    """Called each round of the training wait with nothing; raises Hung when the run is hung."""

    def __init__(self, timeout_s: float, cluster: Cluster, runners: Mapping[str, Runner],
                 trainers: Mapping[str, Process], progress: TrainingProgress, checkpoints_found: Callable[[], int],
                 attempt: int, logger: logging.Logger | logging.LoggerAdapter) -> None:
        self.clock = HangClock(timeout_s)
        self.cluster, self.runners, self.trainers, self.progress = cluster, runners, trainers, progress
        self.checkpoints_found, self.attempt, self.logger = checkpoints_found, attempt, logger
        self._told_unarmed = False

    def __call__(self) -> None:
        self.clock.saw(self.progress.last_step, self.checkpoints_found())
        if self.clock.unarmed_past_timeout() and not self._told_unarmed:
            self._told_unarmed = True
            self.logger.warning("hang detection is not armed: in training.hang_timeout_s (%gs) the script reported "
                                "no step (TRAINPIPE_METRICS_FILE) and wrote no checkpoint; only training.timeout_s "
                                "bounds it", self.clock.timeout_s)
        if self.clock.hung():
            self.logger.error("training hung: no step and no new checkpoint for %gs after step %d: dumping every "
                              "rank's stacks, then stopping them", self.clock.timeout_s, self.progress.last_step)
            raise Hung(self.cluster, self.clock.timeout_s, self.progress, self.dump_stacks())

    def dump_stacks(self) -> str | None:
        """Every node's ranks print their stacks and end; each trainer's output goes to the run folder. Returns the
        folder, or None when no node could be asked (each failure logged)."""
        folder = run_dir(self.cluster.run_id) / STACKS_DIR / f"attempt-{self.attempt}"
        outcomes = in_parallel(list(self.cluster.nodes), lambda node: NodeAgent(
            self.runners[node.name], node.python).run(StacksRequest(grace_s=STACKS_GRACE_S),
                                                      timeout=STACKS_WITHIN_S), within_s=STACKS_WITHIN_S)
        asked = 0
        for node, _, error in outcomes:
            if error is not None:
                self.logger.warning("%s: its ranks' stacks could not be had: %s", node.name, error)
                continue
            asked += 1
            trainer = self.trainers.get(node.name)
            if trainer is not None:
                _write_output(folder / f"{node.name}.txt", trainer)
        if not asked:
            return None
        self.logger.info("the ranks' stacks: %s", folder)
        return str(folder)


def _write_output(path: Path, trainer: Process) -> None:
    """The trainer's output once its ranks ended (their stacks are its last lines), or as it is after the grace."""
    with contextlib.suppress(TimeoutError):  # a rank that ignored the abort: what it printed so far
        trainer.wait(STACKS_GRACE_S)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(trainer.tail(OUTPUT_LINES) + "\n")
