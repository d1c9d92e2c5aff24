"""`sync`: the node-side sidecar that uploads completed checkpoint steps while training goes on.

Every node uploads its own part of each step and then its upload record; the syncer of node rank 0 is the
committer: once every node's record of a step exists it writes the manifest (the commit), moves `latest`
and applies the store retention. What was uploaded is remembered in a state file in the checkpoint dir,
so a restarted (or killed) syncer resumes without uploading a step twice.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from infra.checkpoints import (
    SAVE_LEASE,
    UPLOAD_LEASE,
    CheckpointError,
    CheckpointStore,
    clear_lease,
    leased_step,
    step_name,
    write_lease,
)
from infra.node.events import emit, fail
from infra.storage import StorageError, open_store
from infra.storage.transfer import RetryPolicy, call_with_retries

log = logging.getLogger(__name__)

MARKER = re.compile(r"^step-(\d{8,})\.complete$")
EXIT_COMMIT_TIMEOUT = 2
# Longer than the transfer engine's per-request policy: this wraps whole steps, and a sidecar can afford to
# ride out a store outage of a minute or so rather than give up on a checkpoint.
STEP_RETRY = RetryPolicy(attempts=6, base_s=0.5, max_s=30.0)


class StepMarker(BaseModel):
    """`<ckpt_dir>/step-XXXXXXXX.complete`, written by the trainer once its part of the step is on disk."""

    model_config = ConfigDict(frozen=True)

    step: int = Field(ge=0)
    world_size: int = Field(ge=1)
    node_rank: int = Field(ge=0)
    files: list[str]


class SyncState(BaseModel):
    """What this node's syncer has done for one checkpoint URL; steps map to their marker's mtime_ns."""

    url: str
    node_rank: int
    uploaded: dict[int, int] = Field(default_factory=dict)
    newest_committed: int | None = None


@dataclass(frozen=True)
class SyncConfig:
    ckpt_dir: Path
    url: str
    node_rank: int
    nodes: int
    world_size: int
    config_hash: str
    keep: int
    poll_s: float
    stop_file: Path | None
    commit_timeout_s: float
    flush_deadline_s: float = 20.0

    @property
    def state_path(self) -> Path:
        return state_path(self.ckpt_dir, self.node_rank)


class SyncError(Exception):
    """A permanent failure of the syncer; the message is one line naming the thing and the fix."""


def state_path(ckpt_dir: Path, node_rank: int) -> Path:
    """The node's sync state file; a trainer in checkpoint mode direct reads it to wait for its uploads."""
    return ckpt_dir / f".sync-state-node-{node_rank}.json"


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


class Syncer:
    def __init__(self, config: SyncConfig, checkpoints: CheckpointStore) -> None:
        self.config = config
        self.checkpoints = checkpoints
        self.state = self._load_state()
        self.skipped: set[tuple[int, int]] = set()  # (step, marker mtime_ns): pruned before upload
        # An Event rather than a flag so a stop request (SIGTERM) also cuts the poll sleep short.
        self.stop_requested = threading.Event()
        self.waited_for: set[int] = set()  # trainer saves a stop already waited for (logged once each)

    # ---- state --------------------------------------------------------------------------------------------

    def _load_state(self) -> SyncState:
        path = self.config.state_path
        fresh = SyncState(url=self.config.url, node_rank=self.config.node_rank)
        state = read_state(path)
        if state is None:
            return fresh
        if state.url != self.config.url or state.node_rank != self.config.node_rank:
            # A checkpoint dir reused by another run: its uploads went elsewhere, so they do not count here.
            log.info("%s: state is for %s node %d: starting fresh", path, state.url, state.node_rank)
            return fresh
        return state

    def _save_state(self) -> None:
        path = self.config.state_path
        temp = path.with_name(path.name + ".tmp")
        temp.write_text(self.state.model_dump_json())
        os.replace(temp, path)

    # ---- local steps --------------------------------------------------------------------------------------

    def _complete_steps(self) -> dict[int, Path]:
        """Steps whose marker exists locally, keyed by step, with the marker path."""
        found = {}
        for entry in os.scandir(self.config.ckpt_dir):
            match = MARKER.match(entry.name)
            if match:
                found[int(match.group(1))] = Path(entry.path)
        return found

    def _read_marker(self, step: int, path: Path) -> StepMarker | None:
        """The marker, or None when local retention removed it after it was listed."""
        try:
            marker = StepMarker.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except ValidationError as exc:
            raise SyncError(
                f"{path}: corrupt step marker ({exc.errors()[0]['msg']}): "
                "the trainer writes markers atomically; delete it if the step is damaged"
            ) from None
        problems = [
            f"step {marker.step} (file name says {step})" if marker.step != step else "",
            f"node_rank {marker.node_rank} (--node-rank is {self.config.node_rank})"
            if marker.node_rank != self.config.node_rank
            else "",
            f"world_size {marker.world_size} (--world-size is {self.config.world_size})"
            if marker.world_size != self.config.world_size
            else "",
        ]
        if any(problems):
            raise SyncError(
                f"{path}: marker says {', '.join(p for p in problems if p)}: "
                "point --ckpt-dir at this node's checkpoint dir and pass this job's ranks"
            )
        return marker

    @staticmethod
    def _mtime_ns(path: Path) -> int | None:
        try:
            return path.stat().st_mtime_ns
        except FileNotFoundError:
            return None

    # ---- uploading ----------------------------------------------------------------------------------------

    def upload_pending(self) -> None:
        """Upload every locally complete step this node has not uploaded yet, oldest first."""
        complete = self._complete_steps()
        self._forget_removed_steps(complete)
        newest = self.state.newest_committed
        for step, marker_path in sorted(complete.items()):
            if newest is not None and step <= newest:
                continue  # committed, or superseded by a newer commit (the committer forgot its upload)
            mtime_ns = self._mtime_ns(marker_path)
            # A re-written marker (the trainer saved this step again after a resume) is a new upload.
            if mtime_ns is None or (step, mtime_ns) in self.skipped or self.state.uploaded.get(step) == mtime_ns:
                continue
            marker = self._read_marker(step, marker_path)
            if marker is not None:
                self._upload_step(marker, marker_path, mtime_ns)

    def _forget_removed_steps(self, complete: dict[int, Path]) -> None:
        # Local retention removed these markers; the committer still needs its uploads it has not committed.
        newest = self.state.newest_committed
        keep_pending = self.config.node_rank == 0
        gone = [
            step
            for step in self.state.uploaded
            if step not in complete and not (keep_pending and (newest is None or step > newest))
        ]
        for step in gone:
            del self.state.uploaded[step]
        if gone:
            self._save_state()

    def _skip(self, step: int, mtime_ns: int, step_dir: Path) -> None:
        log.warning(
            "%s: deleted by local retention before upload (a newer step is complete): skipping step %d", step_dir, step
        )
        self.skipped.add((step, mtime_ns))
        emit("skipped", step=step, reason="deleted locally before upload")

    def _upload_step(self, marker: StepMarker, marker_path: Path, mtime_ns: int) -> None:
        step_dir = self.config.ckpt_dir / step_name(marker.step)
        if not step_dir.is_dir():
            self._skip(marker.step, mtime_ns, step_dir)
            return
        started = time.monotonic()
        # The lease keeps the trainer's local retention off this step while it uploads (see UPLOAD_LEASE).
        write_lease(self.config.ckpt_dir, UPLOAD_LEASE, marker.step)
        try:
            record = call_with_retries(
                lambda: self.checkpoints.upload_node_part(step_dir, marker.step, self.config.node_rank, marker.files),
                f"upload of {step_dir}",
                STEP_RETRY,
            )
        except (StorageError, OSError):
            # Local retention removes the marker before the dir, so a missing marker means "pruned", even
            # while the dir is still being deleted (it got there between the listing and the lease).
            if not (marker_path.exists() and step_dir.is_dir()):
                self._skip(marker.step, mtime_ns, step_dir)
                return
            raise
        finally:
            clear_lease(self.config.ckpt_dir, UPLOAD_LEASE)
        seconds = time.monotonic() - started
        size = sum(entry.bytes for entry in record.files)
        self.state.uploaded[marker.step] = mtime_ns
        self._save_state()
        emit(
            "uploaded",
            step=marker.step,
            node_rank=self.config.node_rank,
            files=len(record.files),
            bytes=size,
            seconds=round(seconds, 3),
            mb_per_s=round(size / 1e6 / seconds, 1) if seconds > 0 else None,
        )

    # ---- committing (node rank 0) -------------------------------------------------------------------------

    def pending_commits(self) -> list[int]:
        """Steps this node uploaded that are newer than the newest commit (older ones are superseded)."""
        newest = self.state.newest_committed
        return sorted(step for step in self.state.uploaded if newest is None or step > newest)

    def commit_pending(self) -> None:
        config = self.config
        for step in self.pending_commits():
            manifest = call_with_retries(
                lambda step=step: self.checkpoints.try_commit(
                    step, config.nodes, config.world_size, config.config_hash
                ),
                f"commit of {self.checkpoints.store.url_for(step_name(step))}",
                STEP_RETRY,
            )
            if manifest is None:
                continue
            self.state.newest_committed = step
            self._forget_old_steps()
            self._save_state()
            # Measured from the moment the trainer marked the step complete: what async checkpointing costs.
            commit_s = time.time() - self.state.uploaded[step] / 1e9
            emit(
                "committed",
                step=step,
                files=len(manifest.files),
                bytes=manifest.total_bytes,
                commit_s=round(commit_s, 3),
            )
            deleted = call_with_retries(
                lambda: self.checkpoints.apply_retention(config.keep),
                f"retention in {self.checkpoints.store.url}",
                STEP_RETRY,
            )
            if deleted:
                emit("retention", deleted=deleted, keep=config.keep)

    def _forget_old_steps(self) -> None:
        # Uploads older than the newest commit will never be committed, so the state need not grow with them.
        newest = self.state.newest_committed
        if newest is not None:
            self.state.uploaded = {step: ns for step, ns in self.state.uploaded.items() if step >= newest}

    # ---- the loop -----------------------------------------------------------------------------------------

    def _should_stop(self) -> bool:
        return self.stop_requested.is_set() or (self.config.stop_file is not None and self.config.stop_file.exists())

    def _commit_timeout_error(self, waiting: list[int]) -> str:
        step = waiting[-1]
        missing = self.checkpoints.missing_records(step, self.config.nodes)
        where = self.checkpoints.store.url_for(f"{step_name(step)}/_nodes")
        return (
            f"sync: step {step} not committed after {self.config.commit_timeout_s:g}s: no upload record from "
            f"node(s) {', '.join(map(str, missing))} under {where}: check those nodes' syncers"
        )

    def _trainer_still_saving(self, stopped_at: float) -> bool:
        """A save the trainer had under way when the stop came is worth waiting for, within the flush deadline."""
        if time.monotonic() - stopped_at > self.config.flush_deadline_s:
            return False
        step = leased_step(self.config.ckpt_dir, SAVE_LEASE)
        if step is not None and step not in self.waited_for:
            self.waited_for.add(step)
            log.info("stopping: waiting up to %.0fs for the trainer's save of step %d", self.config.flush_deadline_s,
                     step)
        return step is not None

    def run(self) -> int:
        is_committer = self.config.node_rank == 0
        deadline: float | None = None
        stopped_at: float | None = None
        emit("started", node_rank=self.config.node_rank, url=self.config.url, committer=is_committer)
        while True:
            # Read before scanning: every step complete when the stop was asked for is uploaded first. The
            # trainer writes a step's marker before it drops its save lease, so a lease gone here means the
            # marker is there for the scan below.
            stopping = self._should_stop()
            stopped_at = stopped_at if stopped_at is not None or not stopping else time.monotonic()
            saving = stopped_at is not None and self._trainer_still_saving(stopped_at)
            self.upload_pending()
            if is_committer:
                self.commit_pending()
            if saving:
                time.sleep(self.config.poll_s)  # the stop event is set, so waiting on it would not pause
                continue
            if stopping:
                waiting = self.pending_commits() if is_committer else []
                if not waiting:
                    emit(
                        "stopped",
                        node_rank=self.config.node_rank,
                        uploaded=sorted(self.state.uploaded),
                        newest_committed=self.state.newest_committed,
                    )
                    return 0
                deadline = deadline if deadline is not None else time.monotonic() + self.config.commit_timeout_s
                if time.monotonic() > deadline:
                    return fail(self._commit_timeout_error(waiting), EXIT_COMMIT_TIMEOUT)
            self.stop_requested.wait(self.config.poll_s)


def _parse(argv: list[str]) -> SyncConfig:
    parser = argparse.ArgumentParser(prog="python -m infra.node sync", description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True, type=Path, help="this node's local checkpoint dir")
    parser.add_argument("--url", required=True, help="the run's checkpoint root URL")
    parser.add_argument("--node-rank", required=True, type=int)
    parser.add_argument("--nodes", required=True, type=int, help="nodes whose records a commit needs")
    parser.add_argument("--world-size", required=True, type=int, help="training processes in all")
    parser.add_argument("--config-hash", required=True, help="recorded in each manifest (JobSpec.config_hash())")
    parser.add_argument("--keep", required=True, type=int, help="committed checkpoints kept in the store")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between scans of --ckpt-dir")
    parser.add_argument("--stop-file", type=Path, help="finish uploading and exit once this file exists")
    parser.add_argument(
        "--commit-timeout", type=float, default=600.0, help="on stop, node 0 waits this long for other nodes' records"
    )
    parser.add_argument(
        "--flush-deadline", type=float, default=20.0, help="on stop, wait this long for a save under way"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.node_rank < args.nodes:
        parser.error(f"--node-rank {args.node_rank}: must be in [0, --nodes={args.nodes})")
    if args.poll <= 0 or args.commit_timeout < 0 or args.flush_deadline < 0:
        parser.error(
            f"--poll {args.poll:g} / --commit-timeout {args.commit_timeout:g} / --flush-deadline "
            f"{args.flush_deadline:g}: use a poll > 0 and timeouts >= 0"
        )
    if args.keep < 1:
        parser.error(f"--keep {args.keep}: must be at least 1 (the newest committed checkpoint is never deleted)")
    return SyncConfig(
        ckpt_dir=args.ckpt_dir,
        url=args.url,
        node_rank=args.node_rank,
        nodes=args.nodes,
        world_size=args.world_size,
        config_hash=args.config_hash,
        keep=args.keep,
        poll_s=args.poll,
        stop_file=args.stop_file,
        commit_timeout_s=args.commit_timeout,
        flush_deadline_s=args.flush_deadline,
    )


def main(argv: list[str]) -> int:
    config = _parse(argv)
    try:
        # The syncer may start before the trainer has saved anything; the dir also holds the syncer's state.
        config.ckpt_dir.mkdir(parents=True, exist_ok=True)
        syncer = Syncer(config, CheckpointStore(open_store(config.url)))

        def request_stop(signum: int, frame: FrameType | None) -> None:
            log.info("got signal %d: finishing uploads, then exiting", signum)
            syncer.stop_requested.set()

        signal.signal(signal.SIGTERM, request_stop)
        return syncer.run()
    except (SyncError, CheckpointError, StorageError) as exc:
        return fail(f"sync: {exc}")
    except OSError as exc:
        return fail(f"sync: {exc.filename or config.ckpt_dir}: {exc.strerror or exc}: check the checkpoint dir")
