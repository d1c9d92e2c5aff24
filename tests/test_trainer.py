"""The trainer: model and data units, then real torchrun jobs (2 agents as 2 nodes, then a 1-node resume)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from infra.node.events import WorkloadEvent
from trainer.checkpoint import CheckpointError, complete_steps, inspect_checkpoint, read_marker, step_dir_name
from trainer.data import DataError, TokenWindows
from trainer.model import GPT, GPTConfig
from trainer.train import lr_at

JUMP_WEIGHTS = (0.6, 0.2, 0.1, 0.1)
LOSS_FLOOR = float(-sum(w * np.log(w) for w in JUMP_WEIGHTS))
TORCHRUN = Path(sys.executable).with_name("torchrun")
REPO_ROOT = Path(__file__).resolve().parents[1]

VOCAB = 64
TINY_MODEL = ["--vocab-size", str(VOCAB), "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32"]
TINY_CONFIG = GPTConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, seq_len=32)


def write_dataset(root: Path, shards: list[np.ndarray], vocab_size: int, seed: int = 0) -> Path:
    """A trainpipe-tokens-v1 dataset dir holding the given token arrays as shards."""
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for index, tokens in enumerate(shards):
        name = f"shard-{index:05d}.bin"
        raw = tokens.astype("<u2").tobytes()
        (root / name).write_bytes(raw)
        entries.append({"name": name, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                        "tokens": len(tokens)})
    manifest = {
        "format": "trainpipe-tokens-v1",
        "dtype": "uint16",
        "vocab_size": vocab_size,
        "seed": seed,
        "generator": {"kind": "test-markov", "branching": list(JUMP_WEIGHTS)},
        "loss_floor": LOSS_FLOOR,
        "total_tokens": sum(len(t) for t in shards),
        "shards": entries,
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def markov_shards(seed: int, vocab_size: int, shard_tokens: list[int]) -> list[np.ndarray]:
    """x_{t+1} = sigma[(sigma^-1[x_t] + k_t) mod V], k_t ~ JUMP_WEIGHTS: the best loss is their entropy."""
    rng = np.random.default_rng(seed)
    sigma = rng.permutation(vocab_size)
    shards = []
    for count in shard_tokens:
        jumps = rng.choice(len(JUMP_WEIGHTS), size=count, p=JUMP_WEIGHTS)
        positions = (rng.integers(vocab_size) + np.cumsum(jumps)) % vocab_size
        shards.append(sigma[positions])
    return shards


@pytest.fixture(scope="module")
def markov_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("markov"), markov_shards(7, VOCAB, [40_000, 30_000, 25_000]), VOCAB)


# --- units ----------------------------------------------------------------------------------------------


def test_model_forward_gives_logits_per_position() -> None:
    model = GPT(TINY_CONFIG)
    tokens = torch.randint(0, VOCAB, (3, 20))
    assert model(tokens).shape == (3, 20, VOCAB)
    with pytest.raises(ValueError, match="seq_len 32"):
        model(torch.randint(0, VOCAB, (1, 33)))


def test_model_rejects_heads_that_do_not_divide_width() -> None:
    with pytest.raises(ValueError, match=r"n_heads \(3\) must divide d_model \(32\)"):
        GPTConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=3, seq_len=8)


def test_batches_are_a_pure_function_of_seed_step_rank(markov_dir: Path) -> None:
    data = TokenWindows(markov_dir, seq_len=32, vocab_size=VOCAB)
    batch = data.train_batch(seed=1, step=5, rank=1, world_size=2, batch_size=4)
    assert batch.shape == (4, 33) and batch.dtype == torch.int64
    assert torch.equal(batch, TokenWindows(markov_dir, 32, VOCAB).train_batch(1, 5, 1, 2, 4))
    assert not torch.equal(batch, data.train_batch(1, 6, 1, 2, 4))
    assert not torch.equal(batch, data.train_batch(1, 5, 0, 2, 4))
    assert not torch.equal(batch, data.train_batch(2, 5, 1, 2, 4))
    eval_batches = data.eval_batches(seed=1, num_batches=2, batch_size=4)
    assert all(torch.equal(a, b) for a, b in zip(eval_batches, data.eval_batches(1, 2, 4), strict=True))
    assert not any(torch.equal(e, batch) for e in eval_batches)


def test_windows_stay_inside_one_shard(tmp_path: Path) -> None:
    # Each shard holds one repeated token, so a window crossing a boundary would mix two values.
    shards = [np.full(20, 1), np.full(9, 2), np.full(5, 3)]
    data = TokenWindows(write_dataset(tmp_path, shards, vocab_size=4), seq_len=8, vocab_size=4)
    assert data.num_windows == 12 + 1
    rows = torch.cat([data.train_batch(0, step, 0, 1, 16) for step in range(20)])
    assert all(len(set(row.tolist())) == 1 for row in rows)
    assert set(rows[:, 0].tolist()) == {1, 2}  # the 5-token shard is too short for a 9-token window


@pytest.mark.parametrize("remote", [False, True], ids=["staged dir", "store url"])
def test_dataset_errors_name_the_file_and_the_fix(tmp_path: Path, remote: bool) -> None:
    data_dir = write_dataset(tmp_path / "data", [np.zeros(100)], vocab_size=8)
    source: Path | str = f"file://{data_dir}" if remote else data_dir
    fix = "re-upload" if remote else "re-stage"
    with pytest.raises(DataError, match=r"manifest.json: dataset vocab_size 8 != model vocab_size 16"):
        TokenWindows(source, seq_len=8, vocab_size=16)
    (data_dir / "shard-00000.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match=rf"{source}/shard-00000.bin: 10 bytes but the manifest says 200: {fix}"):
        TokenWindows(source, seq_len=8, vocab_size=8)
    (data_dir / "shard-00000.bin").unlink()
    with pytest.raises(DataError, match=rf"{source}/shard-00000.bin: shard listed in the manifest is missing"):
        TokenWindows(source, seq_len=8, vocab_size=8)
    if remote:
        with pytest.raises(DataError, match=rf"file://{tmp_path}/nowhere/manifest.json: no dataset manifest"):
            TokenWindows(f"file://{tmp_path}/nowhere", seq_len=8, vocab_size=8)


def test_lr_warms_up_then_decays_to_a_tenth() -> None:
    assert lr_at(5, 1.0, warmup_steps=10, total_steps=100) == pytest.approx(0.5)
    assert lr_at(10, 1.0, 10, 100) == pytest.approx(1.0)
    assert lr_at(55, 1.0, 10, 100) == pytest.approx(0.55)
    assert lr_at(100, 1.0, 10, 100) == pytest.approx(0.1)


# --- real torchrun jobs ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_node(nnodes: int, port: int, rdzv_id: str, is_host: bool, trainer_args: list[str]) -> subprocess.Popen:
    command = [
        str(TORCHRUN),
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf=is_host={str(is_host).lower()},join_timeout=60",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
        "-m",
        "trainer.train",
        *trainer_args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start_nodes(node_args: list[list[str]]) -> list[subprocess.Popen]:
    """Starts one torchrun agent per entry as the nodes of one job."""
    port, rdzv_id = _free_port(), uuid.uuid4().hex[:12]
    return [_start_node(len(node_args), port, rdzv_id, i == 0, args) for i, args in enumerate(node_args)]


def launch(node_args: list[list[str]], timeout_s: float = 120) -> list[tuple[int, str, str]]:
    """Runs one torchrun agent per entry as the nodes of one job; returns each node's (exit code, stdout, stderr)."""
    nodes = start_nodes(node_args)
    outputs = [node.communicate(timeout=timeout_s) for node in nodes]
    return [(node.returncode, out, err) for node, (out, err) in zip(nodes, outputs, strict=True)]


def run_nodes(node_args: list[list[str]], timeout_s: float = 120) -> list[str]:
    """launch() that must succeed on every node; returns each node's stdout."""
    results = launch(node_args, timeout_s)
    for returncode, stdout, stderr in results:
        assert returncode == 0, f"torchrun exited {returncode}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return [stdout for _, stdout, _ in results]


def trainer_args(data_dir: Path, node_dir: Path, steps: int, batch_size: int, *extra: str) -> list[str]:
    return [
        *("--data-dir", str(data_dir), "--ckpt-dir", str(node_dir / "ckpt")),
        *("--metrics-file", str(node_dir / "metrics.jsonl")),
        *("--steps", str(steps), "--ckpt-every", "20", "--keep-local", "2", "--batch-size", str(batch_size)),
        *("--lr", "3e-3", "--warmup-steps", "10", "--seed", "3", "--log-every", "1", "--eval-batches", "4"),
        *TINY_MODEL,
        *extra,
    ]


def read_metrics(path: Path) -> tuple[dict[int, float], dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "event" not in r and "step" in r}
    (done,) = [r for r in records if "eval_loss" in r]
    return losses, done


@pytest.fixture(scope="module")
def two_node_run(markov_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    nodes = [tmp_path_factory.mktemp(f"node{i}") for i in range(2)]
    run_nodes([trainer_args(markov_dir, node, 60, 8) for node in nodes])
    return nodes


def _node_with_rank(nodes: list[Path], node_rank: int, step: int) -> Path:
    (node,) = [n for n in nodes if read_marker(n / "ckpt", step)["node_rank"] == node_rank]
    return node


def test_two_nodes_train_and_checkpoint_to_their_own_disks(two_node_run: list[Path]) -> None:
    coordinator = _node_with_rank(two_node_run, 0, 60)
    losses, done = read_metrics(coordinator / "metrics.jsonl")
    assert sorted(losses) == list(range(1, 61))
    assert losses[1] == pytest.approx(np.log(VOCAB), rel=0.05)
    assert done["final_loss"] < losses[1] - 1.0
    assert done["eval_loss"] < losses[1] - 1.0
    # Async is the default: each save reports how long training stalled and how long the background write took
    # (the first stall also waits for the writer process to start, so neither bounds the other).
    records = [json.loads(line) for line in (coordinator / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in records if r.get("event") == WorkloadEvent.CHECKPOINT]
    assert [s["step"] for s in saves] == [20, 40, 60]
    assert all(s["mode"] == "async" and s["stall_s"] >= 0 and s["write_s"] > 0 and s["bytes"] > 0 for s in saves)
    for node in two_node_run:
        ckpt = node / "ckpt"
        assert complete_steps(ckpt) == [40, 60]  # keep_local=2 pruned step 20
        assert not (ckpt / step_dir_name(20)).exists()
        for step in (40, 60):
            marker = read_marker(ckpt, step)
            assert marker["world_size"] == 2 and marker["step"] == step
            assert marker["files"] == sorted(p.name for p in (ckpt / step_dir_name(step)).iterdir())
            assert (".metadata" in marker["files"]) == (node == coordinator)
    assert not (_node_with_rank(two_node_run, 1, 60) / "metrics.jsonl").exists()


def merge_step(nodes: list[Path], step: int, into: Path) -> Path:
    """What a resume downloads from the store: every node's files of one step in one dir."""
    merged = into / step_dir_name(step)
    merged.mkdir(parents=True)
    for node in nodes:
        for name in read_marker(node / "ckpt", step)["files"]:
            shutil.copy2(node / "ckpt" / step_dir_name(step) / name, merged / name)
    return merged


def test_one_node_resumes_a_two_node_checkpoint_exactly(
    two_node_run: list[Path], markov_dir: Path, tmp_path: Path
) -> None:
    merged = merge_step(two_node_run, 40, tmp_path / "downloaded")
    # One process with twice the batch draws the same global batch per step, so the losses must match.
    (stdout,) = run_nodes([trainer_args(markov_dir, tmp_path, 60, 16, "--resume-from", str(merged))])
    assert f"resumed from {merged} at step 41" in stdout
    resumed, done = read_metrics(tmp_path / "metrics.jsonl")
    original, original_done = read_metrics(_node_with_rank(two_node_run, 0, 60) / "metrics.jsonl")
    assert sorted(resumed) == list(range(41, 61))
    assert resumed[41] == pytest.approx(original[41], rel=1e-4)
    assert done["final_loss"] == pytest.approx(original_done["final_loss"], rel=1e-2)
    assert complete_steps(tmp_path / "ckpt") == [60]
    assert ".metadata" in read_marker(tmp_path / "ckpt", 60)["files"]


def test_inspect_reads_a_merged_checkpoint_without_a_process_group(two_node_run: list[Path], tmp_path: Path) -> None:
    merged = merge_step(two_node_run, 40, tmp_path)
    facts = inspect_checkpoint(merged)
    model_tensors = dict(GPT(TINY_CONFIG).named_parameters())
    assert facts["step"] == 40
    assert facts["num_params"] == sum(p.numel() for p in model_tensors.values())
    # AdamW adds exp_avg, exp_avg_sq and step per parameter.
    assert facts["num_tensors"] == 4 * len(model_tensors)
    assert facts["bytes"] == sum(p.stat().st_size for p in merged.iterdir())


def test_inspect_names_the_missing_or_corrupt_file(two_node_run: list[Path], tmp_path: Path) -> None:
    merged = merge_step(two_node_run, 40, tmp_path)
    other_node_file = read_marker(_node_with_rank(two_node_run, 1, 40) / "ckpt", 40)["files"][0]
    saved = (merged / other_node_file).read_bytes()
    (merged / other_node_file).write_bytes(saved[: len(saved) // 2])
    with pytest.raises(CheckpointError, match=rf"{other_node_file}: truncated"):
        inspect_checkpoint(merged)
    (merged / other_node_file).unlink()
    with pytest.raises(CheckpointError, match=rf"{other_node_file}: missing"):
        inspect_checkpoint(merged)
    (merged / other_node_file).write_bytes(b"\xff" * len(saved))
    with pytest.raises(CheckpointError, match=rf"{other_node_file}: corrupt"):
        inspect_checkpoint(merged)
    (merged / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata: missing"):
        inspect_checkpoint(merged)


def test_a_failing_trainer_exits_non_zero_with_one_line_naming_the_file(markov_dir: Path, tmp_path: Path) -> None:
    args = trainer_args(markov_dir, tmp_path, 5, 4, "--vocab-size", str(VOCAB // 2))
    ((returncode, _, stderr),) = launch([args])
    assert returncode != 0
    manifest = markov_dir / "manifest.json"
    assert f"trainer error (rank 0): {manifest}: dataset vocab_size {VOCAB} != model vocab_size" in stderr
    assert not (tmp_path / "done.json").exists()
