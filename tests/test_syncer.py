"""The node-side syncer as real processes on file:// stores: the coordinator announces, every node ships its part,
the commit takes only the current attempt's records, restored checkpoints are never shipped again."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from test_checkpoints import CONFIG_HASH, make_step, node_dirs

from infra.checkpoints.formats import Detector
from infra.checkpoints.layout import Announcement, CheckpointRef
from infra.checkpoints.steps import step_name
from infra.checkpoints.store import CheckpointStore
from infra.node import restore
from infra.node.events import Event, NodeEvent, parse
from infra.node.processes import NODE_TAG
from infra.node.protocol import AGENT_MODULE, NodeCommand, RestoreRequest, SyncRequest
from infra.node.sync import SyncConfig, Syncer, stop_request
from infra.storage import open_store

STOP_RECEIVED = "got signal 15: finishing uploads"
TORCHRUN_ARGV = ["-m", AGENT_MODULE, NodeCommand.TORCHRUN.value]  # what marks a node's trainer


@pytest.fixture
def checkpoints(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(open_store(f"file://{tmp_path / 'store' / 'run-1'}"))


class SyncProcess:
    def __init__(self, tmp_path: Path, ckpt_dir: Path, url: str, node_rank: int, *, nodes: int = 2, keep: int = 2,
                 attempt: str = "a1", fmt: str = "marker", env: dict[str, str] | None = None, **fields: Any) -> None:
        """fields: the SyncRequest's other fields (stop_file, commit_timeout_s, ...)."""
        runs = len(list(tmp_path.glob(f"sync-{node_rank}-*.out")))
        self.out = tmp_path / f"sync-{node_rank}-{runs}.out"
        self.err = tmp_path / f"sync-{node_rank}-{runs}.err"
        self.sync_dir = ckpt_dir.parent / "sync"
        request = SyncRequest(**{"ckpt_dir": str(ckpt_dir), "sync_dir": str(self.sync_dir), "url": url,
                                 "node_rank": node_rank, "nodes": nodes, "attempt": attempt,
                                 "config_hash": CONFIG_HASH, "keep": keep, "format": fmt, "poll_s": 0.1, **fields})
        # `python -m infra.node sync` as a node runs it: its log lines (a stop request received) are events too.
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(request.command_line(sys.executable), stdout=out, stderr=err,
                                         env=request.environment(os.environ if env is None else env))

    def events(self) -> list[Event]:
        return [event for event in map(parse, self.out.read_text().splitlines()) if event is not None]

    def wait_for(self, matches: Callable[[Event], bool], timeout: float = 30.0) -> Event:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [event for event in self.events() if matches(event)]
            if found:
                return found[0]
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no such event; events {self.events()}; stderr {self.err.read_text()}")

    def finish(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def wait_for_log(self, text: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.err.read_text():
            assert self.proc.poll() is None, f"exited before logging {text!r}: {self.err.read_text()}"
            assert time.monotonic() < deadline, f"no {text!r} in {timeout:.0f}s: {self.err.read_text()}"
            time.sleep(0.05)

    def uploaded_steps(self) -> list[int]:
        return [event["step"] for event in self.events() if event.kind is NodeEvent.UPLOADED]


def is_event(kind: NodeEvent, step: int | None = None) -> Callable[[Event], bool]:
    return lambda event: event.kind is kind and (step is None or event.get("step") == step)


def both(tmp_path: Path, dirs: list[Path], url: str, **options: Any) -> list[SyncProcess]:
    return [SyncProcess(tmp_path, dirs[rank], url, rank, **options) for rank in (0, 1)]


@contextmanager
def both_running(
    tmp_path: Path, dirs: list[Path], url: str, **options: Any
) -> Iterator[list[SyncProcess]]:
    """both(), each finished (killed if still running) however the block ends, so no test leaves a syncer behind."""
    syncers = both(tmp_path, dirs, url, **options)
    try:
        yield syncers
    finally:
        for syncer in syncers:
            syncer.finish()


def test_the_coordinator_announces_every_node_ships_and_the_commit_waits_for_all(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    dirs = node_dirs(tmp_path)
    stop = tmp_path / "stop"
    make_step(dirs[0], 100, 0)
    shutil.rmtree(make_step(dirs[1], 100, 1))  # node 1's part was deleted locally before its syncer saw it
    for rank in (0, 1):
        make_step(dirs[rank], 200, rank)
    with both_running(tmp_path, dirs, checkpoints.store.url, stop_file=str(stop)) as syncers:
        # One step at a time: a committer that sees 400 complete first rightly skips committing 300.
        for step in (200, 300):
            syncers[0].wait_for(is_event(NodeEvent.COMMITTED, step))
            for rank in (0, 1):
                make_step(dirs[rank], step + 100, rank)
        stop.touch()
        assert [syncer.finish() for syncer in syncers] == [0, 0]

    assert syncers[0].uploaded_steps() == [100, 200, 300, 400]
    assert syncers[1].uploaded_steps() == [200, 300, 400], "node 1 had no part of 100 to ship"
    announced = [e["step"] for e in syncers[0].events() if e.kind is NodeEvent.ANNOUNCED]
    assert announced == [100, 200, 300, 400]
    committed = syncers[0].wait_for(is_event(NodeEvent.COMMITTED, 400))
    assert committed["bytes"] == 60_000 and committed["commit_s"] >= 0
    assert [manifest.step for manifest in checkpoints.committed()] == [400, 300]
    assert [status.step for status in checkpoints.list_steps()] == [300, 400]  # keep=2; abandoned 100 is gone
    manifest = checkpoints.verify()
    assert manifest.step == 400 and manifest.attempt == "a1"
    assert manifest.ref == CheckpointRef(name=step_name(400), kind="dir", format="marker")
    assert [e.path for e in manifest.files] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert checkpoints.announcements("a1") == [], "committed and retired announcements are withdrawn"


def test_a_part_a_node_lost_is_never_committed(tmp_path: Path, checkpoints: CheckpointStore) -> None:
    dirs = node_dirs(tmp_path)
    stop = tmp_path / "stop"
    make_step(dirs[0], 100, 0)
    with both_running(tmp_path, dirs, checkpoints.store.url, stop_file=str(stop),
                      commit_timeout_s=3) as syncers:
        syncers[0].wait_for(is_event(NodeEvent.ANNOUNCED, 100))
        stop.touch()  # node 1 owes __1_0.distcp (DCP's .metadata names it): the coordinator gives up on it
        codes = [syncer.finish() for syncer in syncers]
    assert codes == [2, 2]
    assert "step 100 not committed" in syncers[0].err.read_text().strip().splitlines()[-1]
    assert "node(s) 1" in syncers[0].err.read_text()
    assert checkpoints.latest() is None


def test_a_killed_coordinator_resumes_without_reuploading(tmp_path: Path, checkpoints: CheckpointStore) -> None:
    dirs = node_dirs(tmp_path)
    stop = tmp_path / "stop"
    url = checkpoints.store.url
    make_step(dirs[0], 100, 0)
    first = SyncProcess(tmp_path, dirs[0], url, 0, stop_file=str(stop))
    try:
        first.wait_for(is_event(NodeEvent.UPLOADED, 100))
        make_step(dirs[0], 200, 0, size=4_000_000)  # big enough that the kill may land mid-upload
        first.proc.send_signal(signal.SIGKILL)
    finally:
        assert first.finish() == -signal.SIGKILL
    assert checkpoints.latest() is None  # node 1 never shipped: nothing can be committed

    for rank in (0, 1):
        make_step(dirs[rank], 300, rank)
    make_step(dirs[1], 100, 1)
    make_step(dirs[1], 200, 1, size=4_000_000)
    restarted = SyncProcess(tmp_path, dirs[0], url, 0, stop_file=str(stop), keep=3)
    other = SyncProcess(tmp_path, dirs[1], url, 1, stop_file=str(stop))
    try:
        restarted.wait_for(is_event(NodeEvent.COMMITTED, 300))
        stop.touch()
        assert [restarted.finish(), other.finish()] == [0, 0]
    finally:
        restarted.finish()
        other.finish()
    assert 100 not in restarted.uploaded_steps()
    assert sorted(other.uploaded_steps()) == [100, 200, 300]
    assert checkpoints.latest().step == 300
    for manifest in checkpoints.committed():
        assert checkpoints.verify(manifest.step).step == manifest.step


def test_a_dead_attempts_records_never_join_a_commit(tmp_path: Path, checkpoints: CheckpointStore) -> None:
    """Step 100 retrained after a resume, with different bytes: only the new attempt's files are committed."""
    dirs = node_dirs(tmp_path)
    stale = tmp_path / "stale"
    for rank, ckpt_dir in enumerate(node_dirs(stale)):
        part = make_step(ckpt_dir, 100, rank)
        checkpoints.upload_node_part(part, 100, rank, sorted(p.name for p in part.iterdir()), attempt="dead")
    assert checkpoints.try_commit(100, 2, 2, CONFIG_HASH, attempt="a2") is None, "no record of attempt a2 yet"

    stop = tmp_path / "stop"
    for rank in (0, 1):
        make_step(dirs[rank], 100, rank)
    with both_running(tmp_path, dirs, checkpoints.store.url, stop_file=str(stop), attempt="a2") as syncers:
        syncers[0].wait_for(is_event(NodeEvent.COMMITTED, 100))
        stop.touch()
        assert [syncer.finish() for syncer in syncers] == [0, 0]
    manifest = checkpoints.verify(100)
    assert manifest.attempt == "a2"
    for rank, ckpt_dir in enumerate(dirs):
        for name in ("__0_0.distcp", ".metadata") if rank == 0 else ("__1_0.distcp",):
            stored = checkpoints.store.get_bytes(f"{step_name(100)}/{manifest.files_prefix}{name}")
            assert stored == (ckpt_dir / step_name(100) / name).read_bytes(), f"{name} is the dead attempt's"


def test_restored_checkpoints_are_never_shipped_again(tmp_path: Path, checkpoints: CheckpointStore) -> None:
    dirs = node_dirs(tmp_path)
    stop = tmp_path / "stop"
    for rank in (0, 1):
        make_step(dirs[rank], 100, rank)
    first = both(tmp_path, dirs, checkpoints.store.url, stop_file=str(stop), fmt="auto")
    first[0].wait_for(is_event(NodeEvent.COMMITTED, 100))
    stop.touch()
    assert [s.finish() for s in first] == [0, 0]
    stop.unlink()

    # A recovery: fresh nodes restore the union of both parts into their checkpoint dirs, then train on.
    fresh = node_dirs(tmp_path / "again")
    for ckpt_dir in fresh:
        assert restore.main(RestoreRequest(url=checkpoints.store.url, dest=str(ckpt_dir),
                                           sync_dir=str(ckpt_dir.parent / "sync"), format="auto")) == 0
        assert sorted(p.name for p in (ckpt_dir / step_name(100)).iterdir()) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp"]
    with both_running(tmp_path, fresh, checkpoints.store.url, stop_file=str(stop), fmt="auto",
                      attempt="a2") as second:
        for rank in (0, 1):
            make_step(fresh[rank], 200, rank)
        # The scan that found 200 found the restored 100 beside it: shipped, it would be uploaded first.
        second[0].wait_for(is_event(NodeEvent.COMMITTED, 200))
        stop.touch()
        assert [s.finish() for s in second] == [0, 0]
    assert [s.uploaded_steps() for s in second] == [[200], [200]], "the restored step 100 was shipped again"
    assert [m.step for m in checkpoints.committed()] == [200, 100]


def test_on_stop_the_syncer_waits_for_a_save_under_way_within_the_flush_deadline(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    [ckpt_dir] = node_dirs(tmp_path, nodes=1)
    (ckpt_dir / step_name(100)).mkdir()
    writing = open(ckpt_dir / step_name(100) / "__0_0.distcp", "wb")  # noqa: SIM115 - this test is the writer
    syncer = SyncProcess(tmp_path, ckpt_dir, checkpoints.store.url, 0, flush_deadline_s=20, nodes=1,
                         fmt="dcp")
    try:
        syncer.wait_for(is_event(NodeEvent.STARTED))
        syncer.proc.send_signal(signal.SIGTERM)
        syncer.wait_for_log(STOP_RECEIVED)
        # A step completed after the stop is still shipped: the scans go on while the save is under way.
        make_step(ckpt_dir, 50, 0, world_size=1)
        syncer.wait_for(is_event(NodeEvent.COMMITTED, 50))
        assert syncer.proc.poll() is None, "the syncer left while a save was under way"
        writing.write(os.urandom(1000))
        writing.close()
        (ckpt_dir / step_name(100) / ".metadata").write_bytes(b"__0_0.distcp")
        assert syncer.finish() == 0
    finally:
        writing.close()
        syncer.finish()
    assert syncer.uploaded_steps() == [50, 100]
    assert checkpoints.latest().step == 100

    # A save that outlives the deadline is abandoned: the syncer exits anyway.
    with open(ckpt_dir / "late.bin", "wb"):
        late = SyncProcess(tmp_path, ckpt_dir, checkpoints.store.url, 0, flush_deadline_s=0.5, nodes=1,
                           fmt="dcp")
        late.wait_for(is_event(NodeEvent.STARTED))
        late.proc.send_signal(signal.SIGTERM)
        assert late.finish(timeout=10) == 0


def test_a_node_stops_once_the_coordinator_says_nothing_more_will_come(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    dirs = node_dirs(tmp_path)
    syncer = SyncProcess(tmp_path, dirs[1], checkpoints.store.url, 1, poll_s=5, commit_timeout_s=30)
    try:
        syncer.wait_for(is_event(NodeEvent.STARTED))
        make_step(dirs[1], 100, 1)
        checkpoints.announce(Announcement(step=100, checkpoint=CheckpointRef(name=step_name(100)), attempt="a1",
                                          nodes=[0, 1], required=["__1_0.distcp"], announced_at=time.time()))
        syncer.proc.send_signal(signal.SIGTERM)
        syncer.wait_for_log(STOP_RECEIVED)
        # Until the final word, what the coordinator announces after the stop is shipped too.
        make_step(dirs[1], 200, 1)
        checkpoints.announce(Announcement(step=200, checkpoint=CheckpointRef(name=step_name(200)), attempt="a1",
                                          nodes=[0, 1], required=["__1_0.distcp"], announced_at=time.time()))
        syncer.wait_for(is_event(NodeEvent.UPLOADED, 200))
        assert syncer.proc.poll() is None, "node 1 left before the coordinator's final word"
        checkpoints.announce_final("a1")
        assert syncer.finish() == 0
    finally:
        syncer.finish()
    assert syncer.uploaded_steps() == [100, 200]
    assert [status.nodes_uploaded for status in checkpoints.list_steps()] == [[1], [1]]


def test_a_flush_after_a_preemption_waits_for_no_part_of_a_lost_node(tmp_path: Path,
                                                                    checkpoints: CheckpointStore) -> None:
    """The head's syncer waited out the whole flush bound (20 s in the recovery bench) for the part of a node that was
    gone: the stop request names the lost nodes, and a step that misses one of their parts is not waited for."""
    dirs = node_dirs(tmp_path)
    stop = tmp_path / "stop"
    make_step(dirs[0], 100, 0)
    head = SyncProcess(tmp_path, dirs[0], checkpoints.store.url, 0, stop_file=str(stop), commit_timeout_s=120)
    try:
        head.wait_for(is_event(NodeEvent.ANNOUNCED, 100))
        stop.write_text(stop_request([1]))  # node 1 owes __1_0.distcp and is gone
        assert head.finish(timeout=60) == 0, head.err.read_text()
    finally:
        head.finish()
    assert head.wait_for(is_event(NodeEvent.UNCOMMITTABLE, 100))["lost"] == [1]
    assert checkpoints.latest() is None


def test_a_node_whose_coordinator_was_lost_ships_what_was_announced_and_stops(tmp_path: Path,
                                                                             checkpoints: CheckpointStore) -> None:
    dirs = node_dirs(tmp_path)
    stop = tmp_path / "stop"
    make_step(dirs[1], 100, 1)
    checkpoints.announce(Announcement(step=100, checkpoint=CheckpointRef(name=step_name(100)), attempt="a1",
                                      nodes=[0, 1], required=["__1_0.distcp"], announced_at=time.time()))
    node = SyncProcess(tmp_path, dirs[1], checkpoints.store.url, 1, stop_file=str(stop), commit_timeout_s=120)
    try:
        node.wait_for(is_event(NodeEvent.UPLOADED, 100))
        stop.write_text(stop_request([0]))  # no final announcement will ever come
        assert node.finish(timeout=60) == 0, node.err.read_text()
    finally:
        node.finish()


def test_a_signalled_syncer_waits_for_the_save_its_trainer_makes_on_the_same_signal(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    """A scheduler's stop (Slurm's preemption, or its SIGTERM then SIGKILL after KillWait) signals every process of
    the node at once: the syncer must not exit before the trainer's last save, which starts only at its next step
    boundary, and must ship and commit it; a trainer that never stops is waited for only until the flush deadline."""
    [ckpt_dir] = node_dirs(tmp_path, nodes=1)
    node = {**os.environ, NODE_TAG: "node-under-test"}
    # The node's trainer as its watcher and syncer find it: tagged with the node, `-m infra.node torchrun` in its
    # command line; it runs until its stdin closes.
    trainer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", *TORCHRUN_ARGV],
                               stdin=subprocess.PIPE, env=node)
    syncer = SyncProcess(tmp_path, ckpt_dir, checkpoints.store.url, 0, flush_deadline_s=60, nodes=1, env=node)
    try:
        syncer.wait_for(is_event(NodeEvent.STARTED))
        syncer.proc.send_signal(signal.SIGTERM)
        syncer.wait_for_log(STOP_RECEIVED)
        assert syncer.proc.poll() is None, "the syncer left while its node's trainer still ran"
        make_step(ckpt_dir, 70, 0, world_size=1)  # the trainer's save on the signal
        trainer.communicate(timeout=30)  # then it exits
        syncer.wait_for(is_event(NodeEvent.COMMITTED, 70))
        assert syncer.finish() == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        syncer.finish()
    assert checkpoints.latest().step == 70

    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", *TORCHRUN_ARGV],
                          stdin=subprocess.PIPE, env=node) as stuck:
        late = SyncProcess(tmp_path, ckpt_dir, checkpoints.store.url, 0, flush_deadline_s=0.5, nodes=1, env=node)
        late.wait_for(is_event(NodeEvent.STARTED))
        late.proc.send_signal(signal.SIGTERM)
        assert late.finish(timeout=10) == 0  # the flush deadline bounds the wait for a trainer that never stops
        stuck.communicate(timeout=30)


def test_a_folder_its_framework_starts_deleting_after_it_was_found_is_never_committed_short(
        tmp_path: Path, checkpoints: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The HF Trainer's rotation (save_total_limit) deletes an old folder file by file; when it starts between the
    scan that found the folder complete and its upload, the part lists the same before and after its upload, short
    of what was found. Every file the folder held when found is required: the step is abandoned, not committed."""
    ckpt = tmp_path / "node-0" / "ckpt"
    folder = ckpt / "checkpoint-7"
    folder.mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
        (folder / name).write_text("{}")
    config = SyncConfig(ckpt_dir=ckpt, sync_dir=tmp_path / "node-0" / "sync", url=checkpoints.store.url, node_rank=0,
                        nodes=1, procs_per_node=1, attempt="a1", config_hash=CONFIG_HASH, keep=2, format="hf",
                        poll_s=0.1, stop_file=None, commit_timeout_s=30.0)
    config.sync_dir.mkdir(parents=True)
    syncer = Syncer(config, checkpoints)
    scan = Detector.scan

    def rotation_starts_after_the_scan(detector: Detector) -> list:
        found = scan(detector)
        (folder / "model.safetensors").unlink()
        return found

    monkeypatch.setattr(Detector, "scan", rotation_starts_after_the_scan)
    syncer.find_and_ship()
    assert syncer.commit_pending() == []
    assert checkpoints.committed() == [], "a checkpoint without its weights was committed"
