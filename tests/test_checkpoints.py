"""The checkpoint commit protocol, the node-side syncer (as real subprocesses) and restore, on file:// stores."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from infra.checkpoints import (
    SAVE_LEASE,
    CheckpointError,
    CheckpointStore,
    NoCommittedCheckpoint,
    clear_lease,
    manifest_key,
    step_name,
    write_lease,
)
from infra.node import restore
from infra.storage import open_store

CONFIG_HASH = "0123456789abcdef"
SYNC_MAIN = "import sys; from infra.node.sync import main; sys.exit(main(sys.argv[1:]))"


def node_files(node_rank: int) -> list[str]:
    # Mirrors torch DCP: one file per rank, and the global .metadata only on node rank 0.
    return [f"__{node_rank}_0.distcp", ".metadata"] if node_rank == 0 else [f"__{node_rank}_0.distcp"]


def make_step(ckpt_dir: Path, step: int, node_rank: int, size: int = 20_000, world_size: int = 2) -> Path:
    """A node's part of a step as the trainer leaves it: files first, then the marker written atomically."""
    step_dir = ckpt_dir / step_name(step)
    step_dir.mkdir(parents=True)
    files = node_files(node_rank)
    for name in files:
        (step_dir / name).write_bytes(os.urandom(size))
    marker = {"step": step, "world_size": world_size, "node_rank": node_rank, "files": files}
    temp = ckpt_dir / f".{step_name(step)}.tmp"
    temp.write_text(json.dumps(marker))
    os.replace(temp, ckpt_dir / f"{step_name(step)}.complete")
    return step_dir


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    return tmp_path / "store" / "run-1"


@pytest.fixture
def checkpoints(store_root: Path) -> CheckpointStore:
    return CheckpointStore(open_store(f"file://{store_root}"))


def node_dirs(tmp_path: Path, nodes: int = 2) -> list[Path]:
    dirs = [tmp_path / f"node-{rank}" / "ckpt" for rank in range(nodes)]
    for directory in dirs:
        directory.mkdir(parents=True)
    return dirs


def upload_part(checkpoints: CheckpointStore, ckpt_dir: Path, step: int, node_rank: int) -> None:
    step_dir = make_step(ckpt_dir, step, node_rank)
    checkpoints.upload_node_part(step_dir, step, node_rank, node_files(node_rank))


def commit_step(checkpoints: CheckpointStore, dirs: list[Path], step: int) -> None:
    for rank, ckpt_dir in enumerate(dirs):
        upload_part(checkpoints, ckpt_dir, step, rank)
    assert checkpoints.try_commit(step, nodes=len(dirs), world_size=2, config_hash=CONFIG_HASH) is not None


# ---- the protocol ---------------------------------------------------------------------------------------------


def test_commit_happens_only_when_every_node_record_exists(tmp_path: Path, checkpoints: CheckpointStore) -> None:
    dirs = node_dirs(tmp_path)
    upload_part(checkpoints, dirs[0], 100, 0)

    assert checkpoints.try_commit(100, nodes=2, world_size=2, config_hash=CONFIG_HASH) is None
    assert checkpoints.latest() is None
    [status] = checkpoints.list_steps()
    assert (status.step, status.committed, status.nodes_uploaded, status.files) == (100, False, [0], 2)

    upload_part(checkpoints, dirs[1], 100, 1)
    manifest = checkpoints.try_commit(100, nodes=2, world_size=2, config_hash=CONFIG_HASH)

    assert manifest is not None
    assert [entry.path for entry in manifest.files] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert manifest.total_bytes == 3 * 20_000
    assert (manifest.nodes, manifest.world_size, manifest.config_hash) == (2, 2, CONFIG_HASH)
    assert checkpoints.latest() == manifest
    assert json.loads(checkpoints.store.get_bytes("latest")) == {"step": 100, "manifest": manifest_key(100)}
    [status] = checkpoints.list_steps()
    assert (status.committed, status.nodes_uploaded, status.bytes) == (True, [0, 1], 3 * 20_000)
    # A restarted committer commits again without rewriting or moving anything.
    assert checkpoints.try_commit(100, nodes=2, world_size=2, config_hash=CONFIG_HASH) == manifest


def test_latest_never_names_an_uncommitted_step(tmp_path: Path, checkpoints: CheckpointStore) -> None:
    dirs = node_dirs(tmp_path)
    commit_step(checkpoints, dirs, 100)
    upload_part(checkpoints, dirs[0], 200, 0)

    assert checkpoints.try_commit(200, nodes=2, world_size=2, config_hash=CONFIG_HASH) is None
    latest = checkpoints.latest()
    assert latest is not None and latest.step == 100
    assert [manifest.step for manifest in checkpoints.committed()] == [100]
    assert json.loads(checkpoints.store.get_bytes("latest"))["step"] == 100


def test_corrupt_or_deleted_manifest_falls_back_to_the_previous_commit(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    dirs = node_dirs(tmp_path)
    commit_step(checkpoints, dirs, 100)
    commit_step(checkpoints, dirs, 200)
    checkpoints.store.put_bytes(manifest_key(200), b'{"format": "trainpipe-ckpt-v1", "step": 2')

    latest = checkpoints.latest()
    assert latest is not None and latest.step == 100
    assert [(s.step, s.committed) for s in checkpoints.list_steps()] == [(100, True), (200, False)]
    path, manifest, warnings = checkpoints.restore_latest(tmp_path / "restored")
    assert (manifest.step, path) == (100, tmp_path / "restored" / step_name(100))
    assert len(warnings) == 1 and "step 200" in warnings[0] and manifest_key(200) in warnings[0]

    checkpoints.store.delete(manifest_key(200))
    latest = checkpoints.latest()
    assert latest is not None and latest.step == 100
    assert checkpoints.restore_latest(tmp_path / "restored")[2] == []


def test_a_latest_pointer_to_a_missing_step_is_ignored(tmp_path: Path, checkpoints: CheckpointStore) -> None:
    commit_step(checkpoints, node_dirs(tmp_path), 100)
    checkpoints.store.put_bytes("latest", json.dumps({"step": 900, "manifest": manifest_key(900)}).encode())

    latest = checkpoints.latest()
    assert latest is not None and latest.step == 100


def test_retention_keeps_k_and_never_touches_the_newest_commit_or_newer(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    dirs = node_dirs(tmp_path)
    assert checkpoints.apply_retention(1) == []  # nothing committed yet: nothing may go
    for step in (100, 200, 300, 400):
        commit_step(checkpoints, dirs, step)
    upload_part(checkpoints, dirs[0], 250, 0)  # abandoned: older than the newest commit
    upload_part(checkpoints, dirs[0], 500, 0)  # in flight: newer than the newest commit

    assert checkpoints.apply_retention(2) == [100, 200, 250]
    assert [(s.step, s.committed) for s in checkpoints.list_steps()] == [(300, True), (400, True), (500, False)]
    assert checkpoints.apply_retention(1) == [300]
    assert [(s.step, s.committed) for s in checkpoints.list_steps()] == [(400, True), (500, False)]
    latest = checkpoints.latest()
    assert latest is not None and latest.step == 400
    assert checkpoints.verify().step == 400
    with pytest.raises(ValueError, match="keep=0"):
        checkpoints.apply_retention(0)


def test_verify_names_a_corrupted_and_a_missing_file(tmp_path: Path, checkpoints: CheckpointStore) -> None:
    commit_step(checkpoints, node_dirs(tmp_path), 100)
    assert checkpoints.verify(100).step == 100
    key = f"{step_name(100)}/__1_0.distcp"
    data = bytearray(checkpoints.store.get_bytes(key))
    data[1234] ^= 0xFF
    checkpoints.store.put_bytes(key, bytes(data))

    assert checkpoints.verify(100, deep=False).step == 100  # same size: only the checksum can tell
    with pytest.raises(CheckpointError, match=f"{checkpoints.store.url_for(key)}: crc64nvme differs"):
        checkpoints.verify(100)

    checkpoints.store.delete(key)
    with pytest.raises(CheckpointError, match=f"{checkpoints.store.url_for(key)}: missing"):
        checkpoints.verify(100, deep=False)
    with pytest.raises(CheckpointError, match="step 300 is not committed"):
        checkpoints.verify(300)


def test_a_sha256_manifest_still_verifies_and_restores(tmp_path: Path, checkpoints: CheckpointStore) -> None:
    commit_step(checkpoints, node_dirs(tmp_path), 100)
    manifest = json.loads(checkpoints.store.get_bytes(manifest_key(100)))
    for entry in manifest["files"]:  # as trainpipe wrote them before the CRCs
        del entry["crc"]
        entry["sha256"] = hashlib.sha256(checkpoints.store.get_bytes(f"{step_name(100)}/{entry['path']}")).hexdigest()
    checkpoints.store.put_bytes(manifest_key(100), json.dumps(manifest).encode())
    assert checkpoints.verify(100).files[0].crc is None
    step_dir = checkpoints.restore(tmp_path / "dest", 100)
    assert {p.name for p in step_dir.iterdir()} == {entry["path"] for entry in manifest["files"]}
    key = f"{step_name(100)}/__1_0.distcp"
    checkpoints.store.put_bytes(key, bytes(len(checkpoints.store.get_bytes(key))))
    with pytest.raises(CheckpointError, match=f"{checkpoints.store.url_for(key)}: sha256 differs"):
        checkpoints.verify(100)


def test_restore_downloads_verified_files_and_skips_them_the_second_time(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    dirs = node_dirs(tmp_path)
    commit_step(checkpoints, dirs, 100)
    dest = tmp_path / "dest"

    step_dir = checkpoints.restore(dest, 100)

    assert step_dir == dest / step_name(100)
    for rank, ckpt_dir in enumerate(dirs):
        for name in node_files(rank):
            assert (step_dir / name).read_bytes() == (ckpt_dir / step_name(100) / name).read_bytes()
    names = [name for rank in (0, 1) for name in node_files(rank)]
    before = [(step_dir / name).stat().st_ino for name in names]
    assert checkpoints.restore(dest) == step_dir
    assert [(step_dir / name).stat().st_ino for name in names] == before  # not downloaded again


def test_restore_latest_falls_back_when_the_newest_checkpoint_is_damaged(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    dirs = node_dirs(tmp_path)
    commit_step(checkpoints, dirs, 100)
    commit_step(checkpoints, dirs, 200)
    key = f"{step_name(200)}/__0_0.distcp"
    data = bytearray(checkpoints.store.get_bytes(key))
    data[0] ^= 0xFF
    checkpoints.store.put_bytes(key, bytes(data))

    path, manifest, warnings = checkpoints.restore_latest(tmp_path / "dest")

    assert (manifest.step, path.name) == (100, step_name(100))
    assert len(warnings) == 1 and "step 200" in warnings[0] and "__0_0.distcp" in warnings[0]


def test_restore_cli_reports_the_step_and_exits_3_without_a_checkpoint(
    tmp_path: Path, checkpoints: CheckpointStore, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--url", checkpoints.store.url, "--dest", str(tmp_path / "dest")]
    with pytest.raises(NoCommittedCheckpoint):
        checkpoints.restore_latest(tmp_path / "dest")
    assert restore.main(args) == 3
    assert "no committed checkpoint" in capsys.readouterr().err

    commit_step(checkpoints, node_dirs(tmp_path), 100)
    assert restore.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["event"] == "restored" and report["step"] == 100
    assert report["bytes"] == 60_000 and report["warnings"] == []
    assert Path(report["path"]) == tmp_path / "dest" / step_name(100)
    assert restore.main([*args, "--step", "300"]) == 1
    assert "step 300 is not committed" in capsys.readouterr().err


# ---- the syncer as real processes -----------------------------------------------------------------------------


class SyncProcess:
    def __init__(
        self,
        tmp_path: Path,
        ckpt_dir: Path,
        url: str,
        node_rank: int,
        *extra: str,
        nodes: int = 2,
        keep: int = 2,
        world_size: int = 2,
    ) -> None:
        runs = len(list(tmp_path.glob(f"sync-{node_rank}-*.out")))
        self.out = tmp_path / f"sync-{node_rank}-{runs}.out"
        self.err = tmp_path / f"sync-{node_rank}-{runs}.err"
        argv = [
            "--ckpt-dir",
            str(ckpt_dir),
            "--url",
            url,
            "--node-rank",
            str(node_rank),
            "--nodes",
            str(nodes),
            "--world-size",
            str(world_size),
            "--config-hash",
            CONFIG_HASH,
            "--keep",
            str(keep),
            "--poll",
            "0.1",
            *extra,
        ]
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", SYNC_MAIN, *argv], stdout=out, stderr=err)

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.out.read_text().splitlines() if line.startswith("{")]

    def wait_for(self, matches: Callable[[dict[str, Any]], bool], timeout: float = 20.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [event for event in self.events() if matches(event)]
            if found:
                return found[0]
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no such event; events {self.events()}; stderr {self.err.read_text()}")

    def finish(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def uploaded_steps(self) -> list[int]:
        return [event["step"] for event in self.events() if event["event"] == "uploaded"]


def is_event(name: str, step: int | None = None) -> Callable[[dict[str, Any]], bool]:
    return lambda event: event["event"] == name and (step is None or event.get("step") == step)


def test_two_syncers_upload_while_steps_appear_commit_and_exit_on_the_stop_file(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    dirs = node_dirs(tmp_path)
    stop = tmp_path / "stop"
    make_step(dirs[0], 100, 0)
    shutil.rmtree(make_step(dirs[1], 100, 1))  # local retention got there before the syncer
    for rank in (0, 1):
        make_step(dirs[rank], 200, rank)
    syncers = [
        SyncProcess(tmp_path, dirs[rank], checkpoints.store.url, rank, "--stop-file", str(stop)) for rank in (0, 1)
    ]
    try:
        # One step at a time: a committer that sees 400 complete first rightly skips committing 300.
        for step in (200, 300):
            syncers[0].wait_for(is_event("committed", step))
            for rank in (0, 1):
                make_step(dirs[rank], step + 100, rank)
        stop.touch()
        assert [syncer.finish() for syncer in syncers] == [0, 0]
    finally:
        for syncer in syncers:
            syncer.finish()

    assert syncers[1].wait_for(is_event("skipped", 100))["reason"] == "deleted locally before upload"
    assert syncers[0].uploaded_steps() == [100, 200, 300, 400]
    assert syncers[1].uploaded_steps() == [200, 300, 400]
    committed = syncers[0].wait_for(is_event("committed", 400))
    assert committed["bytes"] == 60_000 and committed["commit_s"] >= 0
    assert [manifest.step for manifest in checkpoints.committed()] == [400, 300]
    assert [status.step for status in checkpoints.list_steps()] == [300, 400]  # keep=2; abandoned 100 is gone
    assert checkpoints.verify().step == 400


def test_a_killed_syncer_resumes_without_reuploading_and_the_commit_still_happens(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    dirs = node_dirs(tmp_path)
    stop = tmp_path / "stop"
    url = checkpoints.store.url
    make_step(dirs[0], 100, 0)
    first = SyncProcess(tmp_path, dirs[0], url, 0, "--stop-file", str(stop))
    try:
        first.wait_for(is_event("uploaded", 100))
        make_step(dirs[0], 200, 0, size=4_000_000)  # big enough that the kill may land mid-upload
        first.proc.send_signal(signal.SIGKILL)
    finally:
        assert first.finish() == -signal.SIGKILL
    assert checkpoints.latest() is None  # node 1 never uploaded: nothing can be committed

    for rank in (0, 1):
        make_step(dirs[rank], 300, rank)
    make_step(dirs[1], 100, 1)
    make_step(dirs[1], 200, 1, size=4_000_000)
    stop.touch()
    # Node 1 finishes first so the restarted committer sees every record and commits each step in order.
    other = SyncProcess(tmp_path, dirs[1], url, 1, "--stop-file", str(stop))
    assert other.finish() == 0
    restarted = SyncProcess(tmp_path, dirs[0], url, 0, "--stop-file", str(stop), keep=3)
    assert restarted.finish() == 0

    assert 100 not in restarted.uploaded_steps()
    assert other.uploaded_steps() == [100, 200, 300]
    assert [manifest.step for manifest in checkpoints.committed()] == [300, 200, 100]
    for step in (100, 200, 300):
        assert checkpoints.verify(step).step == step


def test_the_committer_gives_up_after_the_commit_timeout_naming_the_missing_node(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    [ckpt_dir] = node_dirs(tmp_path, nodes=1)
    stop = tmp_path / "stop"
    stop.touch()
    make_step(ckpt_dir, 100, 0)
    syncer = SyncProcess(
        tmp_path, ckpt_dir, checkpoints.store.url, 0, "--stop-file", str(stop), "--commit-timeout", "0.5"
    )

    assert syncer.finish() == 2
    assert syncer.uploaded_steps() == [100]
    last_line = syncer.err.read_text().strip().splitlines()[-1]
    assert "step 100 not committed" in last_line and "node(s) 1 under" in last_line
    assert checkpoints.latest() is None


def test_sigterm_uploads_what_is_complete_then_exits_0(tmp_path: Path, checkpoints: CheckpointStore) -> None:
    dirs = node_dirs(tmp_path)
    syncer = SyncProcess(tmp_path, dirs[1], checkpoints.store.url, 1, "--poll", "5")
    try:
        syncer.wait_for(is_event("started"))
        make_step(dirs[1], 100, 1)
        signalled = time.monotonic()
        syncer.proc.send_signal(signal.SIGTERM)
        assert syncer.finish() == 0
        assert time.monotonic() - signalled < 4  # the 5 s poll sleep was cut short
    finally:
        syncer.finish()

    assert syncer.uploaded_steps() == [100]
    assert [status.nodes_uploaded for status in checkpoints.list_steps()] == [[1]]


def test_a_marker_from_another_node_is_a_one_line_error(tmp_path: Path, checkpoints: CheckpointStore) -> None:
    dirs = node_dirs(tmp_path)
    make_step(dirs[0], 100, 1)
    syncer = SyncProcess(tmp_path, dirs[0], checkpoints.store.url, 0)

    assert syncer.finish() == 1
    [line] = syncer.err.read_text().strip().splitlines()
    assert "node_rank 1 (--node-rank is 0)" in line and "step-00000100.complete" in line


# ---- bad input: damaged checkpoints -------------------------------------------------------------------------------


def test_a_corrupt_manifest_or_a_missing_file_fails_verify_naming_it_and_resume_falls_back(
    tmp_path: Path, checkpoints: CheckpointStore, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    from typer.testing import CliRunner

    from infra.summary import RunSummary
    from tasks.report import record_resume
    from trainpipe.cli import app

    url = checkpoints.store.url
    dirs = node_dirs(tmp_path)
    for step in (100, 200):
        commit_step(checkpoints, dirs, step)
    checkpoints.store.put_bytes(manifest_key(200), b'{"format": "trainpipe-ckpt-v1", "st')

    verify = CliRunner().invoke(app, ["ckpt", "verify", url])
    assert verify.exit_code == 2
    [line] = verify.stderr.strip().splitlines()
    assert f"{checkpoints.store.url_for(manifest_key(200))}: corrupt manifest" in line

    # The resume takes the previous commit, and the flow says so in its log and in the run summary.
    args = ["--url", url, "--dest", str(tmp_path / "dest")]
    assert restore.main(args) == 0
    captured = capsys.readouterr()
    assert f"restore: warning: skipped checkpoint step 200: {checkpoints.store.url_for(manifest_key(200))}" in (
        captured.err
    )
    restored = [json.loads(line) for line in captured.out.splitlines() if line.startswith('{"event"')]
    summary = RunSummary(run_id="r", job="j", provider="local", nodes=2)
    logger = logging.getLogger("test-resume")
    logger.addHandler(caplog.handler)  # Prefect's logging config stops propagation to the root logger
    try:
        record_resume(summary, restored * 2, logger)
    finally:
        logger.removeHandler(caplog.handler)
    assert summary.resumed_from_step == 100
    [warning] = summary.warnings
    assert "step 200" in warning and manifest_key(200) in warning
    assert any("resume fell back to step 100" in r.getMessage() for r in caplog.records)

    missing = f"{step_name(100)}/__1_0.distcp"
    checkpoints.store.delete(missing)
    verify = CliRunner().invoke(app, ["ckpt", "verify", url, "100"])
    assert verify.exit_code == 2
    [line] = verify.stderr.strip().splitlines()
    assert f"{checkpoints.store.url_for(missing)}: missing from committed step 100" in line
    with pytest.raises(CheckpointError, match="every committed checkpoint is damaged"):
        checkpoints.restore_latest(tmp_path / "dest2")


def test_on_stop_the_syncer_waits_for_a_save_under_way_within_the_flush_deadline(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    dirs = node_dirs(tmp_path)
    write_lease(dirs[1], SAVE_LEASE, 100)  # this test process is the trainer, saving step 100
    syncer = SyncProcess(tmp_path, dirs[1], checkpoints.store.url, 1, "--flush-deadline", "20")
    try:
        syncer.wait_for(is_event("started"))
        syncer.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert syncer.proc.poll() is None, "the syncer left while a save was under way"
        make_step(dirs[1], 100, 1)  # the marker first, then the lease goes: the order the trainer keeps
        clear_lease(dirs[1], SAVE_LEASE)
        assert syncer.finish() == 0
    finally:
        syncer.finish()
    assert syncer.uploaded_steps() == [100]

    # A save that outlives the deadline is abandoned: the syncer exits anyway.
    write_lease(dirs[1], SAVE_LEASE, 200)
    late = SyncProcess(tmp_path, dirs[1], checkpoints.store.url, 1, "--flush-deadline", "0.5")
    late.wait_for(is_event("started"))
    late.proc.send_signal(signal.SIGTERM)
    assert late.finish(timeout=10) == 0
    assert late.uploaded_steps() == []
