"""The data gate: the job's expectation suite run with Great Expectations over every tabular file of the snapshot,
by the orchestrator at plan, before anything is launched.

The suite applies to each file. Expectations judged row by row (column values, pairs, multicolumn) check many small
files at once, the file name carried as an index column so every unexpected value is still named with its file;
the others (row counts, means, uniqueness, ...) check each file on its own. `full` reads every row; `sample` reads
the first sample_rows rows of each file with ranged GETs. The results add up to one row per expectation: whether
it held everywhere, rows checked, rows unexpected, a few unexpected values and the files they came from.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from infra.dataset import gx
from infra.dataset.expectations import DatasetExpectation
from infra.dataset.formats import TABULAR, read_rows
from infra.dataset.manifest import DatasetError
from infra.storage.base import ObjectStore

FILE_COLUMN = "__trainpipe_file__"
GROUP_ROWS = 1_000_000  # rows of small files checked together by row-wise expectations
_READ_AHEAD = 16  # files read at once (each by its own thread)
_SHOWN = 5
_VALUE_CHARS = 60
_RESULT = {"result_format": "SUMMARY", "partial_unexpected_count": 20}


def _plain(value: Any) -> Any:
    """A JSON-able, one-line version of a value from a DataFrame."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool | int | float):
        return value
    text = " ".join(str(value).split())
    return text if len(text) <= _VALUE_CHARS else text[: _VALUE_CHARS - 1] + "…"


@dataclass
class ExpectationResult:
    index: int
    type: str
    column: str | None
    kwargs: dict[str, Any]
    config: dict[str, Any]  # GX's own configuration of the expectation (the Data Docs page is rendered from it)
    success: bool = True
    files: int = 0
    rows: int = 0
    unexpected: int = 0
    values: list[Any] = field(default_factory=list)
    failed_files: list[str] = field(default_factory=list)
    observed: Any = None
    error: str | None = None

    def _failed_in(self, key: str) -> None:
        self.success = False
        if key not in self.failed_files and len(self.failed_files) < _SHOWN:
            self.failed_files.append(key)

    def _value(self, value: Any) -> None:
        value = _plain(value)
        if value not in self.values and len(self.values) < _SHOWN:
            self.values.append(value)

    def add(self, result: Any, keys: Sequence[str], rows: int) -> None:
        """Fold in GX's result of this expectation over the rows of these files."""
        self.files += len(keys)
        info = result.result or {}
        self.rows += int(info.get("element_count", rows) or 0)
        raised = result.exception_info.get("raised_exception") if "raised_exception" in result.exception_info \
            else any(e.get("raised_exception") for e in result.exception_info.values())
        if raised:
            message = result.exception_info.get("exception_message") or next(
                (e.get("exception_message") for e in result.exception_info.values() if e.get("raised_exception")), "")
            self.error = self.error or " ".join(str(message).split())
            for key in keys:
                self._failed_in(key)
            return
        if result.success:
            return
        self.unexpected += int(info.get("unexpected_count") or 0)
        indexed = info.get("partial_unexpected_index_list") or []
        columns = [c for c in (self.column or "").split(", ") if c]
        for row in indexed:
            self._failed_in(row.get(FILE_COLUMN, keys[0]))
            picked = [row.get(c) for c in columns]
            self._value(picked[0] if len(picked) == 1 else tuple(_plain(v) for v in picked))
        if not indexed:
            for value in info.get("partial_unexpected_list") or []:
                self._value(value)
            self.observed = _plain(info.get("observed_value")) if self.observed is None else self.observed
            self._failed_in(keys[0])

    def row(self) -> dict[str, Any]:
        """This expectation as one row of the report's and the artifact's table."""
        return {"expectation": self.type, "column": self.column or "", "success": self.success, "files": self.files,
                "rows": self.rows, "unexpected": self.unexpected,
                "unexpected values": ", ".join("null" if v is None else repr(v) for v in self.values),
                "failed files": ", ".join(self.failed_files),
                "observed": "" if self.observed is None else str(self.observed), "error": self.error or ""}

    def failure(self, url: str) -> str:
        where = f" on column '{self.column}'" if self.column else ""
        file = f"{url}/{self.failed_files[0]}" if self.failed_files else url
        if self.error:
            return f"dataset expectation {self.type} could not be checked{where} in {file}: {self.error}"
        if self.values:
            shown = ", ".join("null" if v is None else repr(v) for v in self.values)
            counts = f"{self.unexpected:,} of {self.rows:,} rows unexpected" if self.unexpected else "unexpected"
            return f"dataset expectation {self.type} failed{where} in {file}: {counts}, e.g. {shown}"
        return f"dataset expectation {self.type} failed{where} in {file}: observed {self.observed}"


@dataclass
class DatasetValidation:
    url: str
    mode: str
    sample_rows: int | None
    files: int  # tabular files checked
    rows: int  # rows read
    bytes_read: int  # bytes fetched from the store to read them
    bytes_total: int  # size of the files checked
    seconds: float
    results: list[ExpectationResult]

    @property
    def ok(self) -> bool:
        return all(result.success for result in self.results)

    def rows_table(self) -> list[dict[str, Any]]:
        return [result.row() for result in self.results]

    def failure_message(self) -> str:
        """One line: the first failed expectation, with its column, file and sample bad values."""
        failed = [result for result in self.results if not result.success]
        more = f" (and {len(failed) - 1} more failed expectation{'s' * (len(failed) > 2)})" if len(failed) > 1 else ""
        return f"{failed[0].failure(self.url)}{more}: fix the data, or the expectation in dataset.expectations"

    def render(self) -> str:
        read = "every row" if self.mode == "full" else f"first {self.sample_rows:,} rows per file"
        verdict = "all passed" if self.ok else f"{sum(not r.success for r in self.results)} failed"
        return (f"expectations: {len(self.results)} on {self.files} tabular files ({read}; {self.rows:,} rows, "
                f"{self.bytes_read / 1e6:,.1f} of {self.bytes_total / 1e6:,.1f} MB read in {self.seconds:.1f}s): "
                f"{verdict}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatasetValidation:
        return cls(**{**data, "results": [ExpectationResult(**r) for r in data["results"]]})


@dataclass
class _Loaded:
    key: str
    frame: pd.DataFrame


def _copies(expectations: Sequence[DatasetExpectation]) -> list[Any]:
    # A GX expectation belongs to one suite; every run gets its own copies.
    return [e.expectation.configuration.to_domain_obj() for e in expectations]


class _Gate:
    def __init__(self, expectations: Sequence[DatasetExpectation]) -> None:
        self.expectations = list(expectations)
        self.results = {e.index: ExpectationResult(
            index=e.index, type=e.type, column=e.column, kwargs={k: _plain(v) for k, v in e.kwargs.items()},
            config=e.expectation.configuration.to_json_dict()) for e in expectations}
        self._group: list[_Loaded] = []
        self._group_rows = 0

    def _check(self, expectations: list[DatasetExpectation], loaded: list[_Loaded]) -> None:
        """One GX run of these expectations over the files' rows; row-wise ones see which file each row is from."""
        if not expectations:
            return
        frame = loaded[0].frame if len(loaded) == 1 else pd.concat([i.frame for i in loaded], ignore_index=True)
        keys = [item.key for item in loaded]
        result_format = dict(_RESULT)
        if expectations[0].per_row:  # (a file's own checks never see the extra column: it would change its schema)
            # Categorical: one small code per row, whatever the key's length.
            codes = np.repeat(np.arange(len(loaded), dtype=np.int32), [len(item.frame) for item in loaded])
            frame = frame.assign(**{FILE_COLUMN: pd.Categorical.from_codes(codes, categories=keys)})
            result_format["unexpected_index_column_names"] = [FILE_COLUMN]
        with gx.suite_of(gx.dataframe_batch("dataset"), _copies(expectations)) as definition:
            outcome = gx.run(definition, frame, result_format)
        for result in outcome.results:
            self.results[result.expectation_config.meta["trainpipe_index"]].add(result, keys, len(frame))

    def add(self, loaded: _Loaded) -> None:
        applicable = [e for e in self.expectations if e.applies_to(loaded.key)]
        self._check([e for e in applicable if not e.per_row], [loaded])
        if self._group and list(self._group[0].frame.columns) != list(loaded.frame.columns):
            self.flush()
        self._group.append(loaded)
        self._group_rows += len(loaded.frame)
        if self._group_rows >= GROUP_ROWS:
            self.flush()

    def flush(self) -> None:
        """Check the gathered files with the row-wise expectations, each over the files it applies to."""
        group, self._group, self._group_rows = self._group, [], 0
        by_applicable: dict[tuple[int, ...], list[_Loaded]] = {}
        for item in group:
            indices = tuple(e.index for e in self.expectations if e.per_row and e.applies_to(item.key))
            by_applicable.setdefault(indices, []).append(item)
        for indices, items in by_applicable.items():
            self._check([e for e in self.expectations if e.index in indices], items)


def _reads(store: ObjectStore, files: Sequence[tuple[str, int, str]], rows: int | None,
           counted: list[int]) -> Iterator[_Loaded]:
    """The files' rows in order, read a few files ahead by a pool of threads."""
    def read(item: tuple[str, int, str]) -> _Loaded:
        key, size, fmt = item
        try:
            got = read_rows(store, key, size, fmt, rows)
        except (ValueError, OSError) as exc:
            raise DatasetError(f"{store.url_for(key)}: not readable as {fmt} ({' '.join(str(exc).split())}): fix "
                               "the file, or leave it out with dataset.exclude") from None
        counted.append(got.bytes_read)
        return _Loaded(key, got.frame)

    with ThreadPoolExecutor(max_workers=_READ_AHEAD) as pool:
        for start in range(0, len(files), _READ_AHEAD):
            yield from pool.map(read, files[start:start + _READ_AHEAD])


def validate_files(store: ObjectStore, files: Sequence[tuple[str, int]], formats: dict[str, str],
                   expectations: Sequence[DatasetExpectation], mode: str, sample_rows: int) -> DatasetValidation:
    """Run the suite over the tabular files among (key, size); a file that cannot be read is a DatasetError."""
    started = time.monotonic()
    tabular = [(key, size, formats[key]) for key, size in files if formats.get(key) in TABULAR]
    if not tabular:
        raise DatasetError(f"dataset.expectations: none of the {len(files)} selected files under {store.url} is "
                           f"tabular ({', '.join(TABULAR)}): remove the expectations or fix dataset.include")
    rows = None if mode == "full" else sample_rows
    gate = _Gate(expectations)
    counted: list[int] = []
    total_rows = 0
    for loaded in _reads(store, tabular, rows, counted):
        total_rows += len(loaded.frame)
        gate.add(loaded)
    gate.flush()
    return DatasetValidation(
        url=store.url, mode=mode, sample_rows=rows, files=len(tabular), rows=total_rows, bytes_read=sum(counted),
        bytes_total=sum(size for _, size, _ in tabular), seconds=round(time.monotonic() - started, 3),
        results=[gate.results[e.index] for e in expectations])
