"""The checkpoint commit protocol, the node-side syncer (as real subprocesses) and restore, on file:// stores."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest

from infra.checkpoints.layout import FILES_PREFIX, CheckpointError, NoCommittedCheckpoint, manifest_key
from infra.checkpoints.steps import step_name
from infra.checkpoints.store import CheckpointStore
from infra.node import restore
from infra.node.events import NodeEvent, parse
from infra.node.protocol import RestoreRequest
from infra.storage import open_store

CONFIG_HASH = "0123456789abcdef"


def node_files(node_rank: int) -> list[str]:
    # Mirrors torch DCP: one file per rank, and the global .metadata only on node rank 0.
    return [f"__{node_rank}_0.distcp", ".metadata"] if node_rank == 0 else [f"__{node_rank}_0.distcp"]


def make_step(ckpt_dir: Path, step: int, node_rank: int, size: int = 20_000, world_size: int = 2) -> Path:
    """A node's part of a step as the trainer leaves it: files first, then the marker written atomically. Like
    DCP's, the coordinator's .metadata names every rank's data file."""
    step_dir = ckpt_dir / step_name(step)
    step_dir.mkdir(parents=True)
    files = node_files(node_rank)
    for name in files:
        data = os.urandom(size)
        if name == ".metadata":
            index = b"".join(f"__{rank}_0.distcp".encode() for rank in range(world_size))
            data = index + data[len(index):]
        (step_dir / name).write_bytes(data)
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


@pytest.fixture
def steps_100_and_200_committed(tmp_path: Path, checkpoints: CheckpointStore) -> None:
    """Two committed steps by two nodes: the newest to damage, the one before for the store to fall back on."""
    dirs = node_dirs(tmp_path)
    for step in (100, 200):
        commit_step(checkpoints, dirs, step)


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
    assert json.loads(checkpoints.store.get_bytes("latest")) == {"step": 100, "manifest": manifest_key(100),
                                                                 "attempt": ""}
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


@pytest.mark.usefixtures("steps_100_and_200_committed")
def test_corrupt_or_deleted_manifest_falls_back_to_the_previous_commit(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    checkpoints.store.put_bytes(manifest_key(200), b'{"format": "trainpipe-ckpt-v1", "step": 2')

    latest = checkpoints.latest()
    assert latest is not None and latest.step == 100
    assert [(s.step, s.committed) for s in checkpoints.list_steps()] == [(100, True), (200, False)]
    path, manifest, warnings = checkpoints.restore_latest(tmp_path / "restored")
    assert (manifest.step, path) == (100, tmp_path / "restored" / step_name(100))
    assert len(warnings) == 1 and "step 200" in warnings[0] and manifest_key(200) in warnings[0]

    # The corrupt commit was set aside: the next resume still says why it is not on step 200.
    assert checkpoints.store.head(manifest_key(200)) is None
    [warning] = checkpoints.restore_latest(tmp_path / "restored")[2]
    assert "step 200: set aside at" in warning and "corrupt manifest" in warning

    commit_step(checkpoints, node_dirs(tmp_path / "again"), 300)
    checkpoints.store.delete(manifest_key(300))  # an uncommitted step is no damage: nothing to say
    latest = checkpoints.latest()
    assert latest is not None and latest.step == 100
    assert checkpoints.restore_latest(tmp_path / "restored")[2] == [warning]


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


def test_retention_never_deletes_the_current_attempts_steps_in_flight(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    """An attempt that resumed below a newer commit (it could not restore step 400) uploads steps 250 and 300 under
    its own attempt: those are its work in flight, not leftovers, whatever retention thinks of their step numbers.
    Before, retention deleted them, and the next commit of 300 listed files no longer in the store."""
    dirs = node_dirs(tmp_path)
    for step in (100, 200, 400):
        commit_step(checkpoints, dirs, step)
    upload_part(checkpoints, dirs[0], 150, 0)  # a dead attempt's (the legacy one's) leftover
    for step in (250, 300):
        checkpoints.upload_node_part(make_step(dirs[0], step, 0), step, 0, node_files(0), attempt="b")

    assert checkpoints.apply_retention(2, attempt="b") == [100, 150]
    assert [(s.step, s.committed) for s in checkpoints.list_steps()] == [
        (200, True), (250, False), (300, False), (400, True)]
    checkpoints.upload_node_part(make_step(dirs[1], 300, 1), 300, 1, node_files(1), attempt="b")
    manifest = checkpoints.try_commit(300, nodes=2, world_size=2, config_hash=CONFIG_HASH, attempt="b")
    assert manifest is not None and manifest.attempt == "b"
    assert checkpoints.verify(300).step == 300


def test_a_commit_refuses_a_file_its_record_lists_but_the_store_lost(tmp_path: Path,
                                                                      checkpoints: CheckpointStore) -> None:
    dirs = node_dirs(tmp_path)
    for rank, ckpt_dir in enumerate(dirs):
        upload_part(checkpoints, ckpt_dir, 100, rank)
    key = f"{step_name(100)}/{FILES_PREFIX}__1_0.distcp"
    checkpoints.store.delete(key)

    with pytest.raises(CheckpointError, match=f"{checkpoints.store.url_for(key)} is missing: step 100 is not"):
        checkpoints.try_commit(100, nodes=2, world_size=2, config_hash=CONFIG_HASH)
    assert checkpoints.store.head(manifest_key(100)) is None and checkpoints.latest() is None


def test_verify_names_a_corrupted_and_a_missing_file(tmp_path: Path, checkpoints: CheckpointStore) -> None:
    commit_step(checkpoints, node_dirs(tmp_path), 100)
    assert checkpoints.verify(100).step == 100
    key = f"{step_name(100)}/{FILES_PREFIX}__1_0.distcp"
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
    committed = checkpoints.manifest(100)
    assert all(entry.crc and entry.crc.startswith("crc64nvme:") for entry in committed.files)
    manifest = json.loads(checkpoints.store.get_bytes(manifest_key(100)))
    for entry in manifest["files"]:  # as trainpipe wrote them before the CRCs
        del entry["crc"]
        key = f"{step_name(100)}/{committed.files_prefix}{entry['path']}"
        entry["sha256"] = hashlib.sha256(checkpoints.store.get_bytes(key)).hexdigest()
    checkpoints.store.put_bytes(manifest_key(100), json.dumps(manifest).encode())
    assert checkpoints.verify(100).files[0].crc is None
    step_dir = checkpoints.restore(tmp_path / "dest", 100)
    assert sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()) == sorted(
        entry["path"] for entry in manifest["files"])
    key = committed.file_key(committed.files[-1])
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


@pytest.mark.usefixtures("steps_100_and_200_committed")
def test_restore_latest_falls_back_when_the_newest_checkpoint_is_damaged(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    key = f"{step_name(200)}/{FILES_PREFIX}__0_0.distcp"
    data = bytearray(checkpoints.store.get_bytes(key))
    data[0] ^= 0xFF
    checkpoints.store.put_bytes(key, bytes(data))

    path, manifest, warnings = checkpoints.restore_latest(tmp_path / "dest")

    assert (manifest.step, path.name) == (100, step_name(100))
    assert len(warnings) == 1 and "step 200" in warnings[0] and "__0_0.distcp" in warnings[0]


def test_restore_cli_reports_the_step_and_exits_3_without_a_checkpoint(
    tmp_path: Path, checkpoints: CheckpointStore, capsys: pytest.CaptureFixture[str]
) -> None:
    args = RestoreRequest(url=checkpoints.store.url, dest=str(tmp_path / "dest"))
    with pytest.raises(NoCommittedCheckpoint):
        checkpoints.restore_latest(tmp_path / "dest")
    assert restore.main(args) == 3
    assert "no committed checkpoint" in capsys.readouterr().err

    commit_step(checkpoints, node_dirs(tmp_path), 100)
    assert restore.main(args) == 0
    report = parse(capsys.readouterr().out.strip())
    assert report is not None and report.kind is NodeEvent.RESTORED and report["step"] == 100
    assert report["bytes"] == 60_000 and report["warnings"] == []
    assert Path(report["path"]) == tmp_path / "dest" / step_name(100)
    assert restore.main(args.model_copy(update={"step": 300})) == 1
    assert "step 300 is not committed" in capsys.readouterr().err


# ---- bad input: damaged checkpoints -------------------------------------------------------------------------------


def test_a_corrupt_manifest_or_a_missing_file_fails_verify_naming_it_and_resume_falls_back(
    tmp_path: Path, checkpoints: CheckpointStore, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    from typer.testing import CliRunner

    from infra.job.summary import RunSummary
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
    assert restore.main(RestoreRequest(url=url, dest=str(tmp_path / "dest"))) == 0
    captured = capsys.readouterr()
    assert f"restore: warning: skipped checkpoint step 200: {checkpoints.store.url_for(manifest_key(200))}" in (
        captured.err
    )
    restored = [e for e in map(parse, captured.out.splitlines()) if e is not None]
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

    missing = f"{step_name(100)}/{FILES_PREFIX}__1_0.distcp"
    checkpoints.store.delete(missing)
    verify = CliRunner().invoke(app, ["ckpt", "verify", url, "100"])
    assert verify.exit_code == 2
    [line] = verify.stderr.strip().splitlines()
    assert f"{checkpoints.store.url_for(missing)}: missing from committed step 100" in line
    with pytest.raises(CheckpointError, match="every committed checkpoint is damaged"):
        checkpoints.restore_latest(tmp_path / "dest2")
