"""What a job reads: its dataset and its other inputs, each a prefix of objects frozen at plan as the run's snapshot.

The `dataset:` section and each entry of `inputs:` of the job spec (infra.job.spec composes them); planning
(infra.dataset.planning) takes their snapshots and checks them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from infra.storage import store_url
from infra.strict_model import StrictModel, readable_file


class PrefixSpec(StrictModel):
    """A prefix of objects in any format, frozen at plan as the run's snapshot: the dataset, and each input."""

    url: str = Field(description="Any prefix of objects in any format (file://, s3://, gs://, az:// or a path). At "
                     "plan its listing is frozen as the run's snapshot; every node stages exactly those objects.")
    include: tuple[str, ...] = Field((), description="Globs (relative to url; * also matches '/') selecting the files "
                                     "to use; empty = every object under url.")
    exclude: tuple[str, ...] = Field((), description="Globs of files to leave out, applied after include.")
    expectations: str | list[dict[str, Any]] | None = Field(
        None, description="Great Expectations checks of the tabular files (Parquet, CSV, JSONL, trainpipe tokens), "
        "run before anything is launched: the path of an ExpectationSuite JSON file, or a list of expectations "
        "({type: expect_..., column: ..., ...; optional files: glob}).")
    validation: str = Field("full", description="full: expectations read every row; sample: sample_rows rows per file, "
                            "read with ranged GETs.")
    sample_rows: int = Field(1000, ge=1, description="Rows per file that validation: sample reads.")

    @field_validator("url")
    @classmethod
    def _normalise_url(cls, value: str) -> str:
        return store_url(value)

    @field_validator("validation")
    @classmethod
    def _known_validation(cls, value: str) -> str:
        if value not in ("full", "sample"):
            raise ValueError(f"unknown validation '{value}': use 'full' or 'sample'")
        return value

    @field_validator("include", "exclude")
    @classmethod
    def _non_empty_globs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not glob.strip() for glob in value):
            raise ValueError("an empty glob selects nothing: remove it")
        return value

    @field_validator("expectations")
    @classmethod
    def _suite_file_readable(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(value, str):
            return readable_file(value, "expectation suite", "give the path of an ExpectationSuite JSON file, or "
                                  "list the expectations inline")
        return value


class DatasetSpec(PrefixSpec):
    url: str = Field(description="The dataset: any prefix of objects in any format (file://, s3://, gs://, az:// or a "
                     "path). At plan its listing is frozen as the run's snapshot; every node stages exactly those "
                     "objects.")
    shard: Literal["replicate", "split"] = Field(
        "replicate", description="replicate: every node stages every file; split: each node stages a disjoint set of "
        "files, balanced by bytes (listed in TRAINPIPE_DATA_SHARDS), as WebDataset and MDS readers expect per rank.")
    access: Literal["staged", "remote"] = Field(
        "staged", description="staged: every node copies the dataset to its local disk before training (fast); "
        "remote: the trainer reads each batch from the store with ranged GETs, as a mounted object store does "
        "(for comparisons: every step then waits on the store).")
    fanout: Literal["auto", "on", "off"] = Field(
        "auto", description="Fan-out staging of what every node needs whole (a replicated dataset, the inputs): the "
        "store is read once per cluster, each node fetches a share and the nodes fill each other over the cluster "
        "network (each node serves its share with rclone serve http, per-run credentials), every byte checked "
        "against the snapshot; a peer slow or gone is replaced by the store for what it owed. on: whenever there "
        "are 2+ nodes; auto: when there are 2+ nodes and the cluster bench's slowest node-to-node link is at least "
        "1 Gbit/s (faster than one node's store reads usually are); with cluster.verify.bench off, auto is off; off: "
        "every node reads everything from the store.")


class InputSpec(PrefixSpec):
    """One more prefix besides the dataset (base model weights, a tokenizer, an eval set), staged whole to every node:
    TRAINPIPE_INPUT_<NAME> and {input_<name>} name its folder there."""

    url: str = Field(description="The input: any prefix of objects in any format (file://, s3://, gs://, az:// or a "
                     "path), frozen at plan as the run's snapshot of it and staged whole to every node's local disk, "
                     "through the same cache as the dataset.")
