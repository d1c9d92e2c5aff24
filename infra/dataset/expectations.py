"""The job's expectation suite (dataset.expectations): an ExpectationSuite JSON file, or expectations listed inline.

Inline, each expectation is {type: expect_..., <its arguments>} (or GX's own {type, kwargs, meta}); an optional
`files: <glob>` (meta.files in a suite file) limits it to the files whose key matches. Every problem is one line
naming the expectation and the fix, raised before any data is read.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.dataset.gx import import_gx
from infra.dataset.manifest import DatasetError

if TYPE_CHECKING:
    from great_expectations.expectations import Expectation


@dataclass(frozen=True)
class DatasetExpectation:
    index: int
    expectation: Expectation
    files: str | None  # glob limiting the files it applies to; None: every tabular file

    @property
    def type(self) -> str:
        return str(self.expectation.expectation_type)

    @property
    def columns(self) -> list[str]:
        kwargs = self.expectation.configuration.kwargs
        if "column" in kwargs:
            return [kwargs["column"]]
        if "column_A" in kwargs:
            return [kwargs["column_A"], kwargs["column_B"]]
        return list(kwargs.get("column_list") or [])

    @property
    def column(self) -> str | None:
        return ", ".join(self.columns) or None

    @property
    def kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in self.expectation.configuration.kwargs.items() if k not in ("column", "batch_id")}

    @property
    def per_row(self) -> bool:
        """Judged row by row: files can be checked together and still be named row by row. (Uniqueness is a map
        expectation whose verdict on a row depends on the other rows: it stays within each file.)"""
        from great_expectations.expectations.expectation import (
            ColumnMapExpectation,
            ColumnPairMapExpectation,
            MulticolumnMapExpectation,
        )

        return "unique" not in self.type and isinstance(
            self.expectation, ColumnMapExpectation | ColumnPairMapExpectation | MulticolumnMapExpectation)

    def applies_to(self, key: str) -> bool:
        return self.files is None or fnmatch.fnmatchcase(key, self.files)


def _entries(source: str | list[dict[str, Any]]) -> tuple[str, list[Any]]:
    if isinstance(source, list):
        return "dataset.expectations", source
    where = f"expectation suite {source}"
    try:
        data = json.loads(Path(source).read_text())
    except OSError as exc:
        raise DatasetError(f"{where}: unreadable ({exc.strerror or exc}): fix dataset.expectations") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{where}: not valid JSON ({exc}): export the suite with "
                           "suite.to_json_dict() or list the expectations inline") from None
    entries = data.get("expectations") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise DatasetError(f"{where}: no 'expectations' list: an ExpectationSuite JSON has one")
    return where, entries


def _one(where: str, index: int, entry: Any) -> DatasetExpectation:
    from great_expectations.exceptions import ExpectationNotFoundError
    from great_expectations.expectations.registry import get_expectation_impl
    from pydantic.v1 import ValidationError as GxValidationError

    label = f"{where}[{index}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
        raise DatasetError(f"{label}: needs a 'type' (e.g. type: expect_column_values_to_not_be_null)")
    body = dict(entry)
    kind = body.pop("type")
    meta = dict(body.pop("meta", None) or {})
    files = body.pop("files", None) or meta.pop("files", None)
    kwargs = body.pop("kwargs", None) if "kwargs" in body else body
    if files is not None and not isinstance(files, str):
        raise DatasetError(f"{label} ({kind}): files must be one glob, e.g. files: '*.parquet'")
    if not isinstance(kwargs, dict):
        raise DatasetError(f"{label} ({kind}): kwargs must be a mapping of the expectation's arguments")
    try:
        implementation = get_expectation_impl(kind)
    except ExpectationNotFoundError:
        raise DatasetError(f"{label}: unknown expectation type '{kind}': use one of Great Expectations' "
                           "(https://greatexpectations.io/expectations), e.g. expect_column_values_to_be_between"
                           ) from None
    try:
        expectation = implementation(**kwargs, meta={**meta, "trainpipe_index": index})
    except GxValidationError as exc:
        first = exc.errors()[0]
        more = len(exc.errors()) - 1
        suffix = f" (and {more} more problem{'s' * (more > 1)})" if more else ""
        field = ".".join(str(part) for part in first["loc"])
        raise DatasetError(f"{label} ({kind}): '{field}': {first['msg']}{suffix}: fix its arguments") from None
    return DatasetExpectation(index=index, expectation=expectation, files=files)


def load_expectations(source: str | list[dict[str, Any]] | None) -> list[DatasetExpectation]:
    """The suite's expectations in order; none when the job names no suite."""
    if source is None:
        return []
    where, entries = _entries(source)
    if not entries:
        raise DatasetError(f"{where}: no expectations: list at least one, or remove dataset.expectations")
    import_gx()
    return [_one(where, index, entry) for index, entry in enumerate(entries)]
