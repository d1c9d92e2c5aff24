"""During training: inject the job's chaos, watch for notices and vanished nodes, and name a preemption as such.

A trainer that fails is a preemption when a node of the cluster got a notice or is gone — the failure is then
the surviving nodes losing their peer, and the flow recovers instead of failing. A node that is gone for
recovery.confirm_s while training still runs is a preemption too (the remaining nodes are stopped cleanly by
the caller). Everything else is an ordinary training failure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from infra.compute.access.agent import NodeAgent
from infra.compute.access.remote import Process, RemoteError, Runner
from infra.compute.providers import Cluster, Node, Provider
from infra.job.recovery_spec import PreemptSpec
from infra.node.protocol import NodeRequest
from infra.workload.progress import StepClock

CHAOS_TRIGGER = "chaos-trigger"
CHECK_INTERVAL_S = 2.0
# Reads from a node that still answers a new connection, failing this many rounds in a row: not a lost node, a broken
# one, and the run stops with the reason rather than train on unseen.
UNREADABLE_ROUNDS = 5
# A control plane that does not answer is asked again after this, doubling up to the cap, and said so once a step.
UNKNOWN_RETRY_S, UNKNOWN_RETRY_MAX_S = 2.0, 60.0
# A provider call that fails with one of these is a bug of ours, not an outage of theirs: it is raised as it is.
BUGS = (TypeError, AttributeError, NameError, AssertionError, KeyError, IndexError)


class TrainingProgress(Protocol):
    """How far training got, as the flow follows it (tasks.node_output.TrainingProgress is the one in use)."""

    last_step: int  # the newest step the head node reported
    clock: StepClock


class TrainingError(RuntimeError):
    pass


class Preempted(TrainingError):
    """Nodes were taken away: the flow replaces them (or relaunches the cluster) and resumes from the latest commit.

    nodes: every node lost to this attempt (several can go at once), the first the one that decided it."""

    def __init__(self, cluster: Cluster, nodes: Sequence[str], reason: str, with_notice: bool,
                 progress: TrainingProgress) -> None:
        step_reached = progress.last_step
        super().__init__(f"{', '.join(nodes)} preempted ({reason}) at step {step_reached}")
        self.nodes, self.reason, self.with_notice, self.step_reached = tuple(nodes), reason, with_notice, step_reached
        self.cluster = cluster  # the cluster they were lost from: a replacement puts new nodes into it
        self.detected_at = time.time()
        # How far this attempt's steps got before the node went: the run's overhead counts what they took.
        self.first_step_at, self.steps_s = progress.clock.first_step_at, progress.clock.steps_s()

    @property
    def node(self) -> str:
        return self.nodes[0]

    @property
    def lost(self) -> tuple[str, ...]:
        """The nodes that are gone (whose parts of a checkpoint will never come)."""
        return self.nodes


@dataclass
class _Injection:
    event: PreemptSpec
    node_name: str
    runner: Runner
    trigger_path: str
    process: Process
    fired: bool = False


class _ControlPlane:
    """The provider's answers to the watch's liveness and notice calls. One that fails (an API error past the SDK's
    own retries, a throttle, a timeout) is unknown, not dead: logged when it starts, then at each doubling of the
    backoff, asked again after that backoff, and answered with None meanwhile; past outage_s without an answer it
    stops the run, naming the control plane."""

    def __init__(self, provider: Provider, outage_s: float,
                 logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
        self.provider, self.outage_s, self.logger = provider, outage_s, logger
        self.silent_since: float | None = None
        self._retry_s = UNKNOWN_RETRY_S
        self._ask_at = 0.0

    def ask(self, what: str, call: Callable[[], Any]) -> Any:
        if self.silent_since is not None and time.monotonic() < self._ask_at:
            return None
        asked = time.monotonic()
        try:
            answer = call()
        except BUGS:
            raise
        except Exception as exc:
            # Counted from the failure, not the ask: a call that failed only after its retries (seconds) would
            # otherwise leave its backoff already spent, and the round's next read would wait out the same retries.
            return self._unanswered(what, exc, asked, time.monotonic())
        now = time.monotonic()
        if self.silent_since is not None:
            self.logger.warning("%s control plane answers again after %.0fs", self.provider.name,
                                now - self.silent_since)
            self.silent_since, self._retry_s = None, UNKNOWN_RETRY_S
        return answer

    def _unanswered(self, what: str, exc: Exception, asked: float, now: float) -> None:
        if self.silent_since is None:
            self.silent_since = asked
        silent_s = now - self.silent_since
        if silent_s >= self.outage_s:
            raise TrainingError(
                f"the {self.provider.name} control plane has not answered the watch's {what} for {silent_s:.0f}s "
                f"(recovery.control_plane_outage_s {self.outage_s:g}; last: {type(exc).__name__}: {exc}): training "
                "stopped unwatched; check the provider's status and credentials, then run again with --run-id")
        self.logger.warning("%s control plane did not answer %s (%s: %s): unknown, not dead: the nodes' own signals "
                            "decide; asking again in %.0fs (%.0fs of %gs without an answer)", self.provider.name,
                            what, type(exc).__name__, exc, self._retry_s, silent_s, self.outage_s)
        # Asked again at the bound at the latest: a backoff that ran past it would stop the run that much later.
        self._ask_at = min(now + self._retry_s, self.silent_since + self.outage_s)
        self._retry_s = min(self._retry_s * 2, UNKNOWN_RETRY_MAX_S)
        return None


class PreemptionWatch:
    def __init__(self, provider: Provider, cluster: Cluster, runners: dict[str, Runner], progress: TrainingProgress,
                 confirm_s: float, logger: logging.Logger | logging.LoggerAdapter[Any],
                 control_plane_outage_s: float = 600.0) -> None:
        self.provider, self.cluster, self.runners, self.progress = provider, cluster, runners, progress
        self.confirm_s, self.logger = confirm_s, logger
        self.control_plane = _ControlPlane(provider, control_plane_outage_s, logger)
        self.injections: list[_Injection] = []
        self.started = time.monotonic()
        self._next_check = 0.0
        self._notices: dict[str, str] = {}  # node → reason, as first seen
        self._gone_since: dict[str, float] = {}
        self._unreadable: dict[str, int] = {}  # node → reads failed in a row

    # -- chaos ---------------------------------------------------------------------------------------------------

    def arm(self, events: list[PreemptSpec], injector: Callable[[Node, str, float], NodeRequest]) -> None:
        """Start the chaos injector on each node an event of this attempt preempts (injector builds its request)."""
        for event in events:
            node = self.cluster.nodes[event.node]
            runner = self.runners[node.name]
            trigger = node.path(CHAOS_TRIGGER)
            process = NodeAgent(runner, node.python).start(injector(node, trigger, event.notice_s),
                                                           log_path=node.path("logs", "chaos.log"))
            self.injections.append(_Injection(event, node.name, runner, trigger, process))
            when = f"step {event.at_step}" if event.at_step is not None else f"{event.after_s:.0f}s into training"
            self.logger.warning("chaos: %s will be preempted at %s (%s)", node.name, when,
                                f"{event.notice_s:.0f}s notice" if event.notice_s else "no notice")

    def disarm(self) -> None:
        """End the injectors that have not fired: a survivor of a replace-one recovery keeps its dir, and an armed
        injector left there would take its node away on the next attempt's trigger."""
        for injection in self.injections:
            if injection.fired:
                continue
            try:
                injection.process.terminate(grace_s=5.0)
            except (RemoteError, OSError) as exc:  # a node gone with its injector: nothing left to end there
                self.logger.warning("chaos: %s: its injector could not be ended (%s)", injection.node_name, exc)

    def _fire_due(self) -> None:
        elapsed = time.monotonic() - self.started
        for injection in self.injections:
            event = injection.event
            due = (event.at_step is not None and self.progress.last_step >= event.at_step) or (
                event.after_s is not None and elapsed >= event.after_s)
            if due and not injection.fired:
                injection.fired = True
                injection.runner.write_text(injection.trigger_path, f"{time.time():.3f}\n")
                self.logger.warning("chaos: preempting %s now (step %d)", injection.node_name,
                                    self.progress.last_step)

    # -- detection -----------------------------------------------------------------------------------------------

    def _look(self, confirm_s: float) -> Preempted | None:
        """Notices and liveness now; a Preempted once a node has been gone for confirm_s. While the control plane
        does not answer, no notice is new and no node is gone: unknown is not dead."""
        notices = self.control_plane.ask("preemption notices", lambda: self.provider.preemption_notices(self.cluster))
        alive = self.control_plane.ask("liveness", lambda: self.provider.nodes_alive(self.cluster))
        for notice in notices or ():
            if notice.node not in self._notices:
                self._notices[notice.node] = notice.reason
                self.logger.warning("%s: preemption notice (%s), %.0fs left", notice.node, notice.reason,
                                    notice.deadline - time.time())
        now = time.monotonic()
        gone = []
        for node, answered_alive in (alive or {}).items():
            if answered_alive:
                self._gone_since.pop(node, None)
            else:
                gone.append(node)
                self._gone_since.setdefault(node, now)
        confirmed = [node for node in gone if now - self._gone_since[node] >= confirm_s]
        if not confirmed:
            return None
        # Once one node is confirmed lost, every node gone or noticed is lost to this attempt too: they go together.
        lost = [*confirmed, *(n for n in gone if n not in confirmed), *(n for n in self._notices if n not in gone)]
        first = confirmed[0]
        return Preempted(self.cluster, lost, self._notices.get(first, "vanished without notice"),
                         first in self._notices, self.progress)

    def poll(self) -> None:
        """Called from the wait loop: fires due chaos, and raises Preempted for a node confirmed gone."""
        self._fire_due()
        if time.monotonic() < self._next_check:
            return
        self._next_check = time.monotonic() + CHECK_INTERVAL_S
        preempted = self._look(self.confirm_s)
        if preempted is not None:
            raise preempted

    def noticed_now(self) -> frozenset[str]:
        """The nodes under a preemption notice, looked up now rather than at the next check (a Preempted raised once
        one is confirmed gone): a sidecar that died on one of them died with its node, and is not started again over
        a connection to a machine that is going (which waits out the whole SSH connect bound)."""
        preempted = self._look(self.confirm_s)
        if preempted is not None:
            raise preempted
        return frozenset(self._notices)

    def reading(self, node: str, read: Callable[[], None]) -> None:
        """A read from node in the wait loop (the head's metrics file). A connection error is the watch's to judge,
        not the run's end: with the node gone (a new connection fails too) it is a preemption, raised at once, the
        failed read being the evidence, as a trainer's failure is in explain; with the node answering, the read is
        tried again next round, up to UNREADABLE_ROUNDS failures in a row."""
        try:
            read()
        except ConnectionError as exc:  # SshConnectError: the connection dropped, or the node did not answer
            failures = self._unreadable[node] = self._unreadable.get(node, 0) + 1
            self.logger.warning("%s: cannot read from it (%s): is it still there?", node, exc)
            preempted = self._look(confirm_s=0.0)
            if preempted is not None:
                raise preempted from exc
            if failures >= UNREADABLE_ROUNDS:
                raise TrainingError(f"{node}: reads failed {failures} times in a row although it answers a new "
                                    f"connection (last: {exc}): check the node's sshd and disk") from exc
            self.logger.warning("%s: it still answers: reading again next round (%d/%d)", node, failures,
                                UNREADABLE_ROUNDS)
        else:
            self._unreadable.pop(node, None)

    def explain(self, failure: TrainingError) -> TrainingError:
        """A trainer failed: a preemption when a node got a notice or goes missing within confirm_s, else itself.

        The failure confirms a missing node at once: no need to watch it stay gone."""
        deadline = time.monotonic() + self.confirm_s
        while True:
            preempted = self._look(confirm_s=0.0)
            if preempted is not None:
                return preempted
            noticed = next(iter(self._notices.items()), None)
            if noticed is not None:
                return Preempted(self.cluster, list(self._notices), noticed[1], True, self.progress)
            if time.monotonic() >= deadline:
                return failure
            time.sleep(0.5)
