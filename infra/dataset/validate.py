"""Check a dataset in its object store against its manifest, with Great Expectations, before GPUs are paid for.

One table row per shard (the manifest's, plus stray shard objects the store holds beyond it) and one row for
the manifest itself; each expectation failure becomes one problem line naming the shard and the fix.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from infra.dataset import gx
from infra.dataset.manifest import MANIFEST_KEY, SHARD_NAME_RE, TOKEN_BYTES, DatasetManifest, load_manifest
from infra.storage.base import ObjectInfo, ObjectStore

if TYPE_CHECKING:
    from great_expectations.expectations import Expectation

logger = logging.getLogger(__name__)

# Shards are read in pieces of this size by a few threads at once: bounded memory whatever the shard size,
# and enough requests in flight to keep a network store busy.
_READ_CHUNK_BYTES = 8 << 20
_READ_THREADS = 4
_RESULT_FORMAT = {"result_format": "COMPLETE", "unexpected_index_column_names": ["name"]}
_HASH_SHOWN = 12


@dataclass(frozen=True)
class ValidationReport:
    url: str
    shards: int
    total_tokens: int
    vocab_size: int
    deep: bool
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        checked = "sizes, sha256 and token ids checked" if self.deep else "sizes checked, contents not read"
        verdict = "OK" if self.ok else f"{len(self.problems)} problem{'s' * (len(self.problems) > 1)}"
        head = f"{self.url}: {self.shards} shards, {self.total_tokens:,} tokens, vocab {self.vocab_size}: {verdict}"
        return "\n".join([f"{head} ({checked})", *(f"  {problem}" for problem in self.problems)])


@dataclass(frozen=True)
class _Check:
    expectation: Expectation
    describe: Callable[[dict[str, Any]], list[str]]  # GE's result dict of a failure -> problem lines


def _plain(value: Any) -> Any:
    """GE hands back numpy floats for integer columns that hold nulls; show them as the integers they are."""
    if isinstance(value, float | np.floating):
        if math.isnan(value):
            return None
        if float(value).is_integer():
            return int(value)
    return value


def _per_row(line: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], list[str]]:
    def describe(result: dict[str, Any]) -> list[str]:
        return [line({key: _plain(value) for key, value in row.items()}) for row in result["unexpected_index_list"]]

    return describe


def _columns_agree(column_a: str, column_b: str, line: Callable[[dict[str, Any]], str]) -> _Check:
    """Each row's two columns hold the same value where both hold one (a missing value is another check's finding,
    reported once there rather than twice); line names a row that disagrees."""
    import great_expectations.expectations as gxe

    return _Check(
        gxe.ExpectColumnPairValuesToBeEqual(
            column_A=column_a, column_B=column_b, ignore_row_if="either_value_is_missing"
        ),
        _per_row(line),
    )


def _short(digest: str) -> str:
    return f"{digest[:_HASH_SHOWN]}…"


def _scan_shard(store: ObjectStore, key: str, size: int) -> tuple[str, int | None, int | None]:
    """sha256 and the smallest and largest token id of one shard, read in bounded chunks."""
    digest = hashlib.sha256()
    lowest: int | None = None
    highest: int | None = None
    offset = 0
    while offset < size:
        data = store.get_range(key, offset, min(_READ_CHUNK_BYTES, size - offset))
        if not data:
            break
        digest.update(data)
        # Chunks are even-sized, so only a damaged shard's last chunk can end in half a token.
        tokens = np.frombuffer(data, dtype="<u2", count=len(data) // TOKEN_BYTES)
        if tokens.size:
            lowest = int(tokens.min()) if lowest is None else min(lowest, int(tokens.min()))
            highest = int(tokens.max()) if highest is None else max(highest, int(tokens.max()))
        offset += len(data)
    return digest.hexdigest(), lowest, highest


def _shard_rows(store: ObjectStore, manifest: DatasetManifest, deep: bool) -> pd.DataFrame:
    stored: dict[str, ObjectInfo] = {info.key: info for info in store.list()}
    listed = {shard.name for shard in manifest.shards}
    strays = sorted(key for key in stored if SHARD_NAME_RE.match(key) and key not in listed)
    rows: list[dict[str, Any]] = [
        {
            "name": shard.name,
            "in_manifest": True,
            "tokens": shard.tokens,
            "bytes": shard.bytes,
            "sha256": shard.sha256,
            "tokens_bytes": shard.tokens * TOKEN_BYTES,
            "actual_bytes": stored[shard.name].size if shard.name in stored else None,
        }
        for shard in manifest.shards
    ]
    rows += [{"name": key, "in_manifest": False, "actual_bytes": stored[key].size} for key in strays]
    frame = pd.DataFrame(rows)
    if deep:
        # Strays are reported by name alone: their contents answer to no manifest entry.
        present = [
            (i, row["name"], row["actual_bytes"])
            for i, row in enumerate(rows)
            if row["in_manifest"] and row["actual_bytes"] is not None
        ]
        with ThreadPoolExecutor(max_workers=_READ_THREADS) as pool:
            scans = list(pool.map(lambda item: _scan_shard(store, item[1], item[2]), present))
        by_row = dict(zip([i for i, _, _ in present], scans, strict=True))
        for position, column in enumerate(("actual_sha256", "min_token", "max_token")):
            values = [by_row[i][position] if i in by_row else None for i in range(len(rows))]
            frame[column] = pd.Series(values, dtype="object" if position == 0 else "float64")
    return frame


def _shard_checks(store: ObjectStore, manifest: DatasetManifest, frame: pd.DataFrame, deep: bool) -> list[_Check]:
    checks = [*_entry_checks(), *_store_checks(store, manifest, frame), _token_total_check(manifest)]
    return [*checks, *_content_checks(manifest)] if deep else checks


def _entry_checks() -> list[_Check]:
    """Each manifest entry on its own: one entry per shard name, a shard's name, its size for its tokens."""
    import great_expectations.expectations as gxe

    return [
        _Check(
            gxe.ExpectColumnValuesToBeUnique(column="name"),
            _per_row(lambda r: f"{r['name']}: listed more than once in the manifest: re-create the dataset"),
        ),
        _Check(
            gxe.ExpectColumnValuesToMatchRegex(column="name", regex=SHARD_NAME_RE.pattern),
            _per_row(lambda r: f"{r['name']}: not a shard-NNNNN.bin name in the manifest: re-create the dataset"),
        ),
        _columns_agree(
            "bytes", "tokens_bytes",
            lambda r: (
                f"{r['name']}: manifest says {r['bytes']} bytes but its tokens need {r['tokens_bytes']} "
                "(2 per token): re-create the dataset"
            ),
        ),
    ]


def _store_checks(store: ObjectStore, manifest: DatasetManifest, frame: pd.DataFrame) -> list[_Check]:
    """The manifest against the store's listing: every shard there at its size, and no shard the manifest lacks."""
    import great_expectations.expectations as gxe

    strays = frame.loc[~frame["in_manifest"], "name"].tolist()
    return [
        _Check(
            gxe.ExpectColumnValuesToNotBeNull(column="actual_bytes"),
            _per_row(lambda r: f"{r['name']}: missing from {store.url}: re-create or re-upload the shard"),
        ),
        _columns_agree(
            "bytes", "actual_bytes",
            lambda r: (
                f"{r['name']}: size mismatch (manifest {r['bytes']} bytes, actual {r['actual_bytes']}): "
                "re-create or re-upload the shard"
            ),
        ),
        _Check(
            gxe.ExpectTableRowCountToEqual(value=len(manifest.shards)),
            lambda _: [
                f"{name}: in {store.url} but not in the manifest: delete it or re-create the dataset" for name in strays
            ],
        ),
    ]


def _token_total_check(manifest: DatasetManifest) -> _Check:
    import great_expectations.expectations as gxe

    return _Check(
        gxe.ExpectColumnSumToBeBetween(
            column="tokens", min_value=manifest.total_tokens, max_value=manifest.total_tokens
        ),
        lambda result: [
            f"{MANIFEST_KEY}: total_tokens {manifest.total_tokens} != sum of shard tokens "
            f"{_plain(result['observed_value'])}: re-create the dataset"
        ],
    )


def _content_checks(manifest: DatasetManifest) -> list[_Check]:
    """What only reading the shards shows (deep): each one's sha256, and its token ids within the vocab."""
    import great_expectations.expectations as gxe

    top = manifest.vocab_size - 1
    checks = [
        _columns_agree(
            "sha256", "actual_sha256",
            lambda r: (
                f"{r['name']}: sha256 mismatch (manifest {_short(r['sha256'])}, actual "
                f"{_short(r['actual_sha256'])}): re-create or re-upload the shard"
            ),
        )
    ]
    for column in ("min_token", "max_token"):
        checks.append(
            _Check(
                gxe.ExpectColumnValuesToBeBetween(column=column, min_value=0, max_value=top),
                _per_row(
                    lambda r, column=column: (
                        f"{r['name']}: token id {r[column]} out of vocab [0, {top}] (vocab_size "
                        f"{manifest.vocab_size}): re-create the shard, or the dataset with a larger vocab"
                    )
                ),
            )
        )
    return checks


def _manifest_checks(manifest: DatasetManifest, frame: pd.DataFrame) -> list[_Check]:
    import great_expectations.expectations as gxe

    ceiling = math.log(manifest.vocab_size)
    checks = [
        _Check(
            gxe.ExpectColumnValuesToBeBetween(column="loss_floor", min_value=0, max_value=ceiling, strict_min=True),
            lambda _: [
                f"{MANIFEST_KEY}: loss_floor {manifest.loss_floor} is outside (0, ln {manifest.vocab_size} = "
                f"{ceiling:.4f}]: re-create the dataset"
            ],
        )
    ]
    if "model_vocab_size" in frame:
        model_vocab = int(frame["model_vocab_size"].iloc[0])
        checks.append(
            _Check(
                gxe.ExpectColumnPairValuesToBeEqual(column_A="vocab_size", column_B="model_vocab_size"),
                lambda _: [
                    f"dataset vocab_size {manifest.vocab_size} != model vocab_size {model_vocab}: "
                    f"set training.model.vocab_size: {manifest.vocab_size} or use a matching dataset"
                ],
            )
        )
    return checks


def _run(asset: str, frame: pd.DataFrame, checks: list[_Check]) -> list[str]:
    """Run the checks as one suite over the frame; the problem lines of the failures, in the checks' order."""
    for index, check in enumerate(checks):
        check.expectation.meta = {"check": index}
    with gx.suite_of(gx.dataframe_batch(asset), [check.expectation for check in checks]) as definition:
        outcome = gx.run(definition, frame, _RESULT_FORMAT)
    failures: dict[int, dict[str, Any]] = {}
    for result in outcome.results:
        if result.exception_info.get("raised_exception"):
            raise RuntimeError(
                f"Great Expectations failed on {result.expectation_config.type}: "
                f"{result.exception_info['exception_message']}: report this as a trainpipe bug"
            )
        if not result.success:
            failures[result.expectation_config.meta["check"]] = result.result
    return [line for index, check in enumerate(checks) if index in failures for line in check.describe(failures[index])]


def validate_dataset(store: ObjectStore, *, deep: bool = True, expected_vocab: int | None = None) -> ValidationReport:
    """Check the dataset at the store's root; raises DatasetError only when there is no usable manifest."""
    manifest = load_manifest(store)
    gx.import_gx()
    shard_frame = _shard_rows(store, manifest, deep)
    manifest_row: dict[str, Any] = {
        "name": MANIFEST_KEY,
        "vocab_size": manifest.vocab_size,
        "loss_floor": manifest.loss_floor,
    }
    if expected_vocab is not None:
        manifest_row["model_vocab_size"] = expected_vocab
    manifest_frame = pd.DataFrame([manifest_row])
    problems = _run("shards", shard_frame, _shard_checks(store, manifest, shard_frame, deep))
    problems += _run("manifest", manifest_frame, _manifest_checks(manifest, manifest_frame))
    report = ValidationReport(
        url=store.url,
        shards=len(manifest.shards),
        total_tokens=manifest.total_tokens,
        vocab_size=manifest.vocab_size,
        deep=deep,
        problems=list(dict.fromkeys(problems)),
    )
    logger.info("validated dataset %s: %s", store.url, "OK" if report.ok else f"{len(report.problems)} problems")
    return report
