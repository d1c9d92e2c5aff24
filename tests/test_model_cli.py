"""`trainpipe model ls|show|promote|rollback|lineage` and `ckpt verify`'s ancestor check, as a user runs them."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import run_trainpipe
from registry_checks import commit_step

from infra.checkpoints.lineage import Lineage
from infra.checkpoints.store import CheckpointStore
from infra.storage import open_store


def lineage(run_id: str, parent: str | None) -> Lineage:
    return Lineage.model_validate({
        "run_id": run_id, "attempt": "a1",
        "dataset": {"url": f"file:///data/{run_id}", "snapshot_digest": "d-" + run_id},
        "code_sha256": "c" * 64, "config_hash": "cfg", "parent": parent, "cluster": {"provider": "local", "nodes": 1}})


def model(*args: str, root: str) -> tuple[int, str, str]:
    done = run_trainpipe("model", *args, "--root", root)
    return done.returncode, done.stdout, done.stderr


def test_promote_show_rollback_lineage_and_verify_ancestors(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/ckpts"
    night1 = commit_step(root, "night-1", 10, tmp_path, lineage("night-1", None))
    night2 = commit_step(root, "night-2", 10, tmp_path, lineage("night-2", night1))
    CheckpointStore(open_store(f"{root}/night-2")).record_eval(10, {"eval_loss": 1.25}, "python eval.py")

    assert model("ls", root=root)[1].endswith("no models yet (trainpipe model promote NAME@alias CKPT)\n")
    code, out, _ = model("promote", "gpt@production", night1, root=root)
    assert code == 0 and out == f"gpt@production -> {night1} (its first promotion)\n"
    code, _, err = model("promote", "gpt@production", f"{root}/night-2", "--expect", "none", root=root)
    assert code == 2 and err.startswith("error: gpt@production: points at ") and len(err.splitlines()) == 1
    code, out, _ = model("promote", "gpt@production", f"{root}/night-2", "--expect", night1, root=root)
    assert code == 0 and out == f"gpt@production -> {night2} (was {night1})\n"
    code, out, _ = model("show", "gpt@production", root=root)
    assert code == 0 and f"gpt@production -> {night2}" in out and "eval: eval_loss=1.25" in out
    assert "#1 " in out and "#2 " in out and "[eval_loss=1.25] promoted by hand" in out

    code, out, _ = model("lineage", "gpt@production", root=root)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == night1 and lines[4] == f"  -> {night2}", out
    assert "dataset file:///data/night-1 @ d-night-1" in out and "dataset file:///data/night-2 @ d-night-2" in out
    assert f"code {'c' * 64}" in out

    code, out, _ = model("rollback", "gpt@production", root=root)
    assert code == 0 and out == f"gpt@production -> {night1} (rolled back from {night2})\n"
    assert model("ls", root=root)[1].startswith(f"gpt@production  {night1}  move #3 ")

    verified = run_trainpipe("ckpt", "verify", night2)
    assert verified.returncode == 0 and f'"ancestors": ["{night1}"]' in verified.stdout, verified.stderr
    shutil.rmtree(tmp_path / "ckpts" / "night-1")
    verified = run_trainpipe("ckpt", "verify", night2)
    assert verified.returncode == 2 and f"its parent {night1} is gone" in verified.stderr, verified.stderr


def test_bad_references_exit_2_with_one_line(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/ckpts"
    for args, message in [
        (("promote", "gpt", f"{root}/x"), "error: 'gpt': not NAME@alias"),
        (("promote", "gpt@production", f"{root}/run-9"), "no committed checkpoint under it"),
        (("rollback", "gpt@production"), "never moved, nothing to roll back"),
        (("show", "gpt"), "no such model or alias"),
        (("lineage", "gpt@production"), "the alias names no checkpoint"),
    ]:
        code, _, err = model(*args, root=root)
        assert code == 2 and message in err and len(err.splitlines()) == 1, (args, err)


def test_promote_refuses_a_checkpoint_its_runs_retention_would_not_keep(tmp_path: Path) -> None:
    """A run's retention keeps what the registry at the run's parent protects: an alias under another root (or a
    root above that parent) would not keep its checkpoint from being deleted, so the promotion is refused."""
    root = f"file://{tmp_path}/ckpts"
    elsewhere = commit_step(f"file://{tmp_path}/other", "night-1", 10, tmp_path)
    nested = commit_step(f"{root}/team", "night-2", 10, tmp_path)
    for checkpoint, its_root in [(elsewhere, f"file://{tmp_path}/other"), (nested, f"{root}/team")]:
        code, out, err = model("promote", "gpt@production", checkpoint, root=root)
        assert code == 2 and out == "" and len(err.splitlines()) == 1, err
        assert checkpoint in err and f"outside the registry root {root}" in err and f"--root {its_root}" in err, err
    assert model("ls", root=root)[1].endswith("no models yet (trainpipe model promote NAME@alias CKPT)\n")
    code, out, _ = model("promote", "gpt@production", nested, root=f"{root}/team")
    assert code == 0 and out == f"gpt@production -> {nested} (its first promotion)\n"
