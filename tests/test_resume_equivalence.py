"""A run stopped by SIGTERM after a commit and resumed from the store ends with the parameters of a run never
interrupted (same seed, CPU, gloo) — resumed on 2 nodes, and resharded onto 1 and onto 3.

The SIGTERM path is the real one: the trainers stop together at a step boundary, save that step, exit 143, and
the syncers flush it, so the resume continues from exactly where training stopped.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch
from test_checkpoint_async import _saved_model_state
from test_syncer import SyncProcess
from test_trainer import VOCAB, markov_shards, merge_step, run_nodes, start_nodes, trainer_args, write_dataset

from infra.checkpoints.store import CheckpointStore
from infra.storage import open_store
from trainer.checkpoint import complete_steps

STEPS = 20
GLOBAL_BATCH = 24  # divisible by 1, 2 and 3 nodes: every layout draws the same global batch per step
FAST_SAVES = ("--ckpt-every", "4", "--warmup-steps", "4")


def node_args(data_dir: Path, node_dirs: list[Path], *extra: str) -> list[list[str]]:
    batch = GLOBAL_BATCH // len(node_dirs)
    return [trainer_args(data_dir, node, STEPS, batch, *FAST_SAVES, *extra) for node in node_dirs]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("markov"), markov_shards(11, VOCAB, [40_000, 30_000]), VOCAB)


@pytest.fixture(scope="module")
def uninterrupted(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    nodes = [tmp_path_factory.mktemp(f"whole{i}") for i in range(2)]
    run_nodes(node_args(data_dir, nodes))
    return _saved_model_state(merge_step(nodes, STEPS, tmp_path_factory.mktemp("whole-merged")))


@pytest.fixture(scope="module")
def interrupted(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> CheckpointStore:
    """Two nodes with their syncers, SIGTERMed once a first checkpoint is on local disk; returns the store.

    The trigger is the local completion marker, not the store's commit: the syncer's poll and upload can take
    longer than the remaining steps on a loaded machine, and then the SIGTERM would interrupt nothing."""
    root = tmp_path_factory.mktemp("interrupted")
    nodes = [root / f"node{i}" for i in range(2)]
    checkpoints = CheckpointStore(open_store(f"file://{root / 'store'}"))
    stop = root / "stop-sync"
    for node in nodes:
        (node / "ckpt").mkdir(parents=True)
    syncers = [SyncProcess(root, node / "ckpt", checkpoints.store.url, rank, stop_file=str(stop), keep=10)
               for rank, node in enumerate(nodes)]
    agents = start_nodes(node_args(data_dir, nodes, "--flush-deadline-s", "20"))
    try:
        deadline = time.monotonic() + 120
        while not complete_steps(nodes[0] / "ckpt"):
            assert all(agent.poll() is None for agent in agents), "training ended before its first save"
            assert time.monotonic() < deadline, "no checkpoint was saved within 120 s"
            time.sleep(0.02)
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        outputs = [agent.communicate(timeout=60) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()
    stop.touch()
    finished = [syncer.finish() for syncer in syncers]
    # What both sides said, for a failure below: trainers' and syncers' stderr, and each node's checkpoint dir.
    said = "\n".join([*(f"--- trainer {rank} stderr:\n{err[-2500:]}" for rank, (_, err) in enumerate(outputs)),
                      *(f"--- syncer {rank} stderr:\n{syncer.err.read_text()[-1500:]}"
                        for rank, syncer in enumerate(syncers)),
                      *(f"--- node {rank} ckpt: {sorted(str(p.relative_to(node)) for p in (node / 'ckpt').rglob('*'))}"
                        for rank, node in enumerate(nodes))])
    assert finished == [0, 0], said

    stopped = [line for _, err in outputs for line in err.splitlines() if "stopped by SIGTERM after step" in line]
    assert len(stopped) == 2, said
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert 0 < step < STEPS, "SIGTERM came too late to interrupt anything"
    assert all(line.endswith((f"after step {step}: saved step {step}", f"after step {step}: step {step} is saved"))
               for line in stopped), said
    latest = checkpoints.latest()
    assert latest is not None and latest.step == step, f"the last save on SIGTERM was not committed:\n{said}"
    return checkpoints


@pytest.mark.parametrize("nodes", [2, 1, 3], ids=["2-to-2", "2-to-1", "2-to-3"])
def test_a_resumed_run_ends_where_the_uninterrupted_one_does(
    nodes: int, data_dir: Path, uninterrupted: dict[str, torch.Tensor], interrupted: CheckpointStore, tmp_path: Path
) -> None:
    restored, manifest, warnings = interrupted.restore_latest(tmp_path / "restored")
    assert warnings == [] and manifest.nodes == 2
    node_dirs = [tmp_path / f"node{i}" for i in range(nodes)]
    outputs = run_nodes(node_args(data_dir, node_dirs, "--resume-from", str(restored)))
    assert any(f"resumed from {restored} at step {manifest.step + 1}" in out for out in outputs)

    resumed = _saved_model_state(merge_step(node_dirs, STEPS, tmp_path / "merged"))
    for name, expected in uninterrupted.items():
        # Gradients summed in a different order (another world size) differ in the last bits only.
        torch.testing.assert_close(resumed[name], expected, rtol=1e-4, atol=1e-5, msg=name)
