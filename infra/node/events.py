"""Node commands report to the orchestrator as one JSON object per stdout line: {"event": <NodeEvent>, **fields}.

Every event a node reports is a member of NodeEvent (one spelling: dashes), written by emit() and read back by
parse() into an Event; readers compare `event.kind is NodeEvent.X`, never a name typed again.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum, unique
from typing import Any

log = logging.getLogger(__name__)


@unique  # one member per event: a second name for a value would be a second spelling
class NodeEvent(StrEnum):
    """Every event a node command reports, grouped by the command that reports it."""

    # probe, rejoin, code (infra/node/probe.py, rejoin.py, code.py)
    PROBE = "probe"
    REJOINED = "rejoined"
    CODE = "code"
    # stage (infra/node/stage.py, fanout.py)
    PROGRESS = "progress"
    STAGED = "staged"
    INPUT_STAGED = "input-staged"
    FANOUT = "fanout"
    FANOUT_FALLBACK = "fanout-fallback"
    # peerserve, unshare (infra/node/peerserve.py, unshare.py)
    PEER_SERVING = "peer-serving"
    UNSHARED = "unshared"
    # restore, verify (infra/node/restore.py, peerrestore.py, verify_ckpt.py)
    RESTORED = "restored"
    RESTORE_FANOUT = "restore-fanout"
    VERIFIED = "verified"
    # sync (infra/node/sync.py)
    STARTED = "started"
    UPLOADED = "uploaded"
    SKIPPED = "skipped"
    ANNOUNCED = "announced"
    ABANDONED = "abandoned"
    COMMITTED = "committed"
    UNCOMMITTABLE = "uncommittable"
    RETENTION = "retention"
    RETENTION_SKIPPED = "retention-skipped"
    STOPPED = "stopped"
    DISK_FULL = "disk-full"  # the node's disk is full (infra/node/diskfull.py): node, path, bytes free
    # the syncer's peer replica (infra/node/replica.py)
    REPLICA_SERVING = "replica-serving"
    REPLICA_SERVER_RESTARTED = "replica-server-restarted"
    REPLICA = "replica"
    REPLICA_FAILED = "replica-failed"
    # torchrun (infra/workload/launcher.py prints it, as infra/node/torchrun.py hands it the line): torchrun's agent of
    # a node whose ranks all exited 0, before its exit barrier
    RANKS_EXITED = "ranks-exited"
    # the training environment (infra/node/pull.py; tasks/verify.py's check runs in it through exec)
    IMAGE_PULLED = "image-pulled"  # image, digest, engine, seconds, local (pulled: false, present on the node)
    TRAINING_ENV = "training-env"  # python (sys.executable in the environment), torch (its version)
    # watch (infra/node/watchdog.py)
    WATCHING = "watching"
    REBALANCE_RECOMMENDATION = "rebalance-recommendation"
    NOTICE_CHECK_FAILED = "notice-check-failed"
    PREEMPTION_NOTICE = "preemption-notice"
    TRAINER_STOPPED = "trainer-stopped"
    LEASE_EXPIRED = "lease-expired"
    POWER_OFF_FAILED = "power-off-failed"
    NODE_DOWN = "node-down"
    # stacks (infra/node/stacks.py)
    STACKS_DUMPED = "stacks-dumped"  # ranks: the workers signalled, exited: how many ended within the grace
    # chaos (infra/node/chaos.py)
    CHAOS_ARMED = "chaos-armed"
    NOTICE_RAISED = "notice-raised"
    NODE_RECLAIMED = "node-reclaimed"
    # benches (infra/node/netbench.py, diskbench.py; infra/workload/allreduce_bench.py in the training environment)
    NETBENCH_LISTENING = "netbench-listening"
    NETBENCH_SERVER = "netbench-server"
    NETBENCH = "netbench"
    DISKBENCH = "diskbench"
    ALLREDUCE = "allreduce"


@unique
class WorkloadEvent(StrEnum):
    """The names of records the workload writes into its metrics file, for the orchestrator's readers. The writers
    (trainer/checkpoint.py's SaveRecord.to_event) are the workload side of the contract and spell the value
    themselves, without the node agent."""

    CHECKPOINT = "checkpoint"  # one finished local save (trainer.checkpoint.SaveRecord)


@dataclass(frozen=True, repr=False)
class Event(Mapping[str, Any]):
    """One parsed event line: its kind, and a read-only mapping of its fields (without the "event" key)."""

    kind: NodeEvent
    fields: Mapping[str, Any]

    __hash__ = None  # type: ignore[assignment]  # its fields are a dict, as unhashable as one

    def __post_init__(self) -> None:
        if not isinstance(self.kind, NodeEvent):
            raise TypeError(f"Event({self.kind!r}, ...): its kind is a NodeEvent member")

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def __bool__(self) -> bool:
        return True  # an event without fields (ranks-exited) is still an event: `if event` means "a line parsed"

    def __repr__(self) -> str:
        return f"Event({self.kind.value!r}, {dict(self.fields)!r})"


def event_line(event: NodeEvent, **fields: Any) -> str:
    """The line (without its newline) that reports event: also what the agent hands the training environment's
    launcher to print, so a process that cannot import this module still spells the event this way."""
    if not isinstance(event, NodeEvent):
        raise TypeError(f"emit({event!r}): an event is a NodeEvent member, not {type(event).__name__}")
    return json.dumps({"event": event.value, **fields})


def emit(event: NodeEvent, **fields: Any) -> None:
    # One write per line: a sidecar's background thread (infra/node/replica.py) emits too, and print's separate
    # write of the newline could interleave two events on one line.
    sys.stdout.write(event_line(event, **fields) + "\n")
    sys.stdout.flush()


_unknown_seen: set[str] = set()


def parse(line: str) -> Event | None:
    """The event a line carries, or None for ordinary output.

    A line naming an event that is not a NodeEvent is logged once per name and treated as ordinary output, not
    raised: parse runs in the output pumps of long-lived commands (a training launch, a syncer), where raising would
    cut the rest of their output or end a run over one report line; and a workload's own stdout shares the launch's
    stream, so a script printing its own {"event": ...} JSON is no bug. The line itself is still logged whole, and a
    reader waiting for the event it meant fails with its own "no '<event>' event"."""
    if not line.startswith('{"event"'):
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict):
        return None
    name = record.pop("event")
    try:
        kind = NodeEvent(name)
    except ValueError:
        if str(name) not in _unknown_seen:
            _unknown_seen.add(str(name))
            log.warning("a line names event %r, which is no NodeEvent (infra/node/events.py): treated as ordinary "
                        "output (a workload's own JSON, or a node agent of another version than the orchestrator)",
                        name)
        return None
    return Event(kind, record)


class Throttle:
    """Lets an action through at most once per interval, so progress never floods the logs."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last = 0.0

    def ready(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return False
        self._last = now
        return True


def fail(message: str, code: int = 1) -> int:
    print(message, file=sys.stderr, flush=True)
    return code
