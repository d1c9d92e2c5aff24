"""Checkpoint replicas on peers: each node keeps a copy of its ring buddy's part of the newest committed checkpoint,
so a restore after losing one node takes the lost node's part from a survivor instead of the store.

Node k's buddy is node (k-1) mod N; so node w's part is replicated on node (w+1) mod N (replica_holder). After a
node's syncer has uploaded its part of a step, it hard-links those files into the node's share dir (what its
`peer-serve` serves) under their checksums' names (infra/node/fanout.py's share_name): the copy the buddy reads is
stable even when the script deletes its checkpoint. Once that step is committed, the node pulls its buddy's files of
it (the commit's upload records say which rank wrote which file) from the buddy's peer server over the cluster
network, verifies each against the manifest's checksum like a store's byte, and keeps them under
<workdir>/replica/step-N/ (never in the script's checkpoint dir); an older replica is dropped once the new one is
whole. The store is read only for the manifest and the records: its egress does not grow with the checkpoint.

This is background work on one thread: a failure is logged and emitted (`replica-failed`), never fatal to training
(the store still has every byte; a restore without the replica reads the lost part from there).
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from infra.checkpoints.commit import CheckpointError, CheckpointManifest, CheckpointStore, FileEntry
from infra.checkpoints.steps import step_name
from infra.dataset.manifest import DatasetError
from infra.dataset.stagecache import link_into
from infra.node.events import emit
from infra.node.fanout import share_name
from infra.storage.base import StorageError
from infra.storage.http import HttpStore
from infra.storage.transfer import FileSpec, download

log = logging.getLogger(__name__)

REPLICA_DIR = "replica"  # under the node's workdir
COMMIT_WAIT_S = 900.0  # how long a shipped step is waited for to commit before its replica is given up
_POLL_FIRST_S, _POLL_MAX_S = 0.5, 10.0
_INCOMING = ".incoming"


def buddy(rank: int, nodes: int) -> int:
    """Whose part node `rank` replicates."""
    return (rank - 1) % nodes


def replica_holder(writer: int, nodes: int) -> int:
    """The node that keeps a replica of node `writer`'s part."""
    return (writer + 1) % nodes


def replica_path(replica_dir: Path, step: int, path: str) -> Path:
    return replica_dir / step_name(step) / path


@dataclass(frozen=True)
class ReplicaConfig:
    buddy_url: str
    share_dir: Path
    replica_dir: Path


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica-buddy", help="peer replica: the buddy node's peer server URL (rank-1 mod nodes); "
                        "credentials in TRAINPIPE_PEER_USER/TRAINPIPE_PEER_PASS")
    parser.add_argument("--replica-dir", type=Path, help="peer replica: where the buddy's part is kept "
                        "(<workdir>/replica)")
    parser.add_argument("--replica-share-dir", type=Path, help="peer replica: the dir this node's peer server serves: "
                        "its own uploaded part is linked there for its replica holder")


def replica_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ReplicaConfig | None:
    given = [args.replica_buddy, args.replica_dir, args.replica_share_dir]
    if not any(given):
        return None
    if not all(given):
        parser.error("--replica-buddy, --replica-dir and --replica-share-dir go together: give all three (peer "
                     "replica) or none")
    return ReplicaConfig(args.replica_buddy, args.replica_share_dir, args.replica_dir)


class Replicator:
    """Node `rank`'s replica of its buddy's part; shipped() is the syncer's hook and never raises."""

    def __init__(self, rank: int, nodes: int, checkpoints: CheckpointStore, config: ReplicaConfig,
                 commit_wait_s: float = COMMIT_WAIT_S) -> None:
        self.rank = rank
        self.buddy = buddy(rank, nodes)
        self.checkpoints = checkpoints
        self.peer = HttpStore(config.buddy_url)
        self.share_dir = config.share_dir
        self.replica_dir = config.replica_dir
        self.commit_wait_s = commit_wait_s
        # One daemon thread: bounded background work that never holds up the syncer's exit (a pull cut short leaves
        # only a .partial dir, replaced by the next one).
        self._steps: queue.Queue[int] = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        threading.Thread(target=self._work, name=f"replica-{rank}", daemon=True).start()
        self._published: dict[int, list[str]] = {}  # step -> share names this node linked for it
        self._newest = -1
        self._closed = threading.Event()

    def shipped(self, step: int, root: Path, files: list[FileEntry]) -> None:
        """This node's part of `step` is uploaded (files relative to root): serve it, then replicate the buddy's."""
        self._newest = max(self._newest, step)
        try:
            self._publish(step, root, files)
        except OSError as exc:
            self._failed(step, f"publishing its own part: {exc}")
        with self._idle:
            self._pending += 1
        self._steps.put(step)

    def close(self) -> None:
        self._closed.set()

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every queued pull finished within timeout_s."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def _work(self) -> None:
        while True:
            step = self._steps.get()
            try:
                self._pull_logged(step)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _publish(self, step: int, root: Path, files: list[FileEntry]) -> None:
        names = []
        for entry in files:
            name = share_name(str(entry.checksum))
            link_into(root / entry.path, self.share_dir / name)
            names.append(name)
        self._published[step] = names
        # The previous step stays served: a replica holder may still be pulling it while this one commits.
        keep = {name for s in sorted(self._published)[-2:] for name in self._published[s]}
        for old in sorted(self._published)[:-2]:
            for name in self._published.pop(old):
                if name not in keep:
                    (self.share_dir / name).unlink(missing_ok=True)

    def _failed(self, step: int, reason: str) -> None:
        log.warning("replica of step %d (node %d's part): %s: a restore would read that part from the store",
                    step, self.buddy, reason)
        emit("replica-failed", step=step, buddy=self.buddy, reason=reason)

    def _pull_logged(self, step: int) -> None:
        try:
            self.pull(step)
        except (CheckpointError, StorageError, DatasetError, OSError) as exc:
            self._failed(step, str(exc))
        except Exception as exc:  # a bug here must not end the thread: every later step would go unreplicated
            log.exception("replica of step %d", step)
            self._failed(step, f"{type(exc).__name__}: {exc}")

    def _committed(self, step: int) -> CheckpointManifest | None:
        """The step's manifest once committed; None when a newer step came first or it never commits in time."""
        deadline = time.monotonic() + self.commit_wait_s
        delay = _POLL_FIRST_S
        while not self._closed.is_set() and step == self._newest:
            try:
                return self.checkpoints.manifest(step)
            except CheckpointError:
                pass  # not committed yet
            if time.monotonic() >= deadline:
                self._failed(step, f"not committed within {self.commit_wait_s:g}s")
                return None
            self._closed.wait(delay)
            delay = min(_POLL_MAX_S, delay * 2)
        return None

    def pull(self, step: int) -> int | None:
        """Replicate the buddy's files of committed `step`; returns their bytes (None: superseded or not committed)."""
        manifest = self._committed(step)
        if manifest is None:
            return None
        started = time.monotonic()
        wrote = self.checkpoints.uploaders(manifest)
        files = [entry for entry in manifest.files if wrote.get(entry.path) == self.buddy]
        partial = self.replica_dir / f".{step_name(step)}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        incoming = partial / _INCOMING
        for entry in files:
            name = share_name(str(entry.checksum))
            # Verified against the manifest's checksum by the transfer engine, as a store's byte is.
            download(self.peer, [FileSpec(name, entry.bytes, entry.sha256, entry.crc)], incoming)
            target = partial / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(incoming / name, target)
        shutil.rmtree(incoming, ignore_errors=True)
        final = self.replica_dir / step_name(step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for other in self.replica_dir.iterdir():
            if other != final:
                shutil.rmtree(other, ignore_errors=True)
        size = sum(entry.bytes for entry in files)
        emit("replica", step=step, buddy=self.buddy, files=len(files), bytes=size,
             seconds=round(time.monotonic() - started, 3))
        return size
