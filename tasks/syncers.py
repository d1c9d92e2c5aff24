"""The checkpoint syncers of one training launch, one per node: started before the trainers, watched from the train
wait loop, stopped together.

A syncer that dies during training is restarted with the same request (the same attempt id: it resumes from its
state file and ships nothing twice), up to MAX_RESTARTS times per node; one that gave up on the store (it already
rode out checkpoints.store_outage_s) or keeps dying stops training with the reason, so the run never trains on
what can no longer be committed. A node's disk that fills (its syncer's `disk-full` event, infra/node/diskfull.py)
stops training too, the reason naming the node, the path and the bytes free.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from infra.cancel import CANCEL
from infra.compute.access.agent import NodeAgent
from infra.compute.access.remote import LineSink, Process, RemoteError, Runner, last_error
from infra.compute.providers import Node
from infra.lifecycle.preemption_watch import TrainingError
from infra.node.diskfull import EXIT_DISK_FULL
from infra.node.events import Event, NodeEvent
from infra.node.protocol import NodeRequest
from infra.node.sync import EXIT_STORE_FAILED, STOP_FILE, stop_request

MAX_RESTARTS = 3
# Beyond the syncer's own commit_timeout_s: time for it to say which node's part is missing, and to exit.
STOP_GRACE_S = 10.0
POLL_S = 0.5
DISK_FULL_FIX = ("training stopped: free space on the node, lower checkpoints.keep_local (and the script's own), or "
                 "use nodes with larger disks (`trainpipe plan` shows each node's disk budget), then run again (it "
                 "resumes)")

Logger = logging.Logger | logging.LoggerAdapter[Any]


def syncer_error(process: Process) -> str:
    return last_error(process, ("sync:", "restore:"))


def _how_it_ended(process: Process, code: int) -> str:
    """A syncer killed by a signal printed nothing about it: say which signal rather than its last event line."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return syncer_error(process)


def _exit_code(process: Process) -> int | None:
    """None while it runs; once it ended, its code with all its output read (the error is in the last lines)."""
    return None if process.poll() is None else process.wait(5)


class Syncers:
    """Every node's syncer; events (uploads, commits) from all of them are kept in `events`, in arrival order."""

    def __init__(self, runners: dict[str, Runner], nodes: Sequence[Node], request: Callable[[Node], NodeRequest],
                 sink: Callable[[Node, Callable[[Event], None]], LineSink], logger: Logger,
                 max_restarts: int = MAX_RESTARTS, env: dict[str, str] | None = None) -> None:
        self.runners, self.nodes, self.request, self.sink, self.logger = runners, tuple(nodes), request, sink, logger
        # The job's secrets (store credentials) and the peer replicas' credentials, the same on every restart.
        self.env = env
        self.max_restarts = max_restarts
        self.processes: dict[str, Process] = {}
        self.restarts: dict[str, int] = {}
        self.left_to_go: set[str] = set()  # nodes under a preemption notice whose syncer died: not restarted
        self.events: list[Event] = []

    def start(self) -> None:
        for node in self.nodes:
            self._start(node)

    def _start(self, node: Node) -> None:
        self.processes[node.name] = NodeAgent(self.runners[node.name], node.python, self.env).start(
            self.request(node), on_line=self.sink(node, self.events.append),
            log_path=node.path("logs", "sync.log"))

    def disk_full(self, wait_s: float = 0.0) -> TrainingError | None:
        """The first node whose syncer said its disk is full, as the reason training stops; waits up to wait_s for
        one (a trainer that failed on a full disk may be reported before its syncer's next round)."""
        deadline = time.monotonic() + wait_s
        while True:
            full = next((event for event in list(self.events) if event.kind is NodeEvent.DISK_FULL), None)
            if full is not None:
                node = next(node for node in self.nodes if node.rank == full["node_rank"])
                return TrainingError(f"{node.name}: disk full: {full['path']} has {full['free_bytes']:,} bytes free; "
                                     f"{DISK_FULL_FIX}")
            if time.monotonic() >= deadline:
                return None
            CANCEL.wait(min(POLL_S, deadline - time.monotonic()))

    def poll(self, going: Callable[[], Collection[str]] = frozenset) -> None:
        """One round of the train wait: a syncer that died is restarted, or TrainingError says why training stops.
        One that exited 0 was asked to stop (the node's preemption watcher flushes it on a notice): left alone.
        going: the nodes under a preemption notice, asked only when a syncer died: one that died on such a node is
        not restarted (its node is going; the preemption watch acts on it)."""
        if (full := self.disk_full()) is not None:
            raise full
        for node in self.nodes:
            process = self.processes.get(node.name)
            code = None if process is None or node.name in self.left_to_go else _exit_code(process)
            if process is None or code is None or code == 0:
                continue
            if node.name in going():
                self.left_to_go.add(node.name)
                self.logger.warning("%s: checkpoint syncer exited %s (%s) on a node under a preemption notice: not "
                                    "restarted, the node is going", node.name, code, _how_it_ended(process, code))
                continue
            if code == EXIT_DISK_FULL:
                raise self.disk_full(POLL_S) or TrainingError(
                    f"{node.name}: checkpoint syncer: {syncer_error(process)}; {DISK_FULL_FIX}")
            if code == EXIT_STORE_FAILED:
                raise TrainingError(
                    f"{node.name}: checkpoint syncer gave up on the store: {syncer_error(process)}; training stopped "
                    "rather than train on checkpoints that cannot be committed: check the store, raise "
                    "checkpoints.store_outage_s to ride out longer outages, then run again (it resumes)")
            restarts, ended = self.restarts.get(node.name, 0), _how_it_ended(process, code)
            if restarts >= self.max_restarts:
                raise TrainingError(
                    f"{node.name}: checkpoint syncer died {restarts + 1} times during training (last exit {code}: "
                    f"{ended}); training stopped rather than train on checkpoints that cannot be committed: see "
                    f"{node.path('logs', 'sync.log')} on the node")
            self.restarts[node.name] = restarts + 1
            self.logger.warning("%s: checkpoint syncer exited %s during training (%s): restarting it (%d/%d); it "
                                "resumes from its state file", node.name, code, ended, restarts + 1, self.max_restarts)
            try:
                self._start(node)
            except (RemoteError, OSError) as exc:
                # A node being taken away (its dir going, its host unreachable): the wait loop's watch then names the
                # preemption; raised as anything else, it skipped the watch and the final flush waited on the part.
                raise TrainingError(f"{node.name}: checkpoint syncer died (exit {code}) and cannot be restarted: "
                                    f"{exc}") from None

    def checkpoints_found(self) -> int:
        """How many complete checkpoints the coordinator's syncer has found so far (each announced once)."""
        return sum(1 for event in list(self.events) if event.kind is NodeEvent.ANNOUNCED)

    def newest_settled(self) -> int | None:
        """The newest committed step when every step announced so far is committed or given up, else None."""
        committed = [e["step"] for e in self.events if e.kind is NodeEvent.COMMITTED and "step" in e]
        if not committed:
            return None
        dropped = {e.get("step") for e in self.events if e.kind in (NodeEvent.ABANDONED, NodeEvent.SKIPPED)}
        announced = [e["step"] for e in self.events if e.kind is NodeEvent.ANNOUNCED and e.get("step") not in dropped]
        newest = max(committed)
        return newest if all(step <= newest for step in announced) else None

    def stop(self, timeout_s: float, grace_s: float = STOP_GRACE_S, lost: Sequence[str] = (),
             each_round: Callable[[], None] | None = None) -> None:
        """Ask every syncer to flush what is complete and exit, and wait for all of them together, within one bound:
        timeout_s (the syncers' own commit_timeout_s) plus grace_s. A syncer that fails means checkpoints were not
        saved.

        lost: nodes preempted (gone with their syncers): nothing is asked of them or waited for, and the others are
        told, so that a step missing a lost node's part is not waited for either. each_round: called every round
        of the wait (the preemption watch): what it raises ends the wait, the syncers still flushing stopped; a node
        lost during the final flush is then acted on at once, not after the whole bound."""
        failures = []
        # A syncer already dead (not restarted: training stopped on it) ships nothing more: its node's parts are as
        # lost as a preempted node's, and the others must not wait the whole bound for them.
        dead = {name: code for name, process in self.processes.items()
                if name not in lost and (code := _exit_code(process)) not in (None, 0)}
        for name, code in dead.items():
            failures.append(f"{name}: checkpoint syncer exited {code} before the flush: "
                            f"{_how_it_ended(self.processes[name], code)}")
        pending = {name: process for name, process in self.processes.items() if name not in lost and name not in dead}
        request = stop_request([node.rank for node in self.nodes if node.name in lost or node.name in dead])
        for node in self.nodes:
            if node.name not in pending:
                continue
            try:
                self.runners[node.name].write_text(f"{node.sync_dir}/{STOP_FILE}", request)
            except (RemoteError, OSError) as exc:
                # An unreachable node must not keep the others from flushing: its syncer is the one that fails.
                failures.append(f"{node.name}: could not ask its checkpoint syncer to flush: {exc}")
                # Said now: the others' wait for this node's part may take the whole bound.
                self.logger.warning("%s; the other syncers flush within %.0fs", failures[-1], timeout_s + grace_s)
                pending.pop(node.name)  # teardown ends it with the node
        deadline = time.monotonic() + timeout_s + grace_s
        while pending:
            try:
                if each_round is not None:
                    each_round()
            except BaseException:
                for process in pending.values():
                    process.terminate()
                raise
            for name, process in list(pending.items()):
                code = _exit_code(process)
                if code is None:
                    continue
                del pending[name]
                if code != 0:
                    failures.append(f"{name}: checkpoint syncer exited {code}: {syncer_error(process)}")
            if pending and time.monotonic() > deadline:
                for name, process in pending.items():
                    process.terminate()
                    failures.append(f"{name}: checkpoint syncer did not flush within {timeout_s + grace_s:.0f}s")
                break
            time.sleep(POLL_S if pending else 0)
        if failures:
            raise TrainingError("; ".join(failures))
