"""The model registry in the checkpoint store: promote (compare-and-swap), rollback, history, references,
retention protection, lineage and evaluations, on file://, rclone's S3 and the GCS emulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from registry_checks import check_race, commit_step
from test_checkpoints import make_step, node_dirs
from test_syncer import SyncProcess, is_event

from infra.checkpoints.lineage import Lineage
from infra.checkpoints.store import CheckpointStore
from infra.node.events import NodeEvent
from infra.registry import (
    AliasConflict,
    Registry,
    RegistryError,
    parse_model_ref,
    registry_root_of,
    resolve_checkpoint,
)
from infra.storage import open_store

LINEAGE = {"run_id": "run-2", "attempt": "a1", "dataset": {"url": "file:///data", "snapshot_digest": "abc"},
           "config_hash": "cfg", "cluster": {"provider": "local", "nodes": 1}}


@pytest.fixture
def root(tmp_path: Path) -> str:
    return f"file://{tmp_path}/ckpts"


def test_parse_model_ref() -> None:
    assert parse_model_ref("gpt@production") == ("gpt", "production")
    assert parse_model_ref("s3://b/ckpts/run/step-00000001") is None
    assert parse_model_ref("file:///x@y") is None
    assert parse_model_ref("a@b@c") is None


def test_resolve_checkpoint_step_run_and_alias(root: str, tmp_path: Path) -> None:
    one = commit_step(root, "run-1", 10, tmp_path)
    two = commit_step(root, "run-1", 20, tmp_path)
    assert resolve_checkpoint(one, root).step == 10
    latest = resolve_checkpoint(f"{root}/run-1", root)
    assert (latest.step, latest.url, latest.run_url) == (20, two, f"{root}/run-1")
    with pytest.raises(RegistryError, match=r"m@production: the alias names no checkpoint .*trainpipe model promote"):
        resolve_checkpoint("m@production", root)
    Registry(root).promote("m", "production", one, metrics={}, reason="r", who="t")
    assert resolve_checkpoint("m@production", root).url == one
    with pytest.raises(RegistryError, match="step 30 is not committed"):
        resolve_checkpoint(f"{root}/run-1/step-00000030", root)
    with pytest.raises(RegistryError, match="no committed checkpoint under it"):
        resolve_checkpoint(f"{root}/run-9", root)
    assert registry_root_of(f"{root}/run-1") == root


def test_promote_history_rollback(root: str, tmp_path: Path) -> None:
    registry = Registry(root)
    night1 = commit_step(root, "night-1", 5, tmp_path)
    night2 = commit_step(root, "night-2", 5, tmp_path)
    first = registry.promote("m", "production", night1, metrics={"eval_loss": 2.0}, reason="first promotion",
                             who="alice", run_id="night-1")
    assert (first.seq, first.previous, first.target) == (1, None, night1)
    with pytest.raises(AliasConflict, match="not at None as expected"):
        registry.promote("m", "production", night2, metrics={}, reason="r", who="bob", expected_previous=None)
    second = registry.promote("m", "production", f"{root}/night-2", metrics={"eval_loss": 1.0}, reason="better",
                              who="bob", expected_previous=night1)
    assert (second.previous, second.target) == (night1, night2)
    assert registry.models() == {"m": {"production": second}}
    back = registry.rollback("m", "production", who="carol")
    assert (back.target, back.previous, back.rollback_of, back.seq) == (night1, night2, 2, 3)
    assert registry.resolve("m", "production").target == night1
    assert [m.seq for m in registry.history("m", "production")] == [1, 2, 3]
    assert registry.rollback("m", "production", who="carol").target == night2  # undoes the rollback
    registry.rollback("m", "production", who="carol")
    nothing = Registry(root)
    nothing.promote("m", "staging", night2, metrics={}, reason="r", who="t")
    nothing.rollback("m", "staging", who="t")
    assert nothing.resolve("m", "staging") is None  # rolled back past its first promotion: names nothing
    with pytest.raises(RegistryError, match="never moved"):
        registry.rollback("m", "canary", who="t")
    with pytest.raises(RegistryError, match="step 7 is not committed"):
        registry.promote("m", "production", f"{root}/night-2/step-00000007", metrics={}, reason="r", who="t")
    with pytest.raises(RegistryError, match="model 'bad/name'"):
        registry.resolve("bad/name", "production")


def test_retention_keeps_what_aliases_point_at(root: str, tmp_path: Path) -> None:
    steps = [commit_step(root, "run-1", step, tmp_path) for step in (1, 2, 3, 4, 5)]
    registry = Registry(root)
    registry.promote("m", "production", steps[0], metrics={}, reason="r", who="t")
    registry.promote("m", "production", steps[1], metrics={}, reason="r", who="t")
    registry.promote("m", "staging", steps[2], metrics={}, reason="r", who="t")
    assert registry.protected(f"{root}/run-1") == {1, 2, 3}
    assert registry.protected(f"{root}/run-1", recent_moves=1) == {1, 2, 3}  # step 1: where production came from
    assert registry.protected(f"{root}/run-2") == set()
    checkpoints = CheckpointStore(open_store(f"{root}/run-1"))
    deleted = checkpoints.apply_retention(1, protected=registry.protected(f"{root}/run-1"))
    assert deleted == [4]
    assert [m.step for m in checkpoints.committed()] == [5, 3, 2, 1]


def test_promote_refuses_a_checkpoint_outside_the_root_s3(s3_url: str, tmp_path: Path) -> None:
    """Retention in a run asks the registry at the run's parent: an alias kept under another root would not stop it
    deleting the promoted step, so the registry refuses to point at it and writes nothing."""
    root = f"{s3_url}/ckpts"
    outside = commit_step(f"{s3_url}/other", "run-1", 1, tmp_path)
    registry = Registry(root)
    with pytest.raises(RegistryError, match=rf"{outside}: outside the registry root {root}.*--root {s3_url}/other"):
        registry.promote("m", "production", outside, metrics={}, reason="r", who="t")
    assert registry.models() == {} and list(registry.store.list("_registry/")) == []
    home = Registry(registry_root_of(f"{s3_url}/other/run-1"))
    home.promote("m", "production", outside, metrics={}, reason="r", who="t")
    assert home.protected(f"{s3_url}/other/run-1") == {1}


def test_lineage_and_eval_beside_the_manifest(root: str, tmp_path: Path) -> None:
    lineage = Lineage.model_validate({**LINEAGE, "parent": f"{root}/run-1/step-00000001"})
    url = commit_step(root, "run-2", 3, tmp_path, lineage=lineage)
    checkpoints = CheckpointStore(open_store(f"{root}/run-2"))
    assert checkpoints.manifest(3).lineage == lineage
    assert checkpoints.eval(3) is None
    checkpoints.record_eval(3, {"eval_loss": 1.5}, "python eval.py")
    assert checkpoints.eval(3).metrics == {"eval_loss": 1.5}
    assert checkpoints.list_steps()[0].files == 1  # eval.json is about the checkpoint, not part of it
    assert resolve_checkpoint(url, root).step == 3


def test_two_promoters_race_file(root: str, tmp_path: Path) -> None:
    check_race(root, tmp_path, racers=3)


def test_two_promoters_race_s3(s3_url: str, tmp_path: Path) -> None:
    check_race(f"{s3_url}/ckpts", tmp_path)


def test_two_promoters_race_gcs(gs_url: str, tmp_path: Path) -> None:
    check_race(f"{gs_url}/ckpts", tmp_path)


def test_two_promoters_race_azure(az_url: str, tmp_path: Path) -> None:
    check_race(f"{az_url}/ckpts", tmp_path)


def test_the_syncer_records_lineage_and_retention_spares_what_an_alias_holds(tmp_path: Path) -> None:
    """Through the real syncer process: every manifest carries its lineage; keep=1 deletes old steps but not the one
    production points at (the registry is found at the parent of the run's URL)."""
    root = f"file://{tmp_path}/store"
    checkpoints = CheckpointStore(open_store(f"{root}/run-1"))
    ckpt_dir = node_dirs(tmp_path, nodes=1)[0]
    lineage_file = tmp_path / "lineage.json"
    lineage_file.write_text(json.dumps(LINEAGE))
    stop = tmp_path / "stop"
    syncer = SyncProcess(tmp_path, ckpt_dir, checkpoints.store.url, 0, stop_file=str(stop),
                         lineage=str(lineage_file), nodes=1, keep=1)
    try:
        make_step(ckpt_dir, 100, 0, world_size=1)
        syncer.wait_for(is_event(NodeEvent.COMMITTED, 100))
        Registry(root).promote("m", "production", f"{root}/run-1", metrics={}, reason="first", who="t")
        for step in (200, 300):
            make_step(ckpt_dir, step, 0, world_size=1)
            syncer.wait_for(is_event(NodeEvent.COMMITTED, step))
        syncer.wait_for(is_event(NodeEvent.RETENTION))
        stop.touch()
        assert syncer.finish() == 0
    finally:
        syncer.finish(timeout=0)
    assert [manifest.step for manifest in checkpoints.committed()] == [300, 100]
    assert all(manifest.lineage == Lineage.model_validate(LINEAGE) for manifest in checkpoints.committed())


def test_the_syncer_refuses_a_lineage_file_that_is_not_one(tmp_path: Path) -> None:
    bad = tmp_path / "lineage.json"
    bad.write_text('{"run_id": "x"}')
    syncer = SyncProcess(tmp_path, node_dirs(tmp_path, nodes=1)[0], f"file://{tmp_path}/store/run-1", 0,
                         lineage= str(bad), nodes=1)
    assert syncer.finish() == 2
    assert f"lineage {bad}: not a Lineage" in syncer.err.read_text()
