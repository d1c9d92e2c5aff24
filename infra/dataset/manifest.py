"""The dataset manifest: what a token dataset holds, read and written as <root>/manifest.json.

A dataset is raw little-endian uint16 token arrays named shard-00000.bin, shard-00001.bin, … plus this
manifest, which is written last: a dataset without a manifest is incomplete and never read.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import Field, ValidationError

from infra.dataset.errors import DatasetError
from infra.storage.base import ObjectInfo, ObjectNotFound, ObjectStore
from infra.strict_model import SHA256_HEX, StrictModel

MANIFEST_KEY = "manifest.json"
DATASET_FORMAT = "trainpipe-tokens-v1"
TOKEN_DTYPE = "uint16"
TOKEN_BYTES = 2
SHARD_NAME_RE = re.compile(r"^shard-\d{5}\.bin$")


class ShardInfo(StrictModel):
    name: str
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=SHA256_HEX)
    tokens: int = Field(ge=0)


class DatasetManifest(StrictModel):
    format: Literal["trainpipe-tokens-v1"] = DATASET_FORMAT
    dtype: Literal["uint16"] = TOKEN_DTYPE
    vocab_size: int = Field(ge=2, le=65536)
    seed: int
    generator: dict[str, Any]
    loss_floor: float = Field(description="Entropy rate of the source in nats per token: the best achievable loss.")
    total_tokens: int = Field(ge=0)
    # Cross-field consistency (sizes, totals, hashes against the store) is the validator's job, so a damaged
    # dataset still loads and can be reported on shard by shard.
    shards: list[ShardInfo] = Field(min_length=1)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def manifest_url(store: ObjectStore) -> str:
    return store.url_for(MANIFEST_KEY)


def load_manifest(store: ObjectStore) -> DatasetManifest:
    url = manifest_url(store)
    try:
        raw = store.get_bytes(MANIFEST_KEY)
    except ObjectNotFound:
        raise DatasetError(
            f"{url}: no dataset manifest: create one with `trainpipe dataset synth {store.url} --tokens N`"
        ) from None
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        reason = f"{exc.msg} at line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise DatasetError(f"{url}: not valid JSON ({reason}): re-create the dataset") from None
    try:
        return DatasetManifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "manifest"
        more = len(exc.errors()) - 1
        suffix = f" (and {more} more problem{'s' * (more > 1)})" if more else ""
        raise DatasetError(
            f"{url}: field '{field}': {first['msg']}{suffix}: fix the manifest or re-create the dataset"
        ) from None


def write_manifest(store: ObjectStore, manifest: DatasetManifest) -> ObjectInfo:
    return store.put_bytes(MANIFEST_KEY, manifest.model_dump_json(indent=2).encode())
