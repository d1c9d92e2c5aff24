"""The dataset's part of a plan, and each input's: the run's snapshot of the prefix (taken now, or the one the run
already has), the prefix held to its own manifests, what each node will hold, and the expectation suite's verdict
on the tabular files, all before anything is launched. The dataset and every input are planned the same way
(plan_prefix); an input is always replicated."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from infra.dataset.assign import node_bytes
from infra.dataset.expectations import DatasetExpectation, load_expectations
from infra.dataset.formats import detect_formats
from infra.dataset.gate import DatasetValidation, validate_files
from infra.dataset.held import check_held
from infra.dataset.manifest import DatasetError
from infra.dataset.snapshot import (
    DATASET,
    SNAPSHOT_KEY,
    DatasetSnapshot,
    check_unchanged,
    input_snapshot_key,
    load_snapshot,
    matches_config,
    save_snapshot,
    snapshot_digest,
    snapshot_url,
    take_snapshot,
)
from infra.dataset.spec import DatasetSpec, InputSpec, PrefixSpec
from infra.storage import open_store


class CarriesValidation(Exception):
    """An error that holds every expectation's result beside its one-line message (for the report)."""

    def __init__(self, message: str, validation: DatasetValidation) -> None:
        super().__init__(message)
        self.validation = validation

    def __reduce__(self) -> tuple[type, tuple[str, DatasetValidation]]:  # Prefect pickles a task's exception
        return type(self), (str(self), self.validation)


class ExpectationsFailed(CarriesValidation, DatasetError):
    """The suite found bad data; the message is the first failure."""


@dataclass(frozen=True)
class DatasetPlan:
    url: str
    snapshot_url: str
    snapshot: DatasetSnapshot
    frozen: bool  # the run already had this snapshot (a recovery or a rerun of the run id)
    shard: str
    node_bytes: tuple[int, ...]  # what each node will hold once staged, by rank
    formats: dict[str, int]  # detected format -> files
    validation: DatasetValidation | None
    label: str = DATASET  # the config section: dataset, or inputs.<name>
    key: str = SNAPSHOT_KEY  # the snapshot's key under the run's checkpoint root
    held: int = 0  # files held to a manifest the prefix carries (token manifest.json, safetensors index, ...)

    @property
    def files(self) -> int:
        return len(self.snapshot.files)

    @property
    def bytes(self) -> int:
        return self.snapshot.bytes

    def render_lines(self) -> list[str]:
        kinds = ", ".join(f"{fmt} {count}" for fmt, count in sorted(self.formats.items(), key=lambda kv: -kv[1]))
        held = (f"every node holds {self.node_bytes[0] / 1e6:,.1f} MB" if self.shard == "replicate" else
                f"split: nodes hold {min(self.node_bytes) / 1e6:,.1f}–{max(self.node_bytes) / 1e6:,.1f} MB")
        lines = [f"  {self.label}: {self.url} — {self.files:,} files, {self.bytes / 1e6:,.1f} MB ({kinds}); {held}",
                 f"    snapshot: {self.snapshot_url} ({'the run already has it' if self.frozen else 'taken now'})"]
        if self.held:
            lines.append(f"    {self.held:,} files match the manifests the {self.label} carries")
        if self.validation is not None:
            lines.append(f"    {self.validation.render()}")
        return lines

    def summary(self) -> dict[str, Any]:
        """What the run summary records about the dataset (the report's dataset section)."""
        return {"url": self.url, "snapshot": self.snapshot_url, "snapshot_digest": snapshot_digest(self.snapshot),
                "files": self.files, "bytes": self.bytes,
                "formats": self.formats, "shard": self.shard, "node_bytes": list(self.node_bytes),
                "held_to_manifest": self.held,
                "validation": self.validation.to_dict() if self.validation is not None else None}


# Validations already run in this process, by what decides their outcome: the CLI plans before the flow plans
# again, and the data is read once.
_validated: dict[str, DatasetValidation] = {}
_validated_lock = threading.Lock()


def _validation_key(snapshot: DatasetSnapshot, expectations: list[DatasetExpectation], spec: PrefixSpec) -> str:
    payload = json.dumps([[(f.key, f.checksum) for f in snapshot.files],
                          [(e.expectation.configuration.to_json_dict(), e.files) for e in expectations],
                          spec.validation, spec.sample_rows], sort_keys=True, default=str)
    return f"{snapshot.url}:{hashlib.sha256(payload.encode()).hexdigest()}"


def _validate(snapshot: DatasetSnapshot, expectations: list[DatasetExpectation], spec: PrefixSpec,
              formats: dict[str, str]) -> DatasetValidation:
    key = _validation_key(snapshot, expectations, spec)
    with _validated_lock:
        known = _validated.get(key)
    if known is None:
        known = validate_files(open_store(snapshot.url), [(f.key, f.size) for f in snapshot.files], formats,
                               expectations, spec.validation, spec.sample_rows)
        with _validated_lock:
            _validated[key] = known
    return known


def plan_dataset(spec: DatasetSpec, nodes: int, checkpoint_url: str, run_id: str) -> DatasetPlan:
    """The dataset's plan (plan_prefix)."""
    return plan_prefix(spec, spec.shard, nodes, checkpoint_url, run_id)


def plan_input(name: str, spec: InputSpec, nodes: int, checkpoint_url: str, run_id: str,
               ref: str | None = None) -> DatasetPlan:
    """An input's plan (plan_prefix): replicated, its snapshot kept apart from the dataset's; ref: the model alias
    spec.url was resolved from, kept in the snapshot."""
    return plan_prefix(spec, "replicate", nodes, checkpoint_url, run_id, label=f"inputs.{name}",
                       key=input_snapshot_key(name), ref=ref)


def plan_prefix(spec: PrefixSpec, shard: str, nodes: int, checkpoint_url: str, run_id: str, *,
                label: str = DATASET, key: str = SNAPSHOT_KEY, ref: str | None = None) -> DatasetPlan:
    """Snapshot (or re-check the run's snapshot), hold it to its own manifests, assign files to nodes and run the
    suite; DatasetError says why not.

    A failed expectation raises ExpectationsFailed, which carries every expectation's result."""
    expectations = load_expectations(spec.expectations)  # a bad suite fails before any data is read
    store = open_store(spec.url)
    frozen = load_snapshot(open_store(checkpoint_url), key)
    if frozen is not None:
        differs = matches_config(frozen, spec.url, spec.include, spec.exclude, label)
        if differs:
            raise DatasetError(f"{differs}: run {run_id} uses its snapshot only: restore the {label} settings, "
                               "or start a new run (a new run id)")
        check_unchanged(frozen, store, f"run {run_id}", what=label)
    snapshot = frozen or take_snapshot(store, spec.include, spec.exclude, label).model_copy(update={"ref": ref})
    held_files = check_held(store, snapshot, label)
    keys = [f.key for f in snapshot.files]
    formats = detect_formats(store, keys)
    held = tuple(node_bytes(snapshot.files, shard, nodes))
    validation = _validate(snapshot, expectations, spec, formats) if expectations else None
    plan = DatasetPlan(url=spec.url, snapshot_url=snapshot_url(checkpoint_url, key), snapshot=snapshot,
                       frozen=frozen is not None, shard=shard, node_bytes=held,
                       formats=dict(Counter(formats.values())), validation=validation, label=label, key=key,
                       held=held_files)
    if validation is not None and not validation.ok:
        raise ExpectationsFailed(validation.failure_message(), validation)
    return plan


def freeze(plan: DatasetPlan, checkpoint_url: str) -> None:
    """Store the snapshot beside the run's checkpoints, unless the run already has it."""
    if not plan.frozen:
        save_snapshot(open_store(checkpoint_url), plan.snapshot, plan.key)
