"""A damaged newest commit, a resume that falls back past it and the retrain of its step, on file:// and on S3
(`rclone serve s3`): the damaged commit is set aside (kept, never counted, never written into, never `latest`),
the retrained step commits the new attempt's files only, and retention never loses a good commit to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_checkpoints import CONFIG_HASH, make_step, node_dirs, node_files
from test_syncer import both_running, is_event
from typer.testing import CliRunner

from infra.checkpoints.layout import CheckpointManifest, manifest_key
from infra.checkpoints.steps import step_name
from infra.checkpoints.store import CheckpointStore
from infra.node import restore
from infra.node.events import NodeEvent, parse
from infra.node.protocol import RestoreRequest
from infra.storage import open_store
from trainpipe.cli import app

OLD, NEW = "0-dead0000", "1-live1111"


@pytest.fixture(params=["file", "s3"])
def checkpoints(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    root = f"file://{tmp_path / 'store'}" if request.param == "file" else request.getfixturevalue("s3_url")
    return CheckpointStore(open_store(f"{root}/run-1"))


def commit(checkpoints: CheckpointStore, dirs: list[Path], step: int, attempt: str) -> CheckpointManifest:
    for rank, ckpt_dir in enumerate(dirs):
        checkpoints.upload_node_part(make_step(ckpt_dir, step, rank), step, rank, node_files(rank), attempt=attempt)
    manifest = checkpoints.try_commit(step, nodes=len(dirs), world_size=2, config_hash=CONFIG_HASH, attempt=attempt)
    assert manifest is not None and manifest.attempt == attempt
    return manifest


def stored_bytes(checkpoints: CheckpointStore, manifest: CheckpointManifest) -> dict[str, bytes]:
    return {entry.path: checkpoints.store.get_bytes(manifest.file_key(entry)) for entry in manifest.files}


def local_bytes(dirs: list[Path], step: int) -> dict[str, bytes]:
    return {name: (ckpt_dir / step_name(step) / name).read_bytes()
            for rank, ckpt_dir in enumerate(dirs) for name in node_files(rank)}


def pointer(checkpoints: CheckpointStore) -> dict[str, object]:
    return json.loads(checkpoints.store.get_bytes("latest"))


def damage(checkpoints: CheckpointStore, manifest: CheckpointManifest, how: str) -> str:
    """Damage one file of a commit in the store; returns its key."""
    key = manifest.file_key(next(e for e in manifest.files if e.path == "__1_0.distcp"))
    if how == "deleted":
        checkpoints.store.delete(key)
    else:  # same size, other bytes: only a checksum tells
        data = bytearray(checkpoints.store.get_bytes(key))
        data[100] ^= 0xFF
        checkpoints.store.put_bytes(key, bytes(data))
    return key


@pytest.mark.parametrize("how", ["flipped", "deleted"])
def test_a_damaged_step_is_set_aside_and_its_retrain_commits_only_the_new_attempts_files(
    tmp_path: Path, checkpoints: CheckpointStore, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    old = node_dirs(tmp_path / "old")
    for step in (100, 200, 300):
        commit(checkpoints, old, step, OLD)
    damaged = checkpoints.manifest(300)
    damaged_key = damage(checkpoints, damaged, how)
    damaged_files = {key: checkpoints.store.get_bytes(key) for key in
                     (damaged.file_key(entry) for entry in damaged.files) if checkpoints.store.head(key)}

    # The resume on each node checks every byte, falls back to 200 and says what it set aside and why.
    for rank in (0, 1):
        dest = tmp_path / f"resume-{rank}" / "ckpt"
        assert restore.main(RestoreRequest(url=checkpoints.store.url, dest=str(dest),
                                           sync_dir=str(dest.parent / "sync"))) == 0
        captured = capsys.readouterr()
        [restored] = [e for e in map(parse, captured.out.splitlines()) if e and e.kind is NodeEvent.RESTORED]
        assert restored["step"] == 200
        assert local_bytes([dest] * 2, 200).items() >= local_bytes(old, 200).items()
        # What the node had fetched of 300 before its damage showed is gone: the retrain writes a clean folder.
        assert sorted(p.name for p in dest.iterdir()) == [step_name(200)]
        [warning] = restored["warnings"]
        assert "step 300" in warning and checkpoints.store.url_for(damaged_key) in warning
        assert f"restore: warning: {warning}" in captured.err
    assert "set aside" in warning  # the first node set it aside; the second found it set aside already
    [note] = checkpoints.set_aside_notes()
    assert (note.step, note.attempt) == (300, OLD)
    assert damaged_key in note.reason and CheckpointManifest.model_validate_json(note.manifest) == damaged
    assert set(note.keys) == set(damaged_files)
    # Never counted, never latest: readers, listing and the pointer all name 200.
    assert [m.step for m in checkpoints.committed()] == [200, 100]
    assert dict(pointer(checkpoints)) == {"step": 200, "manifest": manifest_key(200), "attempt": OLD}
    assert [(s.step, s.committed) for s in checkpoints.list_steps()] == [(100, True), (200, True), (300, False)]
    listing = CliRunner().invoke(app, ["ckpt", "ls", checkpoints.store.url])
    assert listing.exit_code == 0 and "<- latest" in listing.stdout.splitlines()[1]
    assert f"step      300  set aside     {len(note.keys)} files  (attempt {OLD}" in listing.stdout
    # Retention with keep 1 keeps 200, the newest good commit: the damaged 300 no longer looks newer.
    assert checkpoints.apply_retention(1) == [100]

    # The new attempt retrains 300 (other bytes), then 400.
    new = node_dirs(tmp_path / "new")
    retrained = commit(checkpoints, new, 300, NEW)
    assert retrained.files_prefix != damaged.files_prefix
    assert stored_bytes(checkpoints, retrained) == local_bytes(new, 300)
    assert checkpoints.verify(300) == retrained
    assert pointer(checkpoints) == {"step": 300, "manifest": manifest_key(300), "attempt": NEW}
    assert checkpoints.apply_retention(1) == [200]
    assert commit(checkpoints, new, 400, NEW).step == 400
    assert checkpoints.apply_retention(1) == [300]
    assert [m.step for m in checkpoints.committed()] == [400]
    assert checkpoints.verify().step == 400 and pointer(checkpoints)["step"] == 400
    # The damaged commit was never deleted nor written into: its files are as the damage left them.
    assert {key: checkpoints.store.get_bytes(key) for key in note.keys} == damaged_files
    assert checkpoints.set_aside_notes() == [note]


def test_retention_never_deletes_a_good_commit_because_a_damaged_one_looked_newer(
    tmp_path: Path, checkpoints: CheckpointStore
) -> None:
    """No resume in between: retention itself finds the newest commit short of a file and sets it aside."""
    dirs = node_dirs(tmp_path)
    for step in (100, 200, 300):
        commit(checkpoints, dirs, step, OLD)
    damage(checkpoints, checkpoints.manifest(300), "deleted")

    assert checkpoints.apply_retention(1) == [100]
    assert [m.step for m in checkpoints.committed()] == [200]
    assert checkpoints.verify().step == 200 and pointer(checkpoints)["step"] == 200
    [note] = checkpoints.set_aside_notes()
    assert note.step == 300 and "missing" in note.reason


def test_a_commit_of_another_attempt_is_not_the_new_commit(tmp_path: Path, checkpoints: CheckpointStore) -> None:
    """Step 300 is committed (good) by an attempt the new one resumed below: try_commit commits the new attempt's
    files and sets the old commit aside whole, rather than answering with the old manifest."""
    old, new = node_dirs(tmp_path / "old"), node_dirs(tmp_path / "new")
    commit(checkpoints, old, 200, OLD)
    first = commit(checkpoints, old, 300, OLD)
    checkpoints.upload_node_part(make_step(new[0], 300, 0), 300, 0, node_files(0), attempt=NEW)
    # Until every part of the retrain is in, the old commit stands.
    assert checkpoints.try_commit(300, nodes=2, world_size=2, config_hash=CONFIG_HASH, attempt=NEW) is None
    assert checkpoints.latest() == first and checkpoints.set_aside_notes() == []
    checkpoints.upload_node_part(make_step(new[1], 300, 1), 300, 1, node_files(1), attempt=NEW)
    assert stored_bytes(checkpoints, first) == local_bytes(old, 300), "the retrain wrote into the commit"

    manifest = checkpoints.try_commit(300, nodes=2, world_size=2, config_hash=CONFIG_HASH, attempt=NEW)

    assert manifest is not None and manifest.attempt == NEW
    assert stored_bytes(checkpoints, manifest) == local_bytes(new, 300)
    assert checkpoints.verify(300) == manifest and pointer(checkpoints)["attempt"] == NEW
    [note] = checkpoints.set_aside_notes()
    assert note.attempt == OLD and "retrained" in note.reason
    assert stored_bytes(checkpoints, first) == local_bytes(old, 300)
    # A restarted committer of the new attempt gets its own commit back, and sets nothing more aside.
    assert checkpoints.try_commit(300, nodes=2, world_size=2, config_hash=CONFIG_HASH, attempt=NEW) == manifest
    assert len(checkpoints.set_aside_notes()) == 1


def test_the_resumed_attempts_syncer_commits_the_retrain_and_keeps_the_set_aside_files(tmp_path: Path) -> None:
    """The same story through the real restore on each node and the real syncers (file:// only: the store's side is
    proven on both above)."""
    checkpoints = CheckpointStore(open_store(f"file://{tmp_path / 'store' / 'run-1'}"))
    old = node_dirs(tmp_path / "old")
    for step in (100, 200, 300):
        commit(checkpoints, old, step, OLD)
    damage(checkpoints, checkpoints.manifest(300), "flipped")
    dirs = [tmp_path / f"node-{rank}" / "ckpt" for rank in (0, 1)]
    for ckpt_dir in dirs:
        assert restore.main(RestoreRequest(url=checkpoints.store.url, dest=str(ckpt_dir),
                                           sync_dir=str(ckpt_dir.parent / "sync"))) == 0
    [note] = checkpoints.set_aside_notes()
    kept = {key: checkpoints.store.get_bytes(key) for key in note.keys}

    stop = tmp_path / "stop"
    with both_running(tmp_path, dirs, checkpoints.store.url, stop_file=str(stop), attempt=NEW, keep=1) as syncers:
        for step in (300, 400):
            for rank in (0, 1):
                make_step(dirs[rank], step, rank)
            committed = syncers[0].wait_for(is_event(NodeEvent.COMMITTED, step))
            manifest = checkpoints.verify(step)
            assert manifest.attempt == NEW and committed["files"] == len(manifest.files)
            assert stored_bytes(checkpoints, manifest) == local_bytes(dirs, step)
        stop.touch()
        assert [syncer.finish() for syncer in syncers] == [0, 0]
    retention = [event["deleted"] for event in syncers[0].events() if event.kind is NodeEvent.RETENTION]
    assert retention == [[100, 200], [300]]
    assert [m.step for m in checkpoints.committed()] == [400] and pointer(checkpoints)["attempt"] == NEW
    assert {key: checkpoints.store.get_bytes(key) for key in note.keys} == kept
