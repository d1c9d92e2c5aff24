"""kill -9 of a training script in the middle of its saves, for every checkpoint format the syncer recognises.

Each format's writer uses that framework's own save routine (torch.distributed.checkpoint.save, the Hugging Face
Trainer's _save_checkpoint, Lightning's TorchCheckpointIO, trainpipe_sdk.mark_complete, torch.save in place) in a
loop, and is killed at random (seeded) instants while the node's syncer runs beside it. After every kill the store's
latest checkpoint verifies byte for byte and loads with the framework's own loader; at the end every committed
checkpoint does. Nothing half-written is ever committed.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_crash_consistency import kill_pid
from test_syncer import SyncProcess
from zygote import FORK_PER_LINE

from infra.checkpoints.layout import CheckpointManifest
from infra.checkpoints.store import CheckpointStore
from infra.storage import open_store

KILL_POINTS = 6

# Forked per writer from a process that imported the framework once (imports take seconds on a loaded machine).
ZYGOTE = """
import json, os, signal, sys, time
import torch
from pathlib import Path
fmt, root = sys.argv[1], Path(sys.argv[2])
root.mkdir(parents=True, exist_ok=True)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
torch.set_num_threads(1)
if fmt == "hf":
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=256, n_layer=2, n_head=2))
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(root), use_cpu=True, report_to=[],
                                                          save_total_limit=3))
    trainer.create_optimizer_and_scheduler(num_training_steps=100000)
elif fmt == "lightning":
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    checkpoint_io = TorchCheckpointIO()
elif fmt == "dcp":
    import torch.distributed.checkpoint as dcp
elif fmt == "marker":
    from trainpipe_sdk import mark_complete
weights = torch.randn(512, 1024)  # 2 MB: long enough a save for kills to land inside one
# A file rewritten in place must stay put long enough to be uploaded: every few tenths of a second, not nonstop.
pause = 0.3 if fmt == "file" else 0.02
""" + FORK_PER_LINE + """
    while True:
        step += 1
        weights[0, 0] = step
        if fmt == "dcp":
            dcp.save({"w": weights, "step": torch.tensor(step)}, checkpoint_id=root / f"step-{step}", no_dist=True)
        elif fmt == "hf":
            trainer.state.global_step = step
            trainer._save_checkpoint(trainer.model, trial=None)
        elif fmt == "lightning":
            checkpoint_io.save_checkpoint({"w": weights, "global_step": step}, root / f"epoch=0-step={step}.ckpt")
        elif fmt == "file":
            torch.save({"w": weights, "step": step}, root / "snapshot.pt")
        elif fmt == "marker":
            folder = root / f"ck-{step}"
            folder.mkdir()
            for part in ("a.bin", "b.bin"):
                with open(folder / part, "wb") as out:
                    out.write(step.to_bytes(8, "little") + weights.numpy().tobytes())
            mark_complete(folder)
        time.sleep(pause)
"""


def load_and_check(fmt: str, path: Path, manifest: CheckpointManifest) -> None:
    """Load what was committed with the framework's own loader."""
    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        state = {"w": torch.empty(512, 1024), "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=path, no_dist=True)
        assert int(state["step"]) == manifest.step == int(state["w"][0, 0])
    elif fmt == "hf":
        from safetensors.torch import load_file

        assert json.loads((path / "trainer_state.json").read_text())["global_step"] == manifest.step
        assert load_file(path / "model.safetensors")
        torch.load(path / "optimizer.pt", weights_only=True)
    elif fmt == "lightning":
        loaded = torch.load(path, weights_only=False)
        assert loaded["global_step"] == manifest.step == int(loaded["w"][0, 0])
    elif fmt == "file":
        loaded = torch.load(path, weights_only=False)
        assert int(loaded["w"][0, 0]) == loaded["step"]
    else:
        parts = [(path / name).read_bytes() for name in ("a.bin", "b.bin")]
        assert parts[0] == parts[1] and int.from_bytes(parts[0][:8], "little") == manifest.step


def assert_committed_load(fmt: str, checkpoints: CheckpointStore, scratch: Path, every: bool = False) -> None:
    manifests = checkpoints.committed() if every else [m for m in [checkpoints.latest()] if m is not None]
    for index, manifest in enumerate(manifests):
        checkpoints.verify(manifest.step, deep=True)
        load_and_check(fmt, checkpoints.restore(scratch / f"{manifest.step}-{index}", manifest.step), manifest)


@pytest.mark.parametrize("fmt", ["dcp", "hf", "lightning", "marker", "file"])
def test_kill_9_mid_save_never_commits_a_torn_checkpoint(fmt: str, tmp_path: Path) -> None:
    rng = random.Random(fmt)
    ckpt_dir = tmp_path / "node-0" / "ckpt"
    checkpoints = CheckpointStore(open_store(f"file://{tmp_path / 'store'}"))
    zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE, fmt, str(ckpt_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    # keep is large so retention never deletes a step this test is verifying concurrently.
    syncer = SyncProcess(tmp_path, ckpt_dir, checkpoints.store.url, 0, nodes=1, keep=1000, fmt=fmt)
    assert zygote.stdin is not None and zygote.stdout is not None
    try:
        for point in range(KILL_POINTS):
            zygote.stdin.write(f"{point * 1000}\n")
            zygote.stdin.flush()
            writer = int(zygote.stdout.readline())
            time.sleep(rng.uniform(0.3, 1.5))
            kill_pid(writer)
            assert_committed_load(fmt, checkpoints, tmp_path / f"restored-{point}")
        stop = tmp_path / "stop"
        stop.touch()
        syncer.proc.kill()
        syncer.proc.wait()
        # A restarted syncer flushes what is complete, and commits nothing that is not.
        assert SyncProcess(tmp_path, ckpt_dir, checkpoints.store.url, 0, stop_file=str(stop), nodes=1,
                           keep=1000, fmt=fmt).finish() == 0
    finally:
        zygote.kill()
        zygote.wait()
        syncer.proc.kill()
        syncer.finish()
    assert len(checkpoints.committed()) >= 2, "too few commits for the kills to prove anything"
    assert_committed_load(fmt, checkpoints, tmp_path / "restored-all", every=True)
