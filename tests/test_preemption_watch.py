"""The preemption watch's judgement of a failed read from a node (the head's metrics file, every round of the wait):
a node that is gone makes it a preemption at once; one that still answers is read again, a few rounds at most.

A real local cluster: a node is taken away the way the local provider's reclaim does it (its marker removed)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from infra.compute.providers.base import Cluster
from infra.compute.providers.local import NODE_MARKER, LocalProvider
from infra.compute.spec import ClusterSpec
from infra.lifecycle.preemption_watch import UNREADABLE_ROUNDS, Preempted, PreemptionWatch, TrainingError
from infra.workload.progress import StepClock


@dataclass
class Progress:
    last_step: int = 7
    clock: StepClock = field(default_factory=StepClock)


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[PreemptionWatch, Cluster]]:
    provider = LocalProvider(tmp_path / "clusters")
    cluster = provider.launch("tp-watch", ClusterSpec(nodes=2), "watch-run")
    runners = {node.name: provider.runner(cluster, node) for node in cluster.nodes}
    yield PreemptionWatch(provider, cluster, runners, Progress(), confirm_s=30.0,
                          logger=logging.getLogger("test.watch")), cluster
    provider.terminate(cluster.name)


def unreachable() -> None:
    raise ConnectionError("tp-watch-node-0: connection lost (EOFError)")


def test_a_failed_read_from_a_node_that_is_gone_is_a_preemption_at_once(
        watched: tuple[PreemptionWatch, Cluster]) -> None:
    watch, cluster = watched
    Path(cluster.head.workdir, NODE_MARKER).unlink()  # taken away, no notice
    with pytest.raises(Preempted) as preempted:
        watch.reading(cluster.head.name, unreachable)  # not after confirm_s: the failed read is the evidence
    assert preempted.value.node == cluster.head.name and preempted.value.reason == "vanished without notice"
    assert preempted.value.step_reached == 7 and not preempted.value.with_notice


def test_a_node_that_still_answers_is_read_again_a_few_rounds_then_stops_the_run(
        watched: tuple[PreemptionWatch, Cluster]) -> None:
    watch, cluster = watched
    for _ in range(UNREADABLE_ROUNDS - 1):
        watch.reading(cluster.head.name, unreachable)
    watch.reading(cluster.head.name, lambda: None)  # a read that works starts the count afresh
    for _ in range(UNREADABLE_ROUNDS - 1):
        watch.reading(cluster.head.name, unreachable)
    with pytest.raises(TrainingError, match=f"reads failed {UNREADABLE_ROUNDS} times in a row") as stopped:
        watch.reading(cluster.head.name, unreachable)
    assert not isinstance(stopped.value, Preempted)
