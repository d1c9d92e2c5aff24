"""`sync`: the node-side sidecar that ships complete checkpoints to the store while training goes on.

The training script writes checkpoints into the node's checkpoint dir the way its framework does
(infra.checkpoints.formats says which are complete). The syncer of node rank 0 is the coordinator: it sees each
framework's completion signal (DCP's `.metadata`, HF's `trainer_state.json`, a closed Lightning `.ckpt`, a
marker, ...), numbers the checkpoint, announces it in the store, ships its own part and, once every node named
in the announcement has uploaded its record for this attempt, commits it (the manifest), moves `latest` and
applies the store retention. Every other node's syncer ships its part of each announced checkpoint once that part
has settled locally.

What was shipped is remembered in a state file in the sync dir (outside the checkpoint dir, which is the script's
alone), so a restarted syncer resumes without shipping a checkpoint twice; a checkpoint restored onto the node
before training (restore writes RESTORED into the sync dir) is never shipped again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import psutil
from pydantic import BaseModel, Field, ValidationError

from infra.checkpoints.formats import (
    Detector,
    Found,
    file_is_whole,
    files_open_for_writing,
    own_required,
    part_files,
    part_settled,
    required_files,
)
from infra.checkpoints.layout import Announcement, CheckpointError, CheckpointRef, FileEntry
from infra.checkpoints.lineage import Lineage
from infra.checkpoints.steps import step_name
from infra.checkpoints.store import CheckpointStore
from infra.checkpoints.upload_lease import UPLOAD_LEASE, clear_lease, write_lease
from infra.node.diskfull import EXIT_DISK_FULL, DiskWatch, is_disk_full
from infra.node.events import NodeEvent, emit, fail
from infra.node.processes import NODE_TAG, tagged_processes
from infra.node.protocol import NodeCommand, NodeRequest, SyncRequest, as_request, runs_command
from infra.node.replica import ReplicaConfig, Replicator
from infra.registry import Registry, RegistryError, registry_root_of
from infra.storage import StorageError, open_store
from infra.storage.checksum import sha256_file
from infra.storage.retry import RetryPolicy, call_with_retries

log = logging.getLogger(__name__)

EXIT_COMMIT_TIMEOUT = 2
EXIT_BAD_REQUEST = 2  # what its request names cannot be used (a lineage file that is not one)
# The store refused, or stayed unavailable longer than its store_outage_s: a restarted syncer would fare no better, so
# the orchestrator stops training rather than train on what can no longer be committed.
EXIT_STORE_FAILED = 3
DEFAULT_STORE_OUTAGE_S = 300.0
# Between tries during an outage: short enough that the syncer notices the store is back within seconds.
OUTAGE_RETRY_MAX_S = 15.0
# A node with nothing of an announced checkpoint on its disk ships an empty part after this long: long enough for
# its own ranks' files of a save that has just finished everywhere to appear.
EMPTY_PART_GRACE_S = 5.0
RESTORED = "restored.json"
STOP_FILE = "stop"  # in the sync dir: the orchestrator (or the node's watcher) asks the syncer to flush and exit
LOST = "lost"  # a line of the stop file, `lost <rank> ...`: nodes preempted before the flush, whose parts never come


def stop_request(lost_ranks: Sequence[int] = ()) -> str:
    """The stop file's text: flush and exit; the lost nodes' parts are not waited for (they are gone with them)."""
    return "stop\n" + (f"{LOST} {' '.join(map(str, sorted(lost_ranks)))}\n" if lost_ranks else "")


def lost_ranks(stop_file: Path | None) -> frozenset[int]:
    """The ranks a stop request names lost; none when there is no request (or the node's watcher wrote it)."""
    try:
        text = stop_file.read_text() if stop_file is not None else ""
    except FileNotFoundError:
        return frozenset()
    return frozenset(int(rank) for line in text.splitlines() if line.startswith(f"{LOST} ")
                     for rank in line.split()[1:])


class Shipped(BaseModel):
    """One version of one checkpoint this node has shipped its part of (or found already committed)."""

    step: int = Field(ge=0)
    name: str
    version: int


class SyncState(BaseModel):
    """What this node's syncer has done for one checkpoint URL and attempt."""

    url: str
    node_rank: int
    attempt: str = ""
    shipped: list[Shipped] = Field(default_factory=list)
    newest_committed: int | None = None
    newest_step: int | None = None  # the highest step number given out (the coordinator numbers checkpoints)

    def has(self, name: str, version: int) -> bool:
        return any(s.name == name and s.version == version for s in self.shipped)

    def has_step(self, step: int) -> bool:
        return any(s.step == step for s in self.shipped)


@dataclass(frozen=True)
class SyncConfig:
    ckpt_dir: Path
    sync_dir: Path
    url: str
    node_rank: int
    nodes: int
    procs_per_node: int
    attempt: str
    config_hash: str
    keep: int
    format: str
    poll_s: float
    stop_file: Path | None
    commit_timeout_s: float
    flush_deadline_s: float = 20.0
    metrics_file: Path | None = None
    lineage: Lineage | None = None  # recorded in every manifest this syncer commits
    registry_url: str | None = None  # whose aliases' checkpoints retention keeps (default: the parent of url)
    store_outage_s: float = DEFAULT_STORE_OUTAGE_S
    replica: ReplicaConfig | None = None  # keep a replica of the ring buddy's part (infra/node/replica.py)

    @property
    def retry(self) -> RetryPolicy:
        """Longer than the transfer engine's per-request policy: this wraps whole checkpoints, and a sidecar rides
        out a store outage of store_outage_s rather than give up on a checkpoint."""
        return RetryPolicy(base_s=0.5, max_s=min(OUTAGE_RETRY_MAX_S, max(1.0, self.store_outage_s / 8)),
                           give_up_after_s=self.store_outage_s)

    @property
    def state_path(self) -> Path:
        return state_path(self.sync_dir, self.node_rank)

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def own_ranks(self) -> range:
        # torchrun with a static --node-rank gives each node a contiguous block of global ranks.
        start = self.node_rank * self.procs_per_node
        return range(start, start + self.procs_per_node)


class SyncError(Exception):
    """A permanent failure of the syncer; the message is one line naming the thing and the fix."""


def state_path(sync_dir: Path, node_rank: int) -> Path:
    """The node's sync state file; a trainer in checkpoint mode direct reads it to wait for its uploads."""
    return sync_dir / f"sync-state-node-{node_rank}.json"


def read_state(path: Path) -> SyncState | None:
    """The state a syncer left in `path`, or None when none has written it yet (it is replaced atomically)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return SyncState.model_validate_json(raw)
    except ValidationError as exc:
        raise SyncError(f"{path}: corrupt sync state ({exc.errors()[0]['msg']}): delete it to re-upload") from None


def write_restored(sync_dir: Path, step: int, found: list[Found]) -> None:
    """Restore's note to the syncer: these checkpoint versions on the node are the committed step `step`."""
    sync_dir.mkdir(parents=True, exist_ok=True)
    entries = [{"step": step, "name": f.name, "version": f.version} for f in found]
    (sync_dir / RESTORED).write_text(json.dumps({"step": step, "checkpoints": entries}))


def node_trainer_running() -> bool:
    """Whether this node's trainer (its torchrun, tagged with the node like every process the runner starts) runs."""
    node_tag = os.environ.get(NODE_TAG)
    if not node_tag:
        return False
    for process in tagged_processes(NODE_TAG, node_tag):
        try:
            if runs_command(process.cmdline(), NodeCommand.TORCHRUN):
                return True
        except psutil.Error:
            continue  # it ended while being looked at
    return False


def _last_metrics_step(path: Path | None) -> int | None:
    """The newest step the script reported in its metrics file: the number of a checkpoint whose name has none."""
    if path is None:
        return None
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 65536))
            tail = handle.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(tail):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            return int(record["step"])
    return None


class Syncer:
    def __init__(self, config: SyncConfig, checkpoints: CheckpointStore, disk: DiskWatch | None = None) -> None:
        self.config = config
        self.checkpoints = checkpoints
        self.disk = disk or DiskWatch(config.node_rank, config.ckpt_dir)  # the node's disk filling up, said
        self.detector = Detector(config.ckpt_dir, config.format)
        self.state = self._load_state()
        self.gone: set[tuple[str, int]] = set()  # (name, version) deleted locally before it could be shipped
        self.lost_steps: set[int] = set()  # steps a lost node's missing part keeps from being committed (said once)
        self.first_seen: dict[int, float] = {}  # announced step -> when this node first saw the announcement
        # An Event rather than a flag so a stop request (SIGTERM) also cuts the poll sleep short.
        self.stop_requested = threading.Event()
        self.replica = (Replicator(config.node_rank, config.nodes, checkpoints, config.replica, config.attempt)
                        if config.replica else None)

    @property
    def is_coordinator(self) -> bool:
        return self.config.node_rank == 0

    # ---- state --------------------------------------------------------------------------------------------

    def _load_state(self) -> SyncState:
        config = self.config
        fresh = SyncState(url=config.url, node_rank=config.node_rank, attempt=config.attempt)
        state = read_state(config.state_path)
        if state is None or (state.url, state.node_rank, state.attempt) != (config.url, config.node_rank,
                                                                             config.attempt):
            if state is not None:
                log.info("%s: state is for %s node %d attempt %s: starting fresh", config.state_path, state.url,
                         state.node_rank, state.attempt)
            state = fresh
        return self._with_restored(state)

    def _with_restored(self, state: SyncState) -> SyncState:
        """What restore put on the node is committed already: never shipped again, numbered at or below it."""
        try:
            note = json.loads((self.config.sync_dir / RESTORED).read_text())
        except FileNotFoundError:
            return state
        except json.JSONDecodeError as exc:
            raise SyncError(f"{self.config.sync_dir / RESTORED}: corrupt ({exc.msg}): delete it") from None
        step = int(note["step"])
        for entry in note["checkpoints"]:
            if not state.has(entry["name"], entry["version"]):
                state.shipped.append(Shipped(step=step, name=entry["name"], version=entry["version"]))
        state.newest_committed = max(step, state.newest_committed or step)
        state.newest_step = max(step, state.newest_step or step)
        return state

    def _save_state(self) -> None:
        path = self.config.state_path
        temp = path.with_name(path.name + ".tmp")
        temp.write_text(self.state.model_dump_json())
        os.replace(temp, path)

    # ---- shipping a part ----------------------------------------------------------------------------------

    def _listing(self, ref: CheckpointRef) -> tuple[Path, dict[str, tuple[int, int]]]:
        """Where a checkpoint's files are relative to, and each file's size and mtime_ns as they are now."""
        local = self.config.ckpt_dir / ref.name
        root, names = (local, part_files(local)) if ref.kind == "dir" else (local.parent, [local.name])
        listing = {}
        for name in names:
            try:
                stat = (root / name).stat()
            except FileNotFoundError:
                continue
            listing[name] = (stat.st_size, stat.st_mtime_ns)
        return root, listing

    def _ship(self, step: int, ref: CheckpointRef, version: int, own_part_required: bool) -> bool:
        """Upload this node's part of a checkpoint and its record; False when it changed or vanished locally
        meanwhile (the script's own retention, or a rewrite), which ships nothing."""
        config = self.config
        root, before = self._listing(ref)
        if own_part_required and not before:
            return self._gone(step, ref, version)
        started = time.monotonic()
        write_lease(config.sync_dir, UPLOAD_LEASE, step)
        try:
            files = call_with_retries(lambda: self.checkpoints.upload_files(root, step, sorted(before),
                                                                            config.attempt),
                                      f"upload of {config.ckpt_dir / ref.name}", self.config.retry)
        except (StorageError, OSError):
            if self._listing(ref)[1] != before:
                return self._gone(step, ref, version)
            raise
        finally:
            clear_lease(config.sync_dir, UPLOAD_LEASE)
        # Files deleted while they were listed or uploaded would leave the part short: only an unchanged part counts.
        if self._listing(ref)[1] != before or (ref.kind == "file" and not self._still_as_uploaded(root, files)):
            return self._gone(step, ref, version)
        replica_url = None
        if self.replica is not None:
            self.replica.publish(step, root, files)  # served before the record tells its holder to pull it
            replica_url = self.replica.url
        record = call_with_retries(lambda: self.checkpoints.write_record(step, config.node_rank, files,
                                                                         config.attempt, replica_url),
                                   f"upload record of step {step}", self.config.retry)
        seconds = time.monotonic() - started
        size = sum(entry.bytes for entry in record.files)
        self.state.shipped.append(Shipped(step=step, name=ref.name, version=version))
        self._save_state()
        if self.replica is not None:
            self.replica.shipped(step)  # background work: never raises
        emit(NodeEvent.UPLOADED, step=step, name=ref.name, node_rank=config.node_rank, files=len(record.files),
             bytes=size, seconds=round(seconds, 3),
             mb_per_s=round(size / 1e6 / seconds, 1) if seconds > 0 and size else None)
        return True

    @staticmethod
    def _still_as_uploaded(root: Path, files: list[FileEntry]) -> bool:
        """A file rewritten in place may be read mid-rewrite within one mtime tick: its bytes now, closed and whole,
        must be the bytes that were uploaded."""
        for entry in files:
            path = root / entry.path
            writing = files_open_for_writing(root) or set()
            if path.resolve() in writing or not file_is_whole(path) or sha256_file(path) != entry.sha256:
                return False
        return True

    def _gone(self, step: int, ref: CheckpointRef, version: int) -> bool:
        log.warning("%s: deleted or rewritten locally before it was uploaded: skipping step %d",
                    self.config.ckpt_dir / ref.name, step)
        self.gone.add((ref.name, version))
        emit(NodeEvent.SKIPPED, step=step, name=ref.name, reason="deleted or rewritten locally before upload")
        if self.is_coordinator:
            self._withdraw(step)  # its own part will never come: nobody waits for it
        return False

    def _withdraw(self, step: int) -> None:
        call_with_retries(lambda: self.checkpoints.withdraw(step), f"withdrawing step {step}", self.config.retry)

    def withdraw_unshipped(self) -> None:
        """On a (re)start, the coordinator's announcements it never shipped its part of came from an incarnation
        that died first: withdrawn, so no node waits for them. What is still complete is found and announced again."""
        listed = call_with_retries(lambda: self.checkpoints.announcements(self.config.attempt),
                                   "listing announcements", self.config.retry)
        for announcement in listed:
            if not self.state.has_step(announcement.step):
                log.info("withdrawing step %d (%s): announced before a restart, never shipped", announcement.step,
                         announcement.checkpoint.name)
                self._withdraw(announcement.step)

    # ---- the coordinator: find, number, announce, ship, commit --------------------------------------------

    def _number(self, found: Found) -> int:
        newest = self.state.newest_step
        if found.step is not None:
            return found.step
        reported = _last_metrics_step(self.config.metrics_file)
        if reported is not None and (newest is None or reported > newest):
            return reported
        return 0 if newest is None else newest + 1

    def find_and_ship(self) -> None:
        for found in self.detector.scan():
            if self.state.has(found.name, found.version) or (found.name, found.version) in self.gone:
                continue
            step = self._number(found)
            newest = self.state.newest_committed
            if (newest is not None and step <= newest) or self.state.has_step(step):
                # Older than what is committed (or already taken by an earlier version): nothing to ship.
                log.info("%s (step %d): not newer than committed step %s: not shipped", found.name, step, newest)
                self.state.shipped.append(Shipped(step=step, name=found.name, version=found.version))
                self._save_state()
                continue
            ref = CheckpointRef(name=found.name, kind=found.kind, format=found.format)
            # Folders are written by every node; a file checkpoint by global rank 0 alone.
            nodes = list(range(self.config.nodes)) if found.kind == "dir" else [0]
            # What every node's ranks must contribute, and every file the folder held when it was found complete.
            required = sorted({*required_files(found.path(self.config.ckpt_dir), self.config.world_size),
                               *found.files}) if found.kind == "dir" else []
            announcement = Announcement(step=step, checkpoint=ref, attempt=self.config.attempt, nodes=nodes,
                                        required=required, announced_at=time.time())
            call_with_retries(lambda a=announcement: self.checkpoints.announce(a),
                              f"announcement of step {step}", self.config.retry)
            self.state.newest_step = max(step, self.state.newest_step or step)
            emit(NodeEvent.ANNOUNCED, step=step, name=found.name, format=found.format, nodes=nodes)
            self._ship(step, ref, found.version, own_part_required=True)

    def commit_pending(self) -> list[int | str]:
        """Commit every announced step all of whose parts are in; returns the steps still waiting."""
        config = self.config
        waiting: list[int | str] = []
        for announcement in call_with_retries(lambda: self.checkpoints.announcements(config.attempt),
                                              "listing announcements", self.config.retry):
            step = announcement.step
            newest = self.state.newest_committed
            if newest is not None and step <= newest:
                continue  # superseded by a newer commit: retention removes it
            try:
                manifest = call_with_retries(
                    lambda a=announcement: self.checkpoints.try_commit(a.step, a.nodes, config.world_size,
                                                                       config.config_hash, a.attempt, a.checkpoint,
                                                                       a.required, config.lineage),
                    f"commit of {self.checkpoints.store.url_for(step_name(step))}",
                    self.config.retry,
                )
            except CheckpointError as exc:
                log.warning("%s", exc)
                emit(NodeEvent.ABANDONED, step=step, reason=str(exc))
                self._withdraw(step)
                continue
            if manifest is None:
                if not self._part_lost(announcement.step, announcement.nodes):
                    waiting.append(step)
                continue
            self.state.newest_committed = step
            self._save_state()
            emit(NodeEvent.COMMITTED, step=step, name=announcement.checkpoint.name, files=len(manifest.files),
                 bytes=manifest.total_bytes, commit_s=round(time.time() - announcement.announced_at, 3))
            deleted = call_with_retries(self._apply_retention, f"retention in {self.checkpoints.store.url}",
                                        self.config.retry)
            if deleted:
                emit(NodeEvent.RETENTION, deleted=deleted, keep=config.keep)
        return waiting

    def _part_lost(self, step: int, nodes: Sequence[int]) -> bool:
        """Whether a step can no longer be committed because a node the stop request names lost never uploaded its
        part: nothing to wait for (the head's syncer waited out the whole flush bound for it)."""
        lost = lost_ranks(self.config.stop_file)
        gone = sorted(set(self.checkpoints.missing_records(step, nodes, self.config.attempt)) & lost) if lost else []
        if gone and step not in self.lost_steps:
            self.lost_steps.add(step)
            log.warning("step %d cannot be committed: node(s) %s were lost before their part was uploaded", step,
                        ", ".join(map(str, gone)))
            emit(NodeEvent.UNCOMMITTABLE, step=step, lost=gone)
        return bool(gone)

    def _apply_retention(self) -> list[int]:
        """The store retention, never deleting a step a model alias points at or pointed at recently; skipped (and
        said) while the registry cannot be read: deleting without knowing could take production's checkpoint."""
        registry = Registry(self.config.registry_url or registry_root_of(self.config.url))
        try:
            protected = registry.protected(self.checkpoints.store.url)
        except RegistryError as exc:
            log.warning("retention skipped: %s", exc)
            emit(NodeEvent.RETENTION_SKIPPED, reason=str(exc))
            return []
        return self.checkpoints.apply_retention(self.config.keep, protected, self.config.attempt)

    # ---- every other node: ship its part of what the coordinator announced ----------------------------------

    def ship_announced(self) -> list[int | str]:
        """Ship this node's settled parts of announced checkpoints; returns the steps still to ship."""
        config = self.config
        pending: list[int | str] = []
        for announcement in call_with_retries(lambda: self.checkpoints.announcements(config.attempt),
                                              "listing announcements", self.config.retry):
            ref, step = announcement.checkpoint, announcement.step
            version = int(announcement.announced_at * 1e9)
            if config.node_rank not in announcement.nodes or self.state.has_step(step) or (ref.name, version) in \
                    self.gone:
                continue
            first_seen = self.first_seen.setdefault(step, time.monotonic())
            must_have = own_required(announcement.required, config.own_ranks)
            if (config.ckpt_dir / ref.name).exists() or must_have:
                # A part whose files are gone (deleted locally) never settles: that step is not committed.
                ready = part_settled(config.ckpt_dir, ref.name, ref.format, must_have)
            else:
                # Nothing of it here and nothing owed: this node's ranks wrote no file of this checkpoint.
                ready = time.monotonic() - first_seen >= EMPTY_PART_GRACE_S
            if not ready:
                pending.append(step)
                continue
            self._ship(step, ref, version, own_part_required=bool(must_have))
        return pending

    # ---- the loop -----------------------------------------------------------------------------------------

    def _should_stop(self) -> bool:
        return self.stop_requested.is_set() or (self.config.stop_file is not None and self.config.stop_file.exists())

    def _timeout_error(self, waiting: list[int | str]) -> str:
        if not self.is_coordinator:
            return (f"sync: node {self.config.node_rank}: still waiting for {waiting[0]} after "
                    f"{self.config.commit_timeout_s:g}s: check node 0's syncer (the coordinator)")
        step = int(waiting[-1])
        announcement = next((a for a in self.checkpoints.announcements(self.config.attempt) if a.step == step), None)
        nodes = announcement.nodes if announcement is not None else range(self.config.nodes)
        missing = self.checkpoints.missing_records(step, nodes, self.config.attempt)
        where = self.checkpoints.store.url_for(f"{step_name(step)}/_nodes")
        return (
            f"sync: step {step} not committed after {self.config.commit_timeout_s:g}s: no upload record from "
            f"node(s) {', '.join(map(str, missing))} under {where}: check those nodes' syncers"
        )

    def _saving(self, stopped_at: float | None) -> bool:
        """A save the script still had under way when the stop came is worth waiting for, within the deadline. So is
        one it has yet to start when the stop was a signal: a scheduler (Slurm's preemption, a KillWait) signals every
        process of the node at once, the trainer saves on the same SIGTERM, and its save must not find the syncer
        gone. A stop file comes once the trainer has stopped (the watcher, the orchestrator): nothing more to wait
        for."""
        if stopped_at is None or time.monotonic() - stopped_at > self.config.flush_deadline_s:
            return False
        if files_open_for_writing(self.config.ckpt_dir):
            return True
        return self.stop_requested.is_set() and node_trainer_running()

    def run(self) -> int:
        config = self.config
        stopped_at: float | None = None
        final_announced = False
        emit(NodeEvent.STARTED, node_rank=config.node_rank, url=config.url, coordinator=self.is_coordinator,
             attempt=config.attempt, format=config.format)
        if self.is_coordinator:
            self.withdraw_unshipped()
        while True:
            self.disk.check()  # said once; what is complete is still shipped
            # Read before scanning: every checkpoint complete when the stop was asked for is shipped first.
            stopping = self._should_stop()
            stopped_at = stopped_at if stopped_at is not None or not stopping else time.monotonic()
            done_saving = stopping and not self._saving(stopped_at)
            if self.is_coordinator:
                self.find_and_ship()
                if done_saving and not final_announced:
                    # Everything complete is announced: the other nodes may stop once their parts are in.
                    call_with_retries(lambda: self.checkpoints.announce_final(config.attempt),
                                      "final announcement", self.config.retry)
                    final_announced = True
                waiting = self.commit_pending()
            else:
                # Read before listing: the coordinator writes every announcement before the final one.
                final = done_saving and call_with_retries(lambda: self.checkpoints.is_final(config.attempt),
                                                          "reading the final announcement", self.config.retry)
                waiting = self.ship_announced()
                # A lost coordinator announces nothing more: what it announced is all there is to ship.
                if done_saving and not final and 0 not in lost_ranks(config.stop_file):
                    waiting = waiting or ["the coordinator's final announcement"]
            if stopping and not done_saving:
                self._pause()
                continue
            if stopping:
                if not waiting:
                    emit(NodeEvent.STOPPED, node_rank=config.node_rank,
                         shipped=sorted({s.step for s in self.state.shipped}),
                         newest_committed=self.state.newest_committed)
                    return 0
                # From the stop request, saves and uploads included: the orchestrator waits one bound from there.
                if time.monotonic() > stopped_at + config.commit_timeout_s:
                    return fail(self._timeout_error(waiting), EXIT_COMMIT_TIMEOUT)
            self._pause()

    def _pause(self) -> None:
        """One poll interval; a stop request cuts the wait short once. Once it is set, waiting on it would return at
        once, and a syncer waiting for other nodes' parts would read the store in a tight loop until its timeout."""
        if self.stop_requested.is_set():
            time.sleep(self.config.poll_s)
        else:
            self.stop_requested.wait(self.config.poll_s)


def sync_config(request: SyncRequest) -> SyncConfig:
    """The syncer's configuration from its request, with the lineage file it names read (SyncError: unreadable)."""
    lineage = None
    if request.lineage is not None:
        try:
            lineage = Lineage.model_validate_json(Path(request.lineage).read_bytes())
        except OSError as exc:
            raise SyncError(f"lineage {request.lineage}: {exc.strerror or exc}: check the path") from None
        except ValidationError as exc:
            raise SyncError(f"lineage {request.lineage}: not a Lineage ({exc.errors()[0]['msg']}): write it as the "
                            "train task does") from None
    replica = (ReplicaConfig(Path(request.replica_share_dir), Path(request.replica_dir), request.replica_serve)
               if request.replica_dir is not None and request.replica_share_dir is not None else None)
    return SyncConfig(
        ckpt_dir=Path(request.ckpt_dir), sync_dir=Path(request.sync_dir), url=request.url, node_rank=request.node_rank,
        nodes=request.nodes, procs_per_node=request.procs_per_node, attempt=request.attempt,
        config_hash=request.config_hash, keep=request.keep, format=request.format, poll_s=request.poll_s,
        stop_file=None if request.stop_file is None else Path(request.stop_file),
        commit_timeout_s=request.commit_timeout_s, flush_deadline_s=request.flush_deadline_s,
        metrics_file=None if request.metrics_file is None else Path(request.metrics_file), lineage=lineage,
        registry_url=request.registry_url, store_outage_s=request.store_outage_s, replica=replica)


def main(request: NodeRequest) -> int:
    try:
        config = sync_config(as_request(request, SyncRequest))
    except SyncError as exc:
        return fail(f"sync: {exc}", EXIT_BAD_REQUEST)
    disk = DiskWatch(config.node_rank, config.ckpt_dir)
    try:
        # The syncer may start before the script has saved anything.
        config.ckpt_dir.mkdir(parents=True, exist_ok=True)
        config.sync_dir.mkdir(parents=True, exist_ok=True)
        syncer = Syncer(config, CheckpointStore(open_store(config.url)), disk)

        def request_stop(signum: int, frame: FrameType | None) -> None:
            log.info("got signal %d: finishing uploads, then exiting", signum)
            syncer.stop_requested.set()

        signal.signal(signal.SIGTERM, request_stop)
        return syncer.run()
    except StorageError as exc:
        return fail(f"sync: {exc}", EXIT_STORE_FAILED)
    except (SyncError, CheckpointError) as exc:
        return fail(f"sync: {exc}")
    except OSError as exc:
        if is_disk_full(exc):
            return fail(f"sync: {disk.refused(exc).line()}", EXIT_DISK_FULL)
        return fail(f"sync: {exc.filename or config.ckpt_dir}: {exc.strerror or exc}: check the checkpoint dir")
