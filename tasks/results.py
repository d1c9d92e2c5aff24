"""What the tasks return: the node agents' JSON events, parsed once at the task boundary into typed records.

The node commands (infra.node) print one JSON event per line; the tasks pick the one that carries their result and
turn it into one of these, so flows and the report read named fields instead of keys a typo would miss.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from infra.node.events import Event, NodeEvent, WorkloadEvent


@dataclass(frozen=True)
class Probe:
    """A node's `probe` event: it answers, and what it has (verify)."""

    host: str
    python: str
    platform: str
    cpus: int | None
    free_bytes: dict[str, int]  # per probed dir
    free_port: int  # the head node's is the rendezvous port
    problems: tuple[str, ...] = ()

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> Probe:
        return cls(host=event["host"], python=event["python"], platform=event["platform"], cpus=event["cpus"],
                   free_bytes=dict(event["free_bytes"]), free_port=event["free_port"],
                   problems=tuple(event["problems"]))


@dataclass(frozen=True)
class Staged:
    """A node's `staged` event: its share of the dataset is in its data dir."""

    files: int
    bytes: int  # fetched from the store
    skipped_files: int  # reused from the node's cache or data dir
    skipped_bytes: int
    node_bytes: int  # what the node holds
    seconds: float
    mb_per_s: float  # of the fetch
    # Where the fetched bytes came from (fan-out: the node's share and fallbacks from the store, the rest from peers)
    store_bytes: int = 0
    peer_bytes: int = 0
    fallback_files: int = 0  # fan-out: files a peer owed that came from the store instead

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> Staged:
        return cls(files=event["files"], bytes=event["bytes"], skipped_files=event["skipped_files"],
                   skipped_bytes=event["skipped_bytes"], node_bytes=event["node_bytes"], seconds=event["seconds"],
                   mb_per_s=event["mb_per_s"], store_bytes=event["store_bytes"], peer_bytes=event["peer_bytes"],
                   fallback_files=event["fallback_files"])


@dataclass(frozen=True)
class StagedNode:
    """What one node staged: its share of the dataset (None when the trainer reads it from the store) and every
    input (its `input-staged` events, by name)."""

    dataset: Staged | None
    inputs: dict[str, Staged]


@dataclass(frozen=True)
class Restored:
    """A node's `restored` event: the latest committed checkpoint is in its checkpoint dir."""

    step: int
    path: str  # on the node: the script's TRAINPIPE_RESUME_FROM
    name: str = ""
    bytes: int = 0
    seconds: float = 0.0
    config_hash: str | None = None
    warnings: tuple[str, ...] = ()  # newer commits skipped as damaged
    # The bytes by where they came from: store, local (already on the node), and with fan-out peer and replica
    sources: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> Restored:
        return cls(step=event["step"], path=event["path"], name=event.get("name", ""), bytes=event.get("bytes", 0),
                   seconds=event.get("seconds", 0.0), config_hash=event.get("config_hash"),
                   warnings=tuple(event.get("warnings", ())), sources=dict(event.get("sources", {})))


@dataclass(frozen=True)
class Verified:
    """The head node's `verified` event: the committed checkpoint's every byte checks out."""

    step: int
    files: int
    bytes: int
    seconds: float

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> Verified:
        return cls(step=event["step"], files=event["files"], bytes=event["bytes"], seconds=event["seconds"])


@dataclass(frozen=True)
class CheckpointSave:
    """The script's `checkpoint` record (trainer.checkpoint) in its metrics file: one local save on the head node."""

    step: int
    mode: str
    stall_s: float  # training stopped for this long
    write_s: float
    bytes: int

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> CheckpointSave:
        return cls(step=event["step"], mode=event["mode"], stall_s=event["stall_s"], write_s=event["write_s"],
                   bytes=event["bytes"])


@dataclass(frozen=True)
class Uploaded:
    """A syncer's `uploaded` event: one node's part of a checkpoint step is in the store."""

    step: int
    seconds: float
    mb_per_s: float | None

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> Uploaded:
        return cls(step=event["step"], seconds=event["seconds"], mb_per_s=event["mb_per_s"])


@dataclass(frozen=True)
class Committed:
    """The coordinating syncer's `committed` event: the step's manifest is in the store."""

    step: int
    commit_s: float  # from the step complete locally to its manifest in the store
    bytes: int

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> Committed:
        return cls(step=event["step"], commit_s=event["commit_s"], bytes=event["bytes"])


def checkpoint_saves(records: Iterable[CheckpointSave | Mapping[str, Any]]) -> list[CheckpointSave]:
    """The saves among the script's metrics records (its other records are steps and facts)."""
    return [r if isinstance(r, CheckpointSave) else CheckpointSave.from_event(r) for r in records
            if isinstance(r, CheckpointSave) or r.get("event") == WorkloadEvent.CHECKPOINT]


def sync_results(events: Iterable[Uploaded | Committed | Event]) -> list[Uploaded | Committed]:
    """The uploads and commits among the syncers' events (the rest, started, skipped, retention..., only log)."""
    kinds: dict[NodeEvent, type[Uploaded] | type[Committed]] = {NodeEvent.UPLOADED: Uploaded,
                                                                 NodeEvent.COMMITTED: Committed}
    results: list[Uploaded | Committed] = []
    for event in events:
        if isinstance(event, Uploaded | Committed):
            results.append(event)
        elif event.kind in kinds:
            results.append(kinds[event.kind].from_event(event))
    return results
