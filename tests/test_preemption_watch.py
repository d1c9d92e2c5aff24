"""The preemption watch's judgement of a failed read from a node (the head's metrics file, every round of the wait):
a node that is gone makes it a preemption at once; one that still answers is read again, a few rounds at most.

A real local cluster: a node is taken away the way the local provider's reclaim does it (its marker removed)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cloud_env import wait_for

from infra.compute.providers.base import Cluster
from infra.compute.providers.local import NODE_MARKER, LocalProvider
from infra.compute.spec import ClusterSpec
from infra.lifecycle import preemption_watch
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


# -- a control plane that does not answer is unknown, not dead ---------------------------------------------------


class SilentControlPlane(LocalProvider):
    """The local provider whose liveness and notice calls fail, as a cloud API past its SDK's retries does (a 5xx,
    then a throttle), until told to answer again."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.failing: Exception | None = None
        self.failing_after_s = 0.0  # how long a failing call takes: an SDK's own retries before it gives up
        self.calls = 0

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.failing is not None:
            time.sleep(self.failing_after_s)
            raise self.failing

    def nodes_alive(self, cluster: Cluster) -> dict[str, bool]:
        self._maybe_fail()
        return super().nodes_alive(cluster)

    def preemption_notices(self, cluster: Cluster) -> list:
        self._maybe_fail()
        return super().preemption_notices(cluster)


@pytest.fixture
def silent(tmp_path: Path) -> Iterator[tuple[SilentControlPlane, Cluster]]:
    provider = SilentControlPlane(tmp_path / "clusters")
    cluster = provider.launch("tp-silent", ClusterSpec(nodes=2), "silent-run")
    yield provider, cluster
    provider.terminate(cluster.name)


def _watch(provider: SilentControlPlane, cluster: Cluster, outage_s: float) -> PreemptionWatch:
    runners = {node.name: provider.runner(cluster, node) for node in cluster.nodes}
    return PreemptionWatch(provider, cluster, runners, Progress(), confirm_s=0.0, logger=logging.getLogger("t.cp"),
                           control_plane_outage_s=outage_s)


def test_an_unanswered_control_plane_stops_nothing_and_is_asked_again_with_backoff(
        silent: tuple[SilentControlPlane, Cluster], caplog: pytest.LogCaptureFixture) -> None:
    """Before, the first error raised through the wait and stopped a healthy run."""
    provider, cluster = silent
    watch = _watch(provider, cluster, outage_s=600)
    provider.failing = RuntimeError("503 Service Unavailable")
    with caplog.at_level(logging.WARNING):
        assert watch._look(confirm_s=0.0) is None  # unknown: no node gone, nothing raised
        asked = provider.calls
        for _ in range(5):
            assert watch._look(confirm_s=0.0) is None
    assert provider.calls == asked, "asked again before its backoff"
    assert "did not answer preemption notices (RuntimeError: 503 Service Unavailable): unknown, not dead" in caplog.text
    provider.failing = None
    watch.control_plane._ask_at = 0.0  # the backoff's time has come
    with caplog.at_level(logging.WARNING):
        assert watch._look(confirm_s=0.0) is None
    assert "control plane answers again" in caplog.text and watch.control_plane.silent_since is None


def test_the_backoff_counts_from_the_failure_so_a_round_waits_out_one_slow_failure_not_two(
        silent: tuple[SilentControlPlane, Cluster], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the backoff counted from the ask: a read that failed only after its SDK's retries (longer than the
    backoff) left it spent, and the round's second read was made at once and failed as slowly: every round of the
    watch blocked the wait loop for both (30 s on GCP and Nebius, whose calls retry 15 s)."""
    monkeypatch.setattr(preemption_watch, "UNKNOWN_RETRY_S", 0.05)
    provider, cluster = silent
    watch = _watch(provider, cluster, outage_s=600)
    provider.failing, provider.failing_after_s = RuntimeError("503 Service Unavailable"), 0.2
    assert watch._look(confirm_s=0.0) is None
    assert provider.calls == 1, "the round's other read was made although the first had just failed"


def test_a_node_gone_while_the_control_plane_is_silent_is_seen_once_it_answers(
        silent: tuple[SilentControlPlane, Cluster]) -> None:
    provider, cluster = silent
    watch = _watch(provider, cluster, outage_s=600)
    Path(cluster.nodes[1].workdir, NODE_MARKER).unlink()
    provider.failing = RuntimeError("429 Too Many Requests")
    assert watch._look(confirm_s=0.0) is None, "unknown is not dead"
    provider.failing = None
    watch.control_plane._ask_at = 0.0
    preempted = watch._look(confirm_s=0.0)
    assert preempted is not None and preempted.nodes == (cluster.nodes[1].name,)


def test_past_the_outage_bound_the_run_stops_naming_the_control_plane(
        silent: tuple[SilentControlPlane, Cluster]) -> None:
    provider, cluster = silent
    watch = _watch(provider, cluster, outage_s=0.0)
    provider.failing = TimeoutError("read timed out")
    with pytest.raises(TrainingError, match=r"the local control plane has not answered the watch's preemption "
                                             r"notices for 0s \(recovery.control_plane_outage_s 0; last: "
                                             r"TimeoutError: read timed out\)"):
        watch._look(confirm_s=0.0)


def test_the_run_stops_at_the_outage_bound_not_at_the_next_backoff_after_it(
        silent: tuple[SilentControlPlane, Cluster], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the backoff (doubling to a minute) decided when the bound was checked: with a bound of 8 s the run
    stopped 14 s into the outage (asks at 0, 2, 6, 14 s)."""
    monkeypatch.setattr(preemption_watch, "UNKNOWN_RETRY_S", 30.0)
    provider, cluster = silent
    watch = _watch(provider, cluster, outage_s=0.5)
    provider.failing = RuntimeError("503 Service Unavailable")
    assert watch._look(confirm_s=0.0) is None
    stopped: list[TrainingError] = []

    def stops() -> bool:
        try:
            watch._look(confirm_s=0.0)
        except TrainingError as exc:
            stopped.append(exc)
        return bool(stopped)

    wait_for(stops, 10, "the watch stopping the run at its 0.5 s bound", interval=0.05)
    assert re.search(r"has not answered the watch's (preemption notices|liveness) for \ds "
                     r"\(recovery.control_plane_outage_s 0.5;", str(stopped[0])), stopped


def test_a_bug_in_a_provider_call_is_raised_as_it_is(silent: tuple[SilentControlPlane, Cluster]) -> None:
    provider, cluster = silent
    watch = _watch(provider, cluster, outage_s=600)
    provider.failing = AttributeError("'NoneType' object has no attribute 'instances'")
    with pytest.raises(AttributeError):
        watch._look(confirm_s=0.0)
