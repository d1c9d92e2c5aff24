"""The job specification: what a retraining job needs, validated before anything is paid for.

Every model here is also the Prefect parameter schema of the retrain flow, so field descriptions
are what a user reads in the UI form.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from infra.models import StrictModel

KNOWN_PROVIDERS = ("local", "aws")
KNOWN_SCHEMES = ("file", "s3", "gs")
SpotPolicy = Literal["never", "prefer", "only"]


class ConfigError(ValueError):
    """A job config that cannot run; the message is one line naming the field and the fix."""


def _to_url(value: str) -> str:
    """Accept a URL or a local path; a path becomes an absolute file:// URL (relative to the cwd)."""
    if "://" in value:
        scheme = value.split("://", 1)[0]
        if scheme not in KNOWN_SCHEMES:
            raise ValueError(f"unknown scheme '{scheme}://': use one of " + ", ".join(f"{s}://" for s in KNOWN_SCHEMES))
        return value.rstrip("/")
    return "file://" + str(Path(value).expanduser().resolve())


class ClusterSpec(StrictModel):
    provider: str = Field("local", description=f"Where nodes run: one of {', '.join(KNOWN_PROVIDERS)}.")
    nodes: int = Field(2, ge=1, le=1024, description="Number of nodes (machines).")
    procs_per_node: int = Field(1, ge=1, le=64, description="Training processes per node (one per GPU).")
    accelerator: str | None = Field(None, description="GPU type each process needs (e.g. H100); none trains on CPU.")
    min_network_gbps: float = Field(0.0, ge=0, description="Floor on the inter-node network bandwidth, in Gbit/s.")
    local_nvme: bool = Field(False, description="Require node-local NVMe for data and checkpoints.")
    instance_type: str | None = Field(None, description="Pin one instance type (e.g. p5.48xlarge); none lets the "
                                      "optimizer pick the cheapest that meets the floors.")
    spot: SpotPolicy = Field("never", description="never: on-demand only; prefer: spot first, on-demand when no spot "
                             "launches; only: spot or nothing. (true/false mean prefer/never.)")
    regions: tuple[str, ...] = Field((), description="Regions to consider, in order of preference; empty = any.")
    zones: tuple[str, ...] = Field((), description="Zones to consider (e.g. us-east-1a); empty = any in the regions.")
    max_price_per_hour: float | None = Field(None, gt=0, description="Price cap for the whole cluster, USD/hour.")
    lease_ttl_s: float = Field(120.0, ge=10, description="Nodes tear themselves down after this long without "
                               "hearing from the orchestrator (bounds how long a cluster outlives a dead run).")

    @field_validator("provider")
    @classmethod
    def _known_provider(cls, value: str) -> str:
        if value not in KNOWN_PROVIDERS:
            raise ValueError(f"unknown provider '{value}': use one of {', '.join(KNOWN_PROVIDERS)}")
        return value

    @field_validator("spot", mode="before")
    @classmethod
    def _spot_from_bool(cls, value: object) -> object:
        # Configs written before the three-way policy said `spot: true/false`.
        return {True: "prefer", False: "never"}.get(value, value) if isinstance(value, bool) else value


class DatasetSpec(StrictModel):
    url: str = Field(description="Dataset root holding manifest.json and the shards: file://, s3://, gs:// or a path.")
    validation: str = Field("full", description="'full' checks every shard before launch; 'manifest' checks sizes.")

    @field_validator("url")
    @classmethod
    def _normalise_url(cls, value: str) -> str:
        return _to_url(value)

    @field_validator("validation")
    @classmethod
    def _known_validation(cls, value: str) -> str:
        if value not in ("full", "manifest"):
            raise ValueError(f"unknown validation '{value}': use 'full' or 'manifest'")
        return value


class CheckpointSpec(StrictModel):
    url: str = Field(description="Where committed checkpoints live; each run writes under <url>/<run-id>/.")
    every_steps: int = Field(50, ge=1, description="Save a checkpoint every this many steps (and at the end).")
    keep: int = Field(3, ge=1, description="Committed checkpoints kept in the store (the newest is never deleted).")
    keep_local: int = Field(2, ge=1, description="Checkpoints kept on each node's local disk.")
    mode: Literal["async", "sync"] = Field(
        "async", description="async: training continues while the checkpoint is written; sync: it waits."
    )
    flush_deadline_s: float = Field(
        # torchrun's agent SIGKILLs its workers 30 s after forwarding SIGTERM to them.
        20.0, gt=0, le=25, description="On SIGTERM (spot notice, cancel): seconds for a last save and its upload."
    )

    @field_validator("url")
    @classmethod
    def _normalise_url(cls, value: str) -> str:
        return _to_url(value)


class ModelSpec(StrictModel):
    vocab_size: int = Field(256, ge=2, le=65536, description="Must equal the dataset's vocab_size.")
    d_model: int = Field(64, ge=8, description="Width of the transformer.")
    n_layers: int = Field(2, ge=1, description="Transformer blocks.")
    n_heads: int = Field(4, ge=1, description="Attention heads; must divide d_model.")
    seq_len: int = Field(64, ge=2, description="Context length in tokens.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSpec:
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
        return self


class TrainingSpec(StrictModel):
    steps: int = Field(300, ge=1, description="Optimizer steps to run in total (a resumed run counts from 0).")
    batch_size: int = Field(16, ge=1, description="Sequences per process per step.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate (AdamW, cosine decay).")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps.")
    seed: int = Field(0, description="Seeds the model init and the data order.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    threads_per_proc: int = Field(1, ge=1, description="CPU threads per training process (torch + OpenMP).")
    timeout_s: float = Field(3600, gt=0, description="Fail training that runs longer than this.")


class JobSpec(StrictModel):
    name: str = Field("retrain", pattern=r"^[a-z0-9][a-z0-9-]{0,39}$", description="Job name: lowercase, digits, '-'.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    dataset: DatasetSpec
    checkpoints: CheckpointSpec
    training: TrainingSpec = Field(default_factory=TrainingSpec)

    def config_hash(self) -> str:
        """Identifies the training setup a checkpoint came from (the cluster shape may differ on resume)."""
        payload = json.dumps(self.training.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(payload).hexdigest()[:16]


def _describe(error: dict[str, Any]) -> str:
    where = ".".join(str(p) for p in error["loc"]) or "config"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":
        return f"{where}: missing: add '{error['loc'][-1]}:' to the config"
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown field: remove it or check its spelling"
    got = error.get("input")
    shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
    return f"{where}: {message}{shown}"


def parse_job(data: dict[str, Any], source: str = "config") -> JobSpec:
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        more = len(exc.errors()) - 1
        suffix = f" (and {more} more problem{'s' * (more > 1)})" if more else ""
        raise ConfigError(f"{source}: {_describe(first)}{suffix}") from None


def load_job(path: str | os.PathLike[str]) -> JobSpec:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file: pass the path of a job YAML (see examples/local.yaml)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc.__class__.__name__}): fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with cluster, dataset, checkpoints, training")
    return parse_job(data, source=str(path))
