"""Checkpoint syncers left alone for hours: a store outage within the job's bound is ridden out (rclone stopped, then
started again on the same port and dir); past the bound the syncer exits with its own code and training stops saying
so; a syncer that dies is restarted from the train wait loop within seconds and resumes from its state file.

The outage lasts TRAINPIPE_TEST_OUTAGE_S (25 s in CI, against a bound of max(60, 2x)); run it once by hand with 180
for the 3-minute outage."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from servers import S3Server, free_port, rclone_s3
from test_checkpoints import make_step, node_dirs
from test_syncer import SyncProcess, both_running, is_event

from infra.checkpoints.store import CheckpointStore
from infra.compute.access.remote import LocalProcess, LocalRunner, RemoteError, wait_all
from infra.compute.providers import Node
from infra.lifecycle.preemption_watch import TrainingError
from infra.node.events import Event, NodeEvent, parse
from infra.node.processes import tagged_processes
from infra.node.protocol import REQUEST_ENV, SyncRequest
from infra.node.sync import EXIT_STORE_FAILED
from infra.storage import open_store
from tasks.syncers import Syncers

OUTAGE_S = float(os.environ.get("TRAINPIPE_TEST_OUTAGE_S", "25"))
OUTAGE_BOUND_S = max(60.0, 2 * OUTAGE_S)
# An S3 endpoint nobody serves (the discard port): every request is refused, as in an outage.
NOBODY = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
          "AWS_DEFAULT_REGION": "us-east-1"}
log = logging.getLogger(__name__)


def test_syncers_ride_out_a_store_outage_and_commit_what_came_during_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s3" / "root"
    (root / "ckpt").mkdir(parents=True)  # the bucket, made before rclone first lists the root
    port = free_port()
    for name, value in S3Server(f"http://127.0.0.1:{port}", root).env().items():
        monkeypatch.setenv(name, value)  # the syncers inherit it
    url = "s3://ckpt/run-1"
    dirs = node_dirs(tmp_path)
    stop = tmp_path / "stop"
    for rank in (0, 1):
        make_step(dirs[rank], 100, rank)
    with both_running(tmp_path, dirs, url, stop_file=str(stop), store_outage_s=OUTAGE_BOUND_S) as running:
        with rclone_s3(root, port=port):
            running[0].wait_for(is_event(NodeEvent.COMMITTED, 100))
        # The store is gone: a checkpoint completes during the outage and every try to ship it fails.
        outage_started = time.monotonic()
        for rank in (0, 1):
            make_step(dirs[rank], 200, rank)
        while time.monotonic() - outage_started < OUTAGE_S:
            assert [s.proc.poll() for s in running] == [None, None], "a syncer gave up within the outage bound"
            time.sleep(0.5)
        assert "failed" in running[0].err.read_text(), "the syncer never noticed the outage"
        with rclone_s3(root, port=port):
            back_at = time.monotonic()
            running[0].wait_for(is_event(NodeEvent.COMMITTED, 200), timeout=OUTAGE_BOUND_S)
            log.warning("outage of %.0fs ridden out (bound %.0fs); step 200 committed %.1fs after the store came back",
                        back_at - outage_started, OUTAGE_BOUND_S, time.monotonic() - back_at)
            stop.touch()
            assert [s.finish() for s in running] == [0, 0]
            checkpoints = CheckpointStore(open_store(url))
            assert [m.step for m in checkpoints.committed()] == [200, 100]
            for manifest in checkpoints.committed():
                assert checkpoints.verify(manifest.step).step == manifest.step


def test_a_syncer_exits_with_its_own_code_once_the_store_stays_down_past_the_bound(tmp_path: Path) -> None:
    [ckpt_dir] = node_dirs(tmp_path, nodes=1)
    dead_store = "s3://nowhere/run-1"
    env = {**os.environ, **NOBODY}
    started = time.monotonic()
    syncer = SyncProcess(tmp_path, ckpt_dir, dead_store, 0, store_outage_s=5, nodes=1, env=env)
    code = syncer.finish(timeout=60)
    assert code == EXIT_STORE_FAILED, syncer.err.read_text()[-2000:]
    assert 5 <= time.monotonic() - started < 40
    last = syncer.err.read_text().strip().splitlines()[-1]
    assert last.startswith("sync: ") and "failed for" in last and "check the network and the store" in last


# -- the train wait loop's watch of the syncers (tasks.syncers), with real syncer processes on local nodes --------


def local_nodes(tmp_path: Path, count: int = 2, env: dict[str, str] | None = None,
                ) -> tuple[list[Node], dict[str, LocalRunner]]:
    nodes = []
    for rank in range(count):
        workdir = tmp_path / f"node-{rank}"
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        (workdir / "ckpt").mkdir(exist_ok=True)
        nodes.append(Node(name=f"node-{rank}", rank=rank, address="127.0.0.1", workdir=str(workdir),
                          data_dir=str(workdir / "data"), ckpt_dir=str(workdir / "ckpt"), python=sys.executable))
    return nodes, {node.name: LocalRunner(node.name, Path(node.workdir), env or {}) for node in nodes}


def sync_request(node: Node, url: str, **fields: Any) -> SyncRequest:
    return SyncRequest(**{"ckpt_dir": node.ckpt_dir, "sync_dir": node.sync_dir, "url": url, "node_rank": node.rank,
                          "nodes": 2, "attempt": "a1", "config_hash": "c0ffee", "keep": 3, "format": "marker",
                          "poll_s": 0.1, "stop_file": f"{node.sync_dir}/stop", **fields})


def watched_syncers(tmp_path: Path, url: str, env: dict[str, str] | None = None, **fields: Any,
                    ) -> tuple[list[Node], Syncers]:
    nodes, runners = local_nodes(tmp_path, env=env)
    return nodes, Syncers(runners, nodes, lambda node: sync_request(node, url, **fields),
                          lambda node, on_event: events_to(on_event), log, max_restarts=2)


def events_to(on_event: Callable[[Event], None]) -> Callable[[str], None]:
    """The line sink the train task gives a syncer, without Prefect's logger: event lines to on_event."""
    def sink(line: str) -> None:
        event = parse(line)
        if event is not None:
            on_event(event)
    return sink


def poll_until(syncers: Syncers, condition: Callable[[], bool], timeout: float = 60.0) -> float:
    """Polls like the train wait loop (every 0.5 s) until condition(); returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"not within {timeout}s; events {syncers.events}"
        syncers.poll()
        time.sleep(0.5)
    return time.monotonic() - started


def committed(syncers: Syncers, step: int) -> bool:
    return any(e.kind is NodeEvent.COMMITTED and e.get("step") == step for e in syncers.events)


def test_a_killed_syncer_is_restarted_within_seconds_and_resumes(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store' / 'run-1'}"
    nodes, syncers = watched_syncers(tmp_path, url)
    dirs = [Path(node.ckpt_dir) for node in nodes]
    syncers.start()
    try:
        for rank in (0, 1):
            make_step(dirs[rank], 100, rank)
        poll_until(syncers, lambda: committed(syncers, 100))
        assert syncers.newest_settled() == 100
        victim = syncers.processes["node-1"]
        assert isinstance(victim, LocalProcess)
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        detected = poll_until(syncers, lambda: syncers.processes["node-1"] is not victim, timeout=30)
        log.info("syncer death to restart: %.2fs", time.monotonic() - killed_at)
        assert detected < 5, "the syncer's death was acted on late"
        assert syncers.restarts == {"node-1": 1}
        for rank in (0, 1):
            make_step(dirs[rank], 200, rank)
        poll_until(syncers, lambda: committed(syncers, 200))
        syncers.stop(timeout_s=30)
    finally:
        for process in syncers.processes.values():
            process.terminate(grace_s=2)
    uploads = [e["step"] for e in syncers.events if e.kind is NodeEvent.UPLOADED and e.get("node_rank") == 1]
    assert uploads == [100, 200], "the restarted syncer shipped step 100 again (it resumes from its state file)"
    assert CheckpointStore(open_store(url)).verify().step == 200


def test_a_syncer_that_keeps_dying_stops_training_saying_why(tmp_path: Path) -> None:
    _, syncers = watched_syncers(tmp_path, f"file://{tmp_path / 'store' / 'run-1'}")
    syncers.start()
    try:
        for _ in range(syncers.max_restarts):
            victim = syncers.processes["node-0"]
            os.kill(victim.pid, signal.SIGKILL)  # type: ignore[attr-defined] - a LocalProcess
            poll_until(syncers, lambda v=victim: syncers.processes["node-0"] is not v, timeout=30)
        os.kill(syncers.processes["node-0"].pid, signal.SIGKILL)  # type: ignore[attr-defined]
        with pytest.raises(TrainingError, match="node-0: checkpoint syncer died 3 times during training"):
            poll_until(syncers, lambda: False, timeout=30)
    finally:
        for process in syncers.processes.values():
            process.terminate(grace_s=2)


def test_a_syncer_that_gave_up_on_the_store_stops_training_at_once(tmp_path: Path) -> None:
    _, syncers = watched_syncers(tmp_path, "s3://nowhere/run-1", store_outage_s=5, env=NOBODY)
    syncers.start()
    try:
        with pytest.raises(TrainingError, match=r"syncer gave up on the store: sync: .*failed for") as raised:
            poll_until(syncers, lambda: False, timeout=60)
        assert "checkpoints.store_outage_s" in str(raised.value)
        assert syncers.restarts == {}, "a syncer that gave up on the store was restarted"
    finally:
        for process in syncers.processes.values():
            process.terminate(grace_s=2)


# -- the wait for trainers: a node that hangs at exit once another's ranks are done ------------------------------


def test_wait_all_hands_back_the_stragglers_once_asked(tmp_path: Path) -> None:
    _, runners = local_nodes(tmp_path)
    processes = {"node-0": runners["node-0"].start([sys.executable, "-c", "pass"]),
                 "node-1": runners["node-1"].start([sys.executable, "-c", "import time; time.sleep(600)"])}
    asked: list[list[str]] = []

    def stragglers(pending: list[str]) -> bool:
        asked.append(pending)
        return asked.count(["node-1"]) >= 3

    try:
        hung = wait_all(processes, time.monotonic() + 120, failed=lambda *a: AssertionError(a),
                        overdue=lambda pending: AssertionError(pending), stragglers=stragglers, interval_s=0.1)
        assert hung == ["node-1"] and asked[-3:] == [["node-1"]] * 3
        assert processes["node-1"].poll() is None, "wait_all stops nothing: the caller does"
    finally:
        processes["node-1"].terminate(grace_s=1)


class UnreachableRunner(LocalRunner):
    """A node whose transport is gone: writing its stop file fails the way an SSH write to a lost host does."""

    def write_text(self, path: str, text: str) -> None:
        raise RemoteError(f"{self.node_name}: connection lost")


# Stands in for the node's Python running a syncer: exits 0 once asked to flush (the stop file its request names
# exists), as a syncer with nothing pending does.
WAITS_FOR_STOP = ("import json, os, time\nstop = json.loads(os.environ[{request_env!r}])['stop_file']\n"
                  "while not os.path.exists(stop): time.sleep(0.05)\n")


def test_an_unreachable_node_does_not_keep_the_other_syncers_from_flushing(tmp_path: Path) -> None:
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!{sys.executable}\n{WAITS_FOR_STOP.format(request_env=REQUEST_ENV)}")
    fake_python.chmod(0o755)
    nodes, runners = local_nodes(tmp_path)
    nodes = [dataclasses.replace(node, python=str(fake_python)) for node in nodes]
    lost = nodes[0]  # asked first: before, its failed write left every later node's syncer unasked
    runners[lost.name] = UnreachableRunner(lost.name, Path(lost.workdir), {})
    syncers = Syncers(runners, nodes, lambda node: sync_request(node, "file:///nowhere"),
                      lambda node, on_event: events_to(on_event), log)
    syncers.start()
    try:
        with pytest.raises(TrainingError) as raised:
            syncers.stop(timeout_s=60.0)
        assert "node-0: could not ask its checkpoint syncer to flush" in str(raised.value)
        assert syncers.processes["node-1"].wait(5) == 0, "node-1's syncer was never asked to flush"
    finally:
        for process in syncers.processes.values():
            process.terminate(grace_s=1.0)


def test_a_node_lost_during_the_final_flush_ends_the_wait_at_once(tmp_path: Path) -> None:
    """The final flush waited up to its whole bound (final_upload_timeout_s, 900 s by default) for the part of a node
    gone during it; the train task's preemption watch, run every round of the wait, ends it as soon as the node is
    confirmed gone, and the syncers still waiting are stopped."""
    store = tmp_path / "store"
    nodes, syncers = watched_syncers(tmp_path, f"file://{store}")
    make_step(Path(nodes[0].ckpt_dir), 100, 0)  # node 1's part of step 100 will never come
    syncers.start()
    try:
        poll_until(syncers, lambda: any(e.kind is NodeEvent.ANNOUNCED for e in syncers.events))
        syncers.processes["node-1"].terminate(grace_s=0.0)  # the node is gone, its syncer with it

        def watch() -> None:
            if syncers.processes["node-1"].poll() is not None:
                raise TrainingError("node-1 preempted (vanished without notice)")

        started = time.monotonic()
        with pytest.raises(TrainingError, match="node-1 preempted"):
            syncers.stop(timeout_s=600.0, each_round=watch)
        assert time.monotonic() - started < 60, "waited for the lost node's part"
        assert syncers.processes["node-0"].wait(30) is not None, "the head's syncer was left running"
    finally:
        for process in syncers.processes.values():
            process.terminate(grace_s=1.0)


# -- a node taken away while its syncer is restarted: the run in CI that waited 600 s on the final flush ----------


def test_a_node_whose_dir_is_going_starts_nothing_and_says_so(tmp_path: Path) -> None:
    """The log was opened after the process started: a dir being removed raised FileNotFoundError (not the runner's
    RemoteError) and left the process running, unread and unended."""
    tag = f"tp-test-{os.getpid()}-{time.monotonic_ns()}"
    runner = LocalRunner("node-1", tmp_path, {"TP_TEST_TAG": tag})
    with pytest.raises(RemoteError, match=r"node-1: cannot start .*: No such file or directory: .*/gone/sync\.log"):
        runner.start([sys.executable, "-c", "import time; time.sleep(60)"],
                     log_path=str(tmp_path / "gone" / "sync.log"))
    assert tagged_processes("TP_TEST_TAG", tag) == [], "a process was left running"


def test_a_syncer_whose_node_is_taken_away_stops_training_through_the_watch(tmp_path: Path) -> None:
    """Its restart fails: a TrainingError, which the train wait loop hands to the preemption watch to name the
    lost node; anything else skipped the watch, and the final flush then waited for the lost node's part."""
    nodes, syncers = watched_syncers(tmp_path, f"file://{tmp_path / 'store' / 'run-1'}")
    syncers.start()
    try:
        victim = syncers.processes["node-1"]
        shutil.rmtree(Path(nodes[1].workdir) / "logs")  # mid-removal: the node's dir is still there, its logs not
        victim.terminate(grace_s=0.0)
        with pytest.raises(TrainingError, match=r"node-1: checkpoint syncer died \(exit -\d+\) and cannot be "
                                                r"restarted: node-1: cannot start"):
            poll_until(syncers, lambda: False, timeout=30)
        assert syncers.processes["node-1"] is victim
    finally:
        for process in syncers.processes.values():
            process.terminate(grace_s=1.0)


def test_the_final_flush_does_not_wait_for_the_parts_of_a_dead_syncer(tmp_path: Path) -> None:
    """A training failure that is no preemption, with a syncer dead: its node's parts never come, so the others are
    told it is lost and the flush ends with the dead one's exit, not after the whole bound (900 s by default)."""
    nodes, syncers = watched_syncers(tmp_path, f"file://{tmp_path / 'store'}")
    make_step(Path(nodes[0].ckpt_dir), 100, 0)  # node 1's part of step 100 will never come
    syncers.start()
    try:
        poll_until(syncers, lambda: any(e.kind is NodeEvent.ANNOUNCED for e in syncers.events))
        syncers.processes["node-1"].terminate(grace_s=0.0)
        started = time.monotonic()
        with pytest.raises(TrainingError, match=r"node-1: checkpoint syncer exited -\d+ before the flush: killed by"):
            syncers.stop(timeout_s=600.0)
        assert time.monotonic() - started < 60, "waited for the dead syncer's part"
        assert syncers.processes["node-0"].wait(5) == 0
        assert any(e.kind is NodeEvent.UNCOMMITTABLE and e.get("step") == 100 for e in syncers.events)
    finally:
        for process in syncers.processes.values():
            process.terminate(grace_s=1.0)


class GoingRunner(LocalRunner):
    """A machine being reclaimed: a new command waits on it as an SSH connect to a dead host does (60 s a try)."""

    def start(self, *args: Any, **kwargs: Any) -> LocalProcess:
        raise AssertionError(f"{self.node_name}: a command was started on a node under a preemption notice")


def test_a_syncer_that_died_on_a_node_under_notice_is_not_restarted(tmp_path: Path) -> None:
    """Restarted, its start waited out the SSH connect bound on the machine being reclaimed: the Azure eviction run
    sat 60 s between the syncer's death and the preemption."""
    nodes, syncers = watched_syncers(tmp_path, f"file://{tmp_path / 'store' / 'run-1'}")
    syncers.start()
    try:
        victim = syncers.processes["node-1"]
        syncers.runners["node-1"] = GoingRunner("node-1", Path(nodes[1].workdir), {})
        victim.terminate(grace_s=0.0)
        asked: list[str] = []

        def going() -> frozenset[str]:
            asked.append("node-1")
            return frozenset({"node-1"})

        for _ in range(3):
            syncers.poll(going=going)
        assert syncers.processes["node-1"] is victim and syncers.restarts == {}
        assert asked == ["node-1"], "the notices were looked up again for a syncer already left to its node"
    finally:
        for process in syncers.processes.values():
            process.terminate(grace_s=1.0)
