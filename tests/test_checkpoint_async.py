"""Async checkpoints: the training loop continues on a staged copy, one save in flight, markers only for whole steps;
local retention spares the step the syncer is uploading; per-checkpoint metrics reach the run summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_trainer import TINY_CONFIG

from infra.checkpoints.upload_lease import UPLOAD_LEASE, write_lease
from infra.node.events import Event, NodeEvent, WorkloadEvent
from infra.workload.contract import SYNC_DIR_VAR
from tasks.report import checkpoint_metrics
from trainer.checkpoint import (
    Checkpointer,
    CheckpointError,
    complete_steps,
    inspect_checkpoint,
    prune_local,
    read_marker,
    step_dir_name,
)
from trainer.model import GPT


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(TINY_CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    return model, optimizer


def _saved_model_state(step_dir: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    template = {"model": {k: torch.empty_like(v) for k, v in GPT(TINY_CONFIG).state_dict().items()}}
    dcp.load(template, checkpoint_id=step_dir, no_dist=True)
    return template["model"]


def test_async_save_writes_the_state_of_the_moment_it_was_called(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(tmp_path, "async", keep_local=2) as checkpointer:
        checkpointer.save(1, model, optimizer, {"step": 1})
        assert checkpointer.in_flight_step == 1
        with torch.no_grad():  # training goes on while the background thread writes
            for param in model.parameters():
                param.add_(1.0)
        checkpointer.save(2, model, optimizer, {"step": 2})  # waits for step 1: one save in flight at most
        first = checkpointer.finished()
        assert [r.step for r in first] == [1] and first[0].mode == "async"
        assert 0 <= first[0].stall_s <= first[0].write_s and first[0].bytes > 0
    saved = _saved_model_state(tmp_path / step_dir_name(1))
    for name, tensor in expected.items():
        assert torch.equal(saved[name], tensor), name
    assert complete_steps(tmp_path) == [1, 2]
    assert read_marker(tmp_path, 2)["files"] == sorted(p.name for p in (tmp_path / step_dir_name(2)).iterdir())
    assert inspect_checkpoint(tmp_path / step_dir_name(2))["step"] == 2


def test_sync_and_async_write_the_same_checkpoint(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    for mode in ("sync", "async"):
        with Checkpointer(tmp_path / mode, mode) as checkpointer:
            checkpointer.save(5, model, optimizer, {"step": 5})
            [record] = checkpointer.finished() or checkpointer.wait()
            assert record.mode == mode
    sync_state, async_state = (_saved_model_state(tmp_path / m / step_dir_name(5)) for m in ("sync", "async"))
    assert all(torch.equal(sync_state[k], async_state[k]) for k in sync_state)


def test_a_prepared_staging_buffer_still_saves_the_state_of_the_save_call(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    with Checkpointer(tmp_path, "async") as checkpointer:
        checkpointer.prepare(model, optimizer)  # copies the state as it is now into the staging buffer
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(-2.0)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        checkpointer.save(3, model, optimizer, {"step": 3})
    saved = _saved_model_state(tmp_path / step_dir_name(3))
    assert all(torch.equal(saved[name], tensor) for name, tensor in expected.items())


def test_a_bad_mode_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    modes = r"async, sync, direct \(--ckpt-mode\)"
    with pytest.raises(CheckpointError, match=rf"checkpoint mode 'fast': use one of {modes}"):
        Checkpointer(tmp_path, "fast")


def _make_complete(ckpt_root: Path, step: int) -> None:
    (ckpt_root / step_dir_name(step)).mkdir(parents=True)
    (ckpt_root / f"{step_dir_name(step)}.complete").write_text(json.dumps({"step": step}))


def test_local_retention_spares_the_step_a_live_syncer_is_uploading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, sync_dir = tmp_path / "ckpt", tmp_path / "sync"
    sync_dir.mkdir()
    monkeypatch.setenv(SYNC_DIR_VAR, str(sync_dir))  # what trainpipe tells the script: where its syncer leases
    for step in (10, 20, 30, 40):
        _make_complete(ckpt, step)
    write_lease(sync_dir, UPLOAD_LEASE, 10)  # this test process stands in for a live syncer
    assert prune_local(ckpt, 2) == [20]
    assert complete_steps(ckpt) == [10, 30, 40]
    assert not (ckpt / UPLOAD_LEASE).exists(), "the syncer's lease never lands in the script's checkpoint dir"

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (sync_dir / UPLOAD_LEASE).write_text(json.dumps({"step": 10, "pid": int(finished.stdout)}))
    assert prune_local(ckpt, 2) == [10]  # a dead syncer's lease holds nothing back
    (sync_dir / UPLOAD_LEASE).write_text("{")
    with pytest.raises(CheckpointError, match=rf"{UPLOAD_LEASE}: corrupt lease"):
        prune_local(ckpt, 1)


def test_per_checkpoint_metrics_fold_trainer_and_syncer_events() -> None:
    trainer = [
        {"step": 1, "loss": 5.0},
        {"event": WorkloadEvent.CHECKPOINT, "step": 10, "mode": "async", "stall_s": 0.01, "write_s": 0.5, "bytes": 100},
    ]
    sync = [
        Event(NodeEvent.UPLOADED, {"step": 10, "node_rank": 0, "bytes": 100, "seconds": 0.2, "mb_per_s": 50.0}),
        Event(NodeEvent.UPLOADED, {"step": 10, "node_rank": 1, "bytes": 50, "seconds": 0.4, "mb_per_s": 12.5}),
        Event(NodeEvent.SKIPPED, {"step": 5, "reason": "deleted locally before upload"}),
        Event(NodeEvent.COMMITTED, {"step": 10, "bytes": 150, "commit_s": 0.9, "files": 3}),
    ]
    assert checkpoint_metrics(trainer, sync) == [
        {"step": 10, "mode": "async", "stall_s": 0.01, "write_s": 0.5, "local_bytes": 100, "upload_s": 0.4,
         "upload_mb_per_s": 12.5, "commit_s": 0.9, "committed_bytes": 150},
    ]


def test_bench_ckpt_refuses_a_model_whose_checkpoint_is_too_small_to_measure() -> None:
    from typer.testing import CliRunner

    from trainpipe.cli import app

    result = CliRunner().invoke(app, ["bench", "ckpt", "--d-model", "64", "--n-layers", "1", "--n-heads", "4"])
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert line == "error: a checkpoint of d_model 64 x 1 layers is ~1 MB, under 200 MB: raise --d-model or --n-layers"
