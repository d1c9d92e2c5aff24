"""Small real jobs for end-to-end tests: a synthetic dataset on disk and a config that trains on it quickly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from infra.dataset.synth import synthesize
from infra.spec import JobSpec, parse_job
from infra.storage import open_store


def make_dataset(root: Path, tokens: int = 400_000, shard_tokens: int = 100_000, vocab_size: int = 256) -> str:
    url = f"file://{root}"
    synthesize(open_store(url), tokens, vocab_size=vocab_size, shard_tokens=shard_tokens, seed=3)
    return url


def token_suite(vocab_size: int) -> list[dict[str, Any]]:
    """The bundled example's checks of its token shards: every token id inside the model's vocab."""
    return [{"type": "expect_column_values_to_be_between", "column": "token", "min_value": 0,
             "max_value": vocab_size - 1}]


def job_config(tmp: Path, dataset_url: str, **training: Any) -> dict[str, Any]:
    return {
        "name": "e2e",
        # The verify-stage bench has its own tests (test_cluster_bench); here it would only add seconds per run.
        "cluster": {"provider": "local", "nodes": 2, "procs_per_node": 1, "verify": {"bench": "off"}},
        "dataset": {"url": dataset_url, "expectations": token_suite(256)},
        "checkpoints": {"url": f"file://{tmp}/store/ckpt", "every_steps": 40, "keep": 2, "keep_local": 2},
        "training": {"steps": 120, "batch_size": 16, "lr": 1e-2, "warmup_steps": 10, "seed": 1,
                     "model": {"vocab_size": 256, "d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32},
                     **training},
    }


def make_job(tmp: Path, dataset_url: str, **training: Any) -> JobSpec:
    return parse_job(job_config(tmp, dataset_url, **training))


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path
