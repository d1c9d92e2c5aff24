"""Checkpoint replicas on peers: each node keeps a copy of its ring buddy's part of the newest committed checkpoint,
so a restore after losing one node takes the lost node's part from a survivor instead of the store.

Node k's buddy is node (k-1) mod N; so node w's part is replicated on node (w+1) mod N (replica_holder). After a
node's syncer has uploaded its part of a step, it hard-links those files into the node's share dir (what its
`peer-serve` serves) under their checksums' names (infra/node/fanout.py's share_name): the copy the buddy reads is
stable even when the script deletes its checkpoint. As soon as the buddy's upload record of that step is in the
store (not once the step is committed: a node preempted right after its last save, on a notice, is gone before that
commits), the node pulls the buddy's files of it (the record lists them) from the buddy's peer server (the record names
it too) over the cluster network, verifies each against the record's checksum like a store's byte, and keeps them under
<workdir>/replica/step-N/ (never in the script's checkpoint dir); only the two newest replicas are kept (the newest
may yet be abandoned). A restore holds a replica to the commit's manifest. The store is read only for the records:
its egress does not grow with the checkpoint.

During training the node's part is served by a `peer-serve` the syncer starts (replica_serve: the node's cluster
address, on a port picked free when the syncer starts, so two clusters on one host never collide; per-run
credentials), which every upload record of the node names (`replica_url`). It is watched by the replica thread
(restarted, on the same port, when it dies) and killed with the syncer (a parent-death signal), so the syncer, itself
watched by the orchestrator, is the one sidecar to watch.

This is background work on two threads: the pulls on one (a pull may wait up to COMMIT_WAIT_S for the buddy's record,
then download a whole part), and the checks of the peer server and of the pull thread on the other, every
SERVER_CHECK_S whatever a pull is doing. A failure is logged and emitted (`replica-failed`), never fatal to training
(the store still has every byte; a restore without the replica reads the lost part from there); close() cancels a
pull at its next file or record poll.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from infra.checkpoints.layout import CheckpointError, FileEntry, NodeRecord
from infra.checkpoints.steps import step_name
from infra.checkpoints.store import CheckpointStore
from infra.dataset.manifest import DatasetError
from infra.dataset.stagecache import link_into
from infra.node.events import NodeEvent, emit
from infra.node.fanout import share_name
from infra.node.ports import free_port
from infra.node.protocol import PeerServeRequest
from infra.storage.base import StorageError
from infra.storage.http import HttpStore
from infra.storage.transfer import FileSpec, download

log = logging.getLogger(__name__)

REPLICA_DIR = "replica"  # under the node's workdir; and under its share dir, what its replica holder reads
COMMIT_WAIT_S = 900.0  # how long a shipped step's buddy part is waited for before its replica is given up
RECORD_POLL_S = 0.25  # how often the buddy's upload record is looked for: one small GET
_INCOMING = ".incoming"
SERVER_CHECK_S = 5.0  # how often the replica thread checks its peer server
SERVER_RESTARTS = 5  # then replicas of this node's part are given up (said), training goes on
REPLICAS_KEPT = 2  # steps of the buddy's part kept, and of this node's own part served (the newest may be abandoned)


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
    share_dir: Path
    replica_dir: Path
    serve_host: str | None = None  # serve share_dir on this address during training (peer-serve); None: serve none


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child of a fork must not import or load
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the server's child before exec: SIGTERM once the thread that started it ends, which is the syncer's end
    (its main thread, or its replica thread, which lives as long as the process); kept across exec."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Replicator:
    """Node `rank`'s replica of its buddy's part; publish() and shipped() are the syncer's hooks and never raise."""

    def __init__(self, rank: int, nodes: int, checkpoints: CheckpointStore, config: ReplicaConfig, attempt: str,
                 commit_wait_s: float = COMMIT_WAIT_S) -> None:
        self.rank = rank
        self.attempt = attempt
        self.buddy = buddy(rank, nodes)
        self.checkpoints = checkpoints
        self.share_dir = config.share_dir
        self.published_dir = config.share_dir / REPLICA_DIR
        self.replica_dir = config.replica_dir
        self.server: subprocess.Popen[bytes] | None = None
        self._server_restarts = 0
        self.commit_wait_s = commit_wait_s
        # Daemon threads: bounded background work that never holds up the syncer's exit (a pull cut short leaves
        # only a .partial dir, replaced by the next one).
        self._steps: queue.Queue[int] = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self._published: dict[int, list[str]] = {}  # step -> share names this node linked for it
        self._newest = -1
        self._closed = threading.Event()
        self.serve_addr = self._free_addr(config.serve_host) if config.serve_host else None
        if self.serve_addr is not None:
            self._serve()
            emit(NodeEvent.REPLICA_SERVING, url=self.url)
        self._puller = self._start_puller()
        self._puller_restarts = 0
        threading.Thread(target=self._watch, name=f"replica-watch-{rank}", daemon=True).start()

    @property
    def url(self) -> str | None:
        """Where this node serves its part (what its upload records name); None: it serves none."""
        return f"http://{self.serve_addr}" if self.serve_addr is not None else None

    def _free_addr(self, host: str) -> str | None:
        # Picked once and kept: a restarted server binds it again, so the records already written stay right.
        try:
            return f"{host}:{free_port(host)}"
        except OSError as exc:
            self._failed(self._newest, f"no free port on {host} ({exc.strerror}): this node's part is not served to "
                         "its replica holder")
            return None

    def publish(self, step: int, root: Path, files: list[FileEntry]) -> None:
        """This node's part of `step` is uploaded (files relative to root): serve it. Called before its upload record
        is written, which is the replica holder's cue to pull it. Never raises."""
        try:
            self._publish(step, root, files)
        except OSError as exc:
            self._failed(step, f"publishing its own part: {exc}")

    def shipped(self, step: int) -> None:
        """This node's upload record of `step` is in the store: replicate the buddy's part of it, in the background."""
        self._newest = max(self._newest, step)
        with self._idle:
            self._pending += 1
        self._steps.put(step)

    def close(self) -> None:
        self._closed.set()
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()

    def _serve(self) -> None:
        # stderr is the syncer's (its log): rclone's complaints land beside the syncer's own.
        # The syncer's environment holds the server's credentials (peer_credentials), passed on with the request.
        request = PeerServeRequest(dir=str(self.share_dir), addr=str(self.serve_addr))
        self.server = subprocess.Popen(request.command_line(sys.executable), env=request.environment(os.environ),
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       preexec_fn=_die_with_parent)

    def _check_server(self) -> None:
        if self.server is None or self._closed.is_set() or (code := self.server.poll()) is None:
            return
        if self._server_restarts >= SERVER_RESTARTS:
            self._failed(self._newest, f"its peer server exited {code} {self._server_restarts + 1} times: this "
                         "node's part is no longer served to its replica holder")
            self.server = None
            return
        self._server_restarts += 1
        log.warning("replica peer server on %s exited %s: restarting it (%d/%d)", self.serve_addr, code,
                    self._server_restarts, SERVER_RESTARTS)
        emit(NodeEvent.REPLICA_SERVER_RESTARTED, addr=self.serve_addr, code=code, restarts=self._server_restarts)
        self._serve()

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every queued pull finished within timeout_s."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def _start_puller(self) -> threading.Thread:
        puller = threading.Thread(target=self._pull_queued, name=f"replica-{self.rank}", daemon=True)
        puller.start()
        return puller

    def _watch(self) -> None:
        """The checks, on a thread of their own: a pull holds its thread for up to commit_wait_s and longer."""
        while True:
            self._check_server()
            self._check_puller()
            if self._closed.wait(SERVER_CHECK_S):
                return

    def _check_puller(self) -> None:
        """A pull thread that ended (_pull_logged keeps every error of a pull from ending it: only something that
        ends a thread itself does) is said and started again; the steps queued meanwhile wait for it."""
        if self._closed.is_set() or self._puller.is_alive():
            return
        self._puller_restarts += 1
        self._failed(self._newest, f"the replica pull thread ended: started again ({self._puller_restarts})")
        self._puller = self._start_puller()

    def _pull_queued(self) -> None:
        while True:
            step = self._steps.get()
            try:
                self._pull_logged(step)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _publish(self, step: int, root: Path, files: list[FileEntry]) -> None:
        self.published_dir.mkdir(parents=True, exist_ok=True)  # a node may have written nothing of a step
        names = []
        for entry in files:
            name = share_name(str(entry.checksum))
            link_into(root / entry.path, self.published_dir / name)
            names.append(name)
        self._published[step] = names
        # The previous step stays served: a replica holder may still be pulling it while this one commits. Links
        # of older steps (of an earlier syncer too) go: they would keep files the script deleted on the disk.
        for old in sorted(self._published)[:-REPLICAS_KEPT]:
            del self._published[old]
        keep = {name for names in self._published.values() for name in names}
        for path in self.published_dir.iterdir():
            if path.name not in keep:
                path.unlink(missing_ok=True)

    def _failed(self, step: int, reason: str) -> None:
        log.warning("replica of step %d (node %d's part): %s: a restore would read that part from the store",
                    step, self.buddy, reason)
        emit(NodeEvent.REPLICA_FAILED, step=step, buddy=self.buddy, reason=reason)

    def _pull_logged(self, step: int) -> None:
        try:
            self.pull(step)
        except (CheckpointError, StorageError, DatasetError, OSError) as exc:
            self._failed(step, str(exc))
        except Exception as exc:  # a bug here must not end the thread: every later step would go unreplicated
            log.exception("replica of step %d", step)
            self._failed(step, f"{type(exc).__name__}: {exc}")

    def _buddy_part(self, step: int) -> NodeRecord | None:
        """The buddy's upload record of `step` (its files, and where it serves them), once it is in: pulled then, not
        after the commit (a node preempted just after its last save, on a notice, is gone before that commits, and its
        part with it). None when a newer step came first or the record never comes in time. A restore holds the
        replica to the commit's manifest all the same."""
        deadline = time.monotonic() + self.commit_wait_s
        while not self._closed.is_set() and step == self._newest:
            record = self.checkpoints.current_record(step, self.buddy, self.attempt)
            if record is not None:
                return record
            if time.monotonic() >= deadline:
                self._failed(step, f"node {self.buddy}'s part not uploaded within {self.commit_wait_s:g}s")
                return None
            self._closed.wait(RECORD_POLL_S)
        return None

    def pull(self, step: int) -> int | None:
        """Replicate the buddy's uploaded files of `step`; returns their bytes (None: superseded, never uploaded, or
        cancelled by close())."""
        record = self._buddy_part(step)
        if record is None:
            return None
        if record.replica_url is None:
            raise CheckpointError(f"node {self.buddy}'s upload record of step {step} names no replica server: it "
                                  "runs without replica_serve")
        peer, files = HttpStore(record.replica_url), record.files
        started = time.monotonic()
        partial = self.replica_dir / f".{step_name(step)}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        incoming = partial / _INCOMING
        for entry in files:
            if self._closed.is_set():
                return None  # the syncer is ending: the .partial dir is replaced by the next pull
            name = share_name(str(entry.checksum))
            # Verified against the record's checksum by the transfer engine, as a store's byte is.
            key = f"{REPLICA_DIR}/{name}"
            download(peer, [FileSpec(key, entry.bytes, entry.sha256, entry.crc)], incoming)
            target = partial / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(incoming / key, target)
        shutil.rmtree(incoming, ignore_errors=True)
        final = self.replica_dir / step_name(step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        # The step before stays until this one is committed too: this one may yet be abandoned.
        kept = {final, *sorted((d for d in self.replica_dir.iterdir() if d.name.startswith("step-") and d != final),
                               reverse=True)[:REPLICAS_KEPT - 1]}
        for other in self.replica_dir.iterdir():
            if other not in kept:
                shutil.rmtree(other, ignore_errors=True)
        size = sum(entry.bytes for entry in files)
        emit(NodeEvent.REPLICA, step=step, buddy=self.buddy, files=len(files), bytes=size,
             seconds=round(time.monotonic() - started, 3))
        return size
