"""The dataset's part of a run's report, from what the run summary records (DatasetPlan.summary())."""

from __future__ import annotations

from typing import Any

from infra.dataset.gate import DatasetValidation


def expectation_rows(dataset: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per expectation of the suite: success, rows checked, unexpected count, a few unexpected values and
    the files they came from; none when the job has no suite."""
    validation = dataset.get("validation")
    return DatasetValidation.from_dict(validation).rows_table() if validation else []


def dataset_fact(dataset: dict[str, Any]) -> str | None:
    """The report's one line about the dataset: what was snapshotted and what the suite said."""
    if "files" not in dataset:
        return None
    formats = ", ".join(f"{fmt} {count}" for fmt, count in sorted(dataset["formats"].items(), key=lambda kv: -kv[1]))
    held = max(dataset["node_bytes"]) / 1e6
    line = (f"dataset {dataset['url']}: {dataset['files']:,} files, {dataset['bytes'] / 1e6:,.1f} MB ({formats}), "
            f"{dataset['shard']} (≤ {held:,.1f} MB per node); snapshot {dataset['snapshot']}")
    validation = dataset.get("validation")
    if validation:
        line += f"; {DatasetValidation.from_dict(validation).render()}"
    return line
