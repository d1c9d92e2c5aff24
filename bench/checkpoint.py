"""`trainpipe bench ckpt`: what checkpointing costs training, synchronous against async save + background sync.

Trains the bundled model on one local node twice, identically except for --ckpt-mode, each time with the
node's syncer beside it uploading into a file:// store, and reports per mode: the training stall per checkpoint
(the time the loop was blocked), the background write time, the upload throughput, and the end-to-end time
until the last checkpoint is committed. The upload throughput is set against a ceiling measured in the same
run: a plain copy of the same checkpoint files onto the same filesystem as the store.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.trainer_flags import VOCAB_SIZE, ModelShape
from infra.checkpoints.store import CheckpointStore
from infra.dataset.synth import synthesize
from infra.node.events import NodeEvent, WorkloadEvent, parse
from infra.node.protocol import SyncRequest
from infra.storage import open_store
from trainer.checkpoint import complete_steps, read_marker, step_dir_name
from trainer.model import GPT, GPTConfig

MIN_CHECKPOINT_BYTES = 200_000_000  # smaller checkpoints write in milliseconds and the figures mean nothing
TARGET_STALL_RATIO = 0.10
MODES = ("sync", "async")
MODEL = ModelShape(d_model=512, n_layers=6, n_heads=8)  # model + AdamW state: about 230 MB


class BenchError(RuntimeError):
    """The benchmark could not run; the message names the process or file and the fix."""


@dataclass(frozen=True)
class BenchConfig:
    model: ModelShape = MODEL
    batch_size: int = 2
    steps: int = 24
    ckpt_every: int = 6
    threads: int = 1
    timeout_s: float = 900.0



@dataclass
class ModeResult:
    mode: str
    checkpoints: int
    checkpoint_bytes: int
    stall_s_per_checkpoint: float
    stall_s_each: list[float]  # in save order: the first one also allocates the staging buffer
    write_s_per_checkpoint: float
    upload_mb_per_s: float  # the syncer's rate, averaged over the steps it uploaded
    train_s: float  # launch until the trainer exited
    end_to_end_s: float  # launch until the last checkpoint is committed and the syncer has exited
    committed_step: int


@dataclass
class BenchResult:
    config: BenchConfig
    modes: dict[str, ModeResult] = field(default_factory=dict)
    copy_ceiling_mb_per_s: float = 0.0

    @property
    def stall_ratio(self) -> float:
        return self.modes["async"].stall_s_per_checkpoint / self.modes["sync"].stall_s_per_checkpoint

    @property
    def median_stall_ratio(self) -> float:
        # Past the first saves, which also start the writer process and allocate the staging buffer.
        return statistics.median(self.modes["async"].stall_s_each) / statistics.median(self.modes["sync"].stall_s_each)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "stall_ratio": self.stall_ratio, "median_stall_ratio": self.median_stall_ratio}

    def render(self) -> str:
        sync, done = self.modes["sync"], self.modes["async"]
        lines = [f"checkpoint: {sync.checkpoint_bytes / 1e6:.0f} MB (d_model {self.config.model.d_model}, "
                 f"{self.config.model.n_layers} layers, model + AdamW state), every {self.config.ckpt_every} of "
                 f"{self.config.steps} steps"]
        for result in (sync, done):
            lines.append(f"  {result.mode:>5}: stall {result.stall_s_per_checkpoint:.3f} s/checkpoint, local write "
                         f"{result.write_s_per_checkpoint:.2f} s, upload {result.upload_mb_per_s:.0f} MB/s, "
                         f"train {result.train_s:.1f} s, end to end {result.end_to_end_s:.1f} s "
                         f"({result.checkpoints} checkpoints, committed step {result.committed_step}); stall each: "
                         + ", ".join(f"{s:.3f}" for s in result.stall_s_each))
        verdict = "meets" if self.stall_ratio <= TARGET_STALL_RATIO else "MISSES"
        lines.append(f"  async stall = {self.stall_ratio:.1%} of sync on average "
                     f"({verdict} the {TARGET_STALL_RATIO:.0%} "
                     f"target), {self.median_stall_ratio:.1%} by median")
        lines.append(f"  upload {done.upload_mb_per_s:.0f} MB/s against a plain-copy ceiling of "
                     f"{self.copy_ceiling_mb_per_s:.0f} MB/s ({done.upload_mb_per_s / self.copy_ceiling_mb_per_s:.0%})")
        lines.append(f"  end to end: async {done.end_to_end_s:.1f} s vs sync {sync.end_to_end_s:.1f} s "
                     f"({sync.end_to_end_s - done.end_to_end_s:+.1f} s saved)")
        return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _python() -> str:
    return sys.executable


def _repo_env(threads: int) -> dict[str, str]:
    # The children import trainer/ and infra/ from the checkout this module was loaded from.
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONUNBUFFERED": "1"}


def _run_mode(mode: str, config: BenchConfig, data_dir: Path, work: Path) -> ModeResult:
    node = work / mode
    ckpt_dir, store_url, stop_file = node / "ckpt", f"file://{work / 'store' / mode}", node / "stop-sync"
    ckpt_dir.mkdir(parents=True)
    env = {**_repo_env(config.threads), "TRAINPIPE_SYNC_DIR": str(node / "sync")}
    trainer = [
        _python(), "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1", "--node-rank", "0",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--max-restarts", "0",
        "-m", "trainer.train", "--data-dir", str(data_dir), "--ckpt-dir", str(ckpt_dir),
        "--metrics-file", str(node / "metrics.jsonl"), "--steps", str(config.steps),
        "--ckpt-every", str(config.ckpt_every), "--ckpt-mode", mode, "--keep-local", "2",
        "--batch-size", str(config.batch_size), "--threads", str(config.threads), "--log-every", str(config.steps),
        "--eval-batches", "1", *config.model.flags(),
    ]
    syncer = SyncRequest(ckpt_dir=str(ckpt_dir), sync_dir=str(node / "sync"), url=store_url, node_rank=0, nodes=1,
                         attempt=f"bench-{mode}", config_hash=f"bench-{mode}", keep=2, format="marker",
                         stop_file=str(stop_file), poll_s=0.2)
    started = time.monotonic()
    with open(node / "sync.out", "w") as sync_out, open(node / "sync.err", "w") as sync_err:
        sync_proc = subprocess.Popen(syncer.command_line(_python()), env=syncer.environment(env), stdout=sync_out,
                                     stderr=sync_err)
        try:
            train = subprocess.run(trainer, env=env, capture_output=True, text=True, timeout=config.timeout_s)
            train_s = time.monotonic() - started
            if train.returncode != 0:
                raise BenchError(f"{mode} trainer exited {train.returncode}: {_last_line(train.stderr)}")
            stop_file.touch()
            code = sync_proc.wait(config.timeout_s)
        finally:
            if sync_proc.poll() is None:
                sync_proc.kill()
                sync_proc.wait()
    end_to_end_s = time.monotonic() - started
    if code != 0:
        raise BenchError(f"{mode} syncer exited {code}: {_last_line((node / 'sync.err').read_text())}")
    saves = [json.loads(line) for line in (node / "metrics.jsonl").read_text().splitlines()]
    saves = [s for s in saves if s.get("event") == WorkloadEvent.CHECKPOINT]
    uploads = [e for e in map(parse, (node / "sync.out").read_text().splitlines())
               if e and e.kind is NodeEvent.UPLOADED]
    latest = CheckpointStore(open_store(store_url)).latest()
    if not saves or not uploads or latest is None:
        raise BenchError(f"{mode}: no checkpoint was saved, uploaded and committed: see {node}")
    return ModeResult(
        mode=mode,
        checkpoints=len(saves),
        checkpoint_bytes=max(s["bytes"] for s in saves),
        stall_s_per_checkpoint=sum(s["stall_s"] for s in saves) / len(saves),
        stall_s_each=[s["stall_s"] for s in saves],
        write_s_per_checkpoint=sum(s["write_s"] for s in saves) / len(saves),
        upload_mb_per_s=sum(u["bytes"] for u in uploads) / 1e6 / sum(u["seconds"] for u in uploads),
        train_s=train_s,
        end_to_end_s=end_to_end_s,
        committed_step=latest.step,
    )


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def copy_ceiling(step_dir: Path, files: list[str], dest: Path) -> float:
    """MB/s of a plain copy of these files (with fsync, as the store writes do) onto dest's filesystem."""
    dest.mkdir(parents=True)
    started = time.perf_counter()
    total = 0
    for name in files:
        shutil.copyfile(step_dir / name, dest / name)
        with open(dest / name, "rb+") as handle:
            os.fsync(handle.fileno())
        total += (dest / name).stat().st_size
    return total / 1e6 / (time.perf_counter() - started)


def checkpoint_bytes_estimate(config: BenchConfig) -> int:
    """Model parameters plus AdamW's two moments, fp32: what one checkpoint holds."""
    model = GPT(GPTConfig(VOCAB_SIZE, **asdict(config.model)))
    return 3 * 4 * sum(p.numel() for p in model.parameters())


def run_benchmark(
    config: BenchConfig, workdir: Path | None = None, min_bytes: int = MIN_CHECKPOINT_BYTES
) -> BenchResult:
    estimate = checkpoint_bytes_estimate(config)
    if estimate < min_bytes:
        raise BenchError(f"a checkpoint of d_model {config.model.d_model} x {config.model.n_layers} layers is "
                         f"~{estimate / 1e6:.0f} MB, under {min_bytes / 1e6:.0f} MB: raise --d-model or --n-layers")
    with tempfile.TemporaryDirectory(prefix="trainpipe-bench-ckpt-", dir=workdir) as scratch:
        work = Path(scratch)
        data_dir = work / "dataset"
        synthesize(open_store(f"file://{data_dir}"), 200_000, vocab_size=VOCAB_SIZE, shard_tokens=100_000, seed=0)
        result = BenchResult(config)
        for mode in MODES:  # one at a time: they would compete for the same cores and disk
            result.modes[mode] = _run_mode(mode, config, data_dir, work)
        ckpt_dir = work / "async" / "ckpt"
        step = complete_steps(ckpt_dir)[-1]
        files = read_marker(ckpt_dir, step)["files"]
        result.copy_ceiling_mb_per_s = copy_ceiling(ckpt_dir / step_dir_name(step), files, work / "store" / "copy")
        return result
