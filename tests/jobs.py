"""Small real jobs for end-to-end tests: a synthetic dataset on disk and a config that trains on it quickly.

The job runs the bundled GPT (`-m trainer.train`) through the same contract as any user's script: its options are
ordinary command arguments, its data and checkpoint dirs come from the TRAINPIPE_* environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from infra.dataset.synth import synthesize
from infra.job.spec import JobSpec, parse_job
from infra.storage import open_store

# The bundled trainer's options for a quick job; tests override what they need (steps=400, ckpt_every=20, ...).
GPT_DEFAULTS: dict[str, Any] = {
    "steps": 120, "batch_size": 16, "lr": 1e-2, "warmup_steps": 10, "seed": 1, "ckpt_every": 40, "keep_local": 2,
    "vocab_size": 256, "d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32,
}
TRAINING_FIELDS = ("timeout_s", "threads_per_proc", "env", "setup", "code")


# A probe script's ending: rank 0 writes a tiny checkpoint, marks it complete and logs `steps` losses, so the run
# commits something and completes. Python source, appended to a probe's own lines.
COMMIT_TINY_CHECKPOINT = """
def commit_tiny_checkpoint(losses):
    import json, os
    if os.environ["RANK"] != "0":
        return
    from trainpipe_sdk import mark_complete
    result = os.path.join(os.environ["TRAINPIPE_CHECKPOINT_DIR"], "result.bin")
    with open(result, "wb") as handle:
        handle.write(b"weights")
    mark_complete(result)
    with open(os.environ["TRAINPIPE_METRICS_FILE"], "a") as metrics:
        for step, loss in enumerate(losses, start=1):
            metrics.write(json.dumps({"step": step, "loss": loss, "total_steps": len(losses)}) + "\\n")
"""


def probe_project(tmp: Path, source: str) -> tuple[Path, Path]:
    """A code dir holding probe.py (source) and an empty dir the probe writes what it was told to."""
    code, probes = tmp / "project", tmp / "probes"
    code.mkdir()
    (code / "probe.py").write_text(source)
    probes.mkdir()
    return code, probes


def make_dataset(root: Path, tokens: int = 400_000, shard_tokens: int = 100_000, vocab_size: int = 256) -> str:
    url = f"file://{root}"
    synthesize(open_store(url), tokens, vocab_size=vocab_size, shard_tokens=shard_tokens, seed=3)
    return url


def token_suite(vocab_size: int) -> list[dict[str, Any]]:
    """The bundled example's checks of its token shards: every token id inside the model's vocab."""
    return [{"type": "expect_column_values_to_be_between", "column": "token", "min_value": 0,
             "max_value": vocab_size - 1}]


def gpt_command(**options: Any) -> list[str]:
    """`-m trainer.train` with its options as arguments; it resumes from TRAINPIPE_RESUME_FROM by itself."""
    merged = {**GPT_DEFAULTS, **options}
    return ["-m", "trainer.train", *[part for key, value in merged.items()
                                      for part in (f"--{key.replace('_', '-')}", str(value))]]


def job_config(tmp: Path, dataset_url: str, expectations: bool = False, **options: Any) -> dict[str, Any]:
    """options: the bundled trainer's (steps, ckpt_every, ckpt_mode, ...) and training fields (timeout_s, ...).
    expectations: the token suite checked at plan; off by default, since importing Great Expectations costs seconds
    of CPU in every `trainpipe run` and the tests of the dataset gate ask for it."""
    training = {key: options.pop(key) for key in TRAINING_FIELDS if key in options}
    return {
        "name": "e2e",
        # The verify-stage bench has its own tests (test_cluster_bench); here it would only add seconds per run.
        "cluster": {"provider": "local", "nodes": 2, "procs_per_node": 1, "verify": {"bench": "off"}},
        "dataset": {"url": dataset_url, **({"expectations": token_suite(256)} if expectations else {})},
        "checkpoints": {"url": f"file://{tmp}/store/ckpt", "keep": 2},
        "training": {"command": gpt_command(**options), **training},
    }


def make_job(tmp: Path, dataset_url: str, **options: Any) -> JobSpec:
    return parse_job(job_config(tmp, dataset_url, **options))


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path
