"""The trainer's step-time breakdown (trainer.step_timing), remote data access and checkpoint mode direct.

Units first (the interval union, the two window readers agreeing bit for bit), then real torchrun jobs: 2 agents as
2 nodes with static node ranks, so each node's syncer can be started with the rank its trainer will have.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_trainer import REPO_ROOT, TINY_CONFIG, TINY_MODEL, TORCHRUN, VOCAB, _free_port, markov_shards, write_dataset

from infra.analysis.breakdown import StepBreakdown
from infra.checkpoints.store import CheckpointStore
from infra.node.events import WorkloadEvent
from infra.node.protocol import SyncRequest
from infra.node.sync import Shipped, SyncState, read_state, state_path
from infra.storage import open_store
from infra.workload.contract import SYNC_DIR_VAR
from tasks.train import TrainLaunch, syncer_request
from trainer.checkpoint import complete_steps, marker_path
from trainer.data import StoreReader, TokenWindows
from trainer.model import GPT
from trainer.step_timing import covered_s
from trainer.train import parse_args

SEQ_LEN = TINY_CONFIG.seq_len
BATCH = 4
TIME_FIELDS = ("wall_s", "comm_exposed_s", "comm_total_s", "sync_wait_s", "data_wait_s", "ckpt_block_s",
               "ckpt_upload_wait_s", "read_latency_s")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), markov_shards(5, VOCAB, [20_000, 9_000, 12_000]), VOCAB)


def param_bytes() -> int:
    """What DDP's buckets hold every step: every parameter's gradient once, in the parameter's dtype."""
    return sum(p.numel() * p.element_size() for p in GPT(TINY_CONFIG).parameters())


# --- units ----------------------------------------------------------------------------------------------


def test_covered_counts_overlapping_intervals_once() -> None:
    assert covered_s([]) == 0.0
    assert covered_s([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert covered_s([(3.0, 4.0), (0.0, 10.0), (1.0, 2.0)]) == pytest.approx(10.0)


def test_store_reader_gives_the_memmap_readers_batches(dataset: Path) -> None:
    local = TokenWindows(dataset, SEQ_LEN, VOCAB)
    remote = TokenWindows(f"file://{dataset}", SEQ_LEN, VOCAB)
    assert (local.source, remote.source) == ("local", "remote")
    for step in (1, 2, 17):
        for rank in (0, 1, 2):
            expected = local.train_batch(3, step, rank, 3, BATCH)
            assert torch.equal(remote.train_batch(3, step, rank, 3, BATCH), expected)
        # A rank's rows are its slice of the global batch whatever the world size reads.
        whole = local.train_batch(3, step, 0, 1, 3 * BATCH)
        assert torch.equal(whole[BATCH : 2 * BATCH], local.train_batch(3, step, 1, 3, BATCH))
    assert all(torch.equal(a, b) for a, b in zip(local.eval_batches(3, 2, BATCH), remote.eval_batches(3, 2, BATCH),
                                                 strict=True))
    assert remote.train_reads == 3 * 3 * BATCH  # eval reads do not count
    # One GET of exactly one window per row, and only this rank's rows.
    assert isinstance(remote.reader, StoreReader)
    store, gets = remote.reader.store, []
    get_range = store.get_range
    store.get_range = lambda key, start, length: gets.append(length) or get_range(key, start, length)
    remote.train_batch(3, 4, 1, 3, BATCH)
    assert gets == [(SEQ_LEN + 1) * 2] * BATCH
    assert remote.train_read_bytes == remote.train_reads * (SEQ_LEN + 1) * 2
    assert 0 < remote.reader.read_latency_s() < 1.0 and 0 < local.reader.read_latency_s() < 1.0


def test_exactly_one_data_source_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--ckpt-dir", "c", "--metrics-file", "m"]
    assert parse_args(["--data-url", "s3://b/d", *common]).data_dir is None
    for sources in ([], ["--data-dir", "d", "--data-url", "s3://b/d"]):
        with pytest.raises(SystemExit):
            parse_args([*sources, *common])
        assert "--data-dir" in capsys.readouterr().err


def test_a_negative_step_delay_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--data-dir", "d", "--ckpt-dir", "c", "--metrics-file", "m"]
    assert parse_args([*common, "--step-delay-s", "0.05"]).step_delay_s == 0.05
    with pytest.raises(SystemExit):
        parse_args([*common, "--step-delay-s", "-1"])
    assert "--step-delay-s must be >= 0 (got -1.0)" in capsys.readouterr().err


# --- real torchrun jobs ---------------------------------------------------------------------------------


def node_args(node_dir: Path, source: list[str], steps: int, ckpt_every: int, *extra: str) -> list[str]:
    return [
        *source,
        *("--ckpt-dir", str(node_dir / "ckpt"), "--metrics-file", str(node_dir / "metrics.jsonl")),
        *("--steps", str(steps), "--ckpt-every", str(ckpt_every), "--keep-local", "2", "--batch-size", str(BATCH)),
        *("--lr", "3e-3", "--warmup-steps", "5", "--seed", "3", "--log-every", "5", "--eval-batches", "2"),
        *TINY_MODEL,
        *extra,
    ]


def run_static(node_argvs: list[list[str]], timeout_s: float = 180,
               sync_dirs: list[Path] | None = None) -> list[tuple[int, str, str]]:
    """One torchrun agent per entry, entry i as node rank i; each node's (exit code, stdout, stderr). sync_dirs:
    each node's syncer dir, told to the trainer as trainpipe tells it (TRAINPIPE_SYNC_DIR)."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    nodes = [
        subprocess.Popen(
            [str(TORCHRUN), f"--nnodes={len(node_argvs)}", "--nproc-per-node=1", f"--node-rank={rank}",
             "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0", "-m", "trainer.train", *argv],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**env, **({SYNC_DIR_VAR: str(sync_dirs[rank])} if sync_dirs else {})},
        )
        for rank, argv in enumerate(node_argvs)
    ]
    outputs = [node.communicate(timeout=timeout_s) for node in nodes]
    return [(node.returncode, out, err) for node, (out, err) in zip(nodes, outputs, strict=True)]


def run_ok(node_argvs: list[list[str]], sync_dirs: list[Path] | None = None) -> list[str]:
    results = run_static(node_argvs, sync_dirs=sync_dirs)
    for code, out, err in results:
        assert code == 0, f"torchrun exited {code}\n{out[-3000:]}\n{err[-3000:]}"
    return [out for _, out, _ in results]


def read_run(metrics_file: Path) -> tuple[list[dict], StepBreakdown, dict]:
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    (done,) = [r for r in records if "breakdown" in r]
    # Exactly StepBreakdown's fields: from_dict would drop unknown keys silently.
    assert set(done["breakdown"]) == set(StepBreakdown.__dataclass_fields__)
    return records, StepBreakdown.from_dict(done["breakdown"]), done["breakdown"]


def check_consistent(b: StepBreakdown, steps: int) -> None:
    assert b.steps == steps
    assert all(getattr(b, name) >= 0 for name in TIME_FIELDS)
    assert b.comm_total_s > 0 and b.comm_exposed_s <= b.wall_s
    assert b.wall_s >= b.comm_exposed_s + b.sync_wait_s + b.data_wait_s + b.ckpt_block_s
    assert b.ckpt_upload_wait_s <= b.ckpt_block_s
    assert b.allreduce_bytes == steps * param_bytes()
    # The bucket profile the predictor replays: launch order, every gradient in one bucket or another.
    assert b.comm_buckets and sum(size for _, _, size in b.comm_buckets) == param_bytes()
    assert b.comm_buckets[0][0] == 0.0 and all(service >= 0 for _, service, _ in b.comm_buckets)
    assert b.read_bytes == steps * BATCH * (SEQ_LEN + 1) * 2 and b.read_requests == steps * BATCH
    assert (b.world_size, b.nodes) == (2, 2)


def test_two_nodes_report_where_the_step_time_went(dataset: Path, tmp_path: Path) -> None:
    nodes = [tmp_path / f"node{rank}" for rank in range(2)]
    (stdout, _) = run_ok([node_args(node, ["--data-dir", str(dataset)], 24, 10) for node in nodes])
    records, b, _ = read_run(nodes[0] / "metrics.jsonl")
    check_consistent(b, 24)
    assert (b.data_source, b.ckpt_mode, b.ckpt_upload_wait_s) == ("local", "async", 0.0)
    saves = [r for r in records if r.get("event") == WorkloadEvent.CHECKPOINT]
    assert [s["step"] for s in saves] == [10, 20, 24] and b.ckpt_saves == 3
    assert b.ckpt_bytes == sum(s["bytes"] for s in saves) > 0
    # A 1-byte read of the staged copy (median of probes) is a small part of a step, which reads a batch of windows
    # and computes on it: a ratio, so a loaded machine slows both sides alike.
    assert 0 < b.read_latency_s < b.wall_s / b.steps / 2
    # The periodic lines carry the interval's split too, for humans and machines.
    steps = [r for r in records if "event" not in r and "step" in r]
    assert [r["step"] for r in steps] == [1, 5, 10, 15, 20, 24]
    assert all(r["compute_ms"] > 0 and r["comm_total_ms"] > 0 and r["data_ms"] >= 0 for r in steps)
    assert "exposed of" in stdout and "steps, final loss" in stdout


@contextmanager
def syncers(nodes: list[Path], url: str) -> Iterator[list[subprocess.Popen]]:
    """The real `python -m infra.node sync` beside each node, polling as a job that waits for its uploads sets
    checkpoints.sync_poll_s; stopped (flushing) when the block ends."""
    processes = []
    for rank, node in enumerate(nodes):
        (node / "ckpt").mkdir(parents=True)
        request = SyncRequest(ckpt_dir=str(node / "ckpt"), sync_dir=str(node / "sync"), url=url, node_rank=rank,
                              nodes=len(nodes), attempt="a1", config_hash="test", keep=2, format="marker",
                              poll_s=0.05, stop_file=str(node / "stop-sync"))
        with (node / "sync.log").open("w") as log:  # the child keeps its own descriptor
            processes.append(subprocess.Popen(request.command_line(sys.executable), cwd=REPO_ROOT, stdout=log,
                                              stderr=subprocess.STDOUT, env=request.environment(os.environ)))
    try:
        yield processes
    finally:
        for node in nodes:
            (node / "stop-sync").write_text("stop\n")
        for process, node in zip(processes, nodes, strict=True):
            try:
                assert process.wait(60) == 0, (node / "sync.log").read_text()
            finally:
                if process.poll() is None:
                    process.kill()


def test_remote_data_and_direct_checkpoints_with_real_syncers(dataset: Path, tmp_path: Path) -> None:
    nodes = [tmp_path / f"node{rank}" for rank in range(2)]
    store_url = f"file://{tmp_path / 'store' / 'ckpt'}"
    source = ["--data-url", f"file://{dataset}"]
    with syncers(nodes, store_url):
        run_ok([node_args(node, source, 12, 6, "--ckpt-mode", "direct") for node in nodes],
               sync_dirs=[node / "sync" for node in nodes])
    records, b, _ = read_run(nodes[0] / "metrics.jsonl")
    check_consistent(b, 12)
    assert (b.data_source, b.ckpt_mode, b.ckpt_saves) == ("remote", "direct", 2)
    assert b.read_requests > 0 and b.read_latency_s > 0
    # Training went on only once each node's syncer had uploaded the step: both steps are in the store.
    assert 0 < b.ckpt_upload_wait_s < b.ckpt_block_s
    assert [r["mode"] for r in records if r.get("event") == WorkloadEvent.CHECKPOINT] == ["direct", "direct"]
    latest = CheckpointStore(open_store(store_url)).latest()
    assert latest is not None and latest.step == 12
    for rank, node in enumerate(nodes):
        state = read_state(state_path(node / "sync", rank))
        assert state is not None and state.has_step(12)


def fake_syncer(ckpt_dir: Path, sync_dir: Path, delay_s: float, stop: threading.Event) -> threading.Thread:
    """Records each completed step as shipped delay_s after its marker appears, as a slow store would."""

    def run() -> None:
        state = SyncState(url="file:///fake", node_rank=0, attempt="a1")
        while not stop.is_set():
            for step in complete_steps(ckpt_dir):
                marker = marker_path(ckpt_dir, step)
                if not state.has_step(step):
                    time.sleep(delay_s)
                    state.shipped.append(Shipped(step=step, name=marker.stem, version=marker.stat().st_mtime_ns))
                    path = state_path(sync_dir, 0)
                    path.with_name(path.name + ".tmp").write_text(state.model_dump_json())
                    os.replace(path.with_name(path.name + ".tmp"), path)
            time.sleep(0.01)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_direct_mode_waits_for_the_upload(dataset: Path, tmp_path: Path) -> None:
    delay_s, stop = 0.5, threading.Event()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "sync").mkdir()
    syncer = fake_syncer(tmp_path / "ckpt", tmp_path / "sync", delay_s, stop)
    try:
        run_ok([node_args(tmp_path, ["--data-dir", str(dataset)], 6, 3, "--ckpt-mode", "direct")],
               sync_dirs=[tmp_path / "sync"])
    finally:
        stop.set()
        syncer.join(5)
    _, b, _ = read_run(tmp_path / "metrics.jsonl")
    assert b.ckpt_saves == 2 and (b.world_size, b.nodes) == (1, 1)
    assert 2 * delay_s * 0.9 <= b.ckpt_upload_wait_s <= b.ckpt_block_s <= b.wall_s


def test_direct_mode_without_a_syncer_fails_naming_it(dataset: Path, tmp_path: Path) -> None:
    argv = node_args(tmp_path, ["--data-dir", str(dataset)], 3, 3, "--ckpt-mode", "direct",
                     "--collective-timeout-s", "3")
    started = time.monotonic()
    ((code, _, stderr),) = run_static([argv], sync_dirs=[tmp_path / "sync"])
    assert code != 0 and time.monotonic() - started < 60
    state_file = state_path(tmp_path / "sync", 0)
    assert f"trainer error (rank 0): {state_file}: step 3 not uploaded by this node's checkpoint syncer" in stderr
    assert "python -m infra.node sync` runs on this node" in stderr and "sync.log" in stderr


def test_the_syncer_polls_as_often_as_the_job_says() -> None:
    from infra.compute.providers import Cluster, Node
    from infra.job.spec import JobSpec

    node = Node("n0", 0, "127.0.0.1", "/w", "/w/data", "/w/ckpt", "python")
    cluster = Cluster("c", "local", "run", (node,), 0.0)
    job = JobSpec.model_validate({"name": "j", "dataset": {"url": "file:///d"}, "checkpoints": {"url": "file:///c"},
                                  "training": {"command": ["-m", "trainer.train"]}})
    launch = TrainLaunch("file:///c", "file:///d", 29500, "hash", attempt_id="0-x")
    request = syncer_request(job, cluster, node, launch)
    assert request.poll_s == 0.5
    waiting = job.model_copy(update={"checkpoints": job.checkpoints.model_copy(update={"sync_poll_s": 0.05})})
    request = syncer_request(waiting, cluster, node, launch)
    assert request.poll_s == 0.05
    assert request.sync_dir == "/w/sync" and request.attempt == "0-x"
