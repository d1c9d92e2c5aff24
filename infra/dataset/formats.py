"""What the files of a dataset are, and how the tabular ones (Parquet, CSV, JSONL, trainpipe token shards) are read
into DataFrames: whole, or only their first rows with ranged GETs (a Parquet footer and its first row groups; the
first lines of a CSV or JSONL file through a growing prefix; the first tokens of a shard).

The trainpipe token format (trainpipe-tokens-v1: manifest.json beside uint16 shard-NNNNN.bin files) is one format
among these: a shard reads as one column, `token`.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import numpy as np
import pandas as pd

from infra.dataset.manifest import DATASET_FORMAT, MANIFEST_KEY
from infra.storage.base import ObjectStore
from infra.storage.retry import call_with_retries

TABULAR = ("parquet", "csv", "jsonl", "tokens")
TOKEN_COLUMN = "token"
_BY_SUFFIX = {
    ".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl",
    ".tar": "webdataset", ".mds": "mds", ".json": "json", ".txt": "text", ".bin": "binary",
    ".jpg": "image", ".jpeg": "image", ".png": "image", ".webp": "image",
}
_FIRST_READ = 64 << 10  # a sample's first GET; it grows 4× until it holds the rows asked for
_COUNT_CHUNK = 8 << 20
_MAX_TOKEN_MANIFEST = 1 << 20


def _parent(key: str) -> str:
    parent = str(PurePosixPath(key).parent)
    return "" if parent == "." else parent


def _token_dirs(store: ObjectStore, keys: Iterable[str]) -> set[str]:
    """The dirs whose manifest.json declares trainpipe token shards."""
    dirs = set()
    for key in keys:
        if PurePosixPath(key).name != MANIFEST_KEY:
            continue
        try:
            declared = json.loads(store.get_range(key, 0, _MAX_TOKEN_MANIFEST)).get("format")
        except (ValueError, AttributeError):
            continue  # some other manifest.json: not ours to judge
        if declared == DATASET_FORMAT:
            dirs.add(_parent(key))
    return dirs


def detect_formats(store: ObjectStore, keys: list[str]) -> dict[str, str]:
    """key -> format: parquet, csv, jsonl, tokens (the tabular ones), or what the name says (webdataset, mds, json,
    text, image, binary), else other."""
    token_dirs = _token_dirs(store, keys)
    formats = {}
    for key in keys:
        path = PurePosixPath(key)
        found = _BY_SUFFIX.get(path.suffix.lower(), "other")
        if found == "binary" and path.name.startswith("shard-") and _parent(key) in token_dirs:
            found = "tokens"
        formats[key] = found
    return formats


class RangedFile(io.RawIOBase):
    """A read-only, seekable file over one object: every read is a ranged GET (retried when transient)."""

    def __init__(self, store: ObjectStore, key: str, size: int) -> None:
        super().__init__()
        self.store, self.key, self.size = store, key, size
        self._position = 0
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        length = min(len(buffer), self.size - self._position)
        if length <= 0:
            return 0
        data = get_range(self.store, self.key, self._position, length)
        buffer[: len(data)] = data
        self._position += len(data)
        self.bytes_read += len(data)
        return len(data)


def get_range(store: ObjectStore, key: str, start: int, length: int) -> bytes:
    return call_with_retries(lambda: store.get_range(key, start, length),
                             f"GET {store.url_for(key)} bytes {start}-{start + length - 1}")


@dataclass
class Read:
    """A file's rows as a DataFrame, and how many bytes of the object were fetched to get them."""

    frame: pd.DataFrame
    bytes_read: int


def _gx_friendly(frame: pd.DataFrame) -> pd.DataFrame:
    # Great Expectations compares int64 and float64 columns vectorised; other widths go row by row (~5× slower).
    for column, dtype in frame.dtypes.items():
        if pd.api.types.is_integer_dtype(dtype) and not pd.api.types.is_extension_array_dtype(dtype):
            frame[column] = frame[column].astype(np.int64)
        elif pd.api.types.is_float_dtype(dtype) and not pd.api.types.is_extension_array_dtype(dtype):
            frame[column] = frame[column].astype(np.float64)
    return frame


def _head(store: ObjectStore, key: str, size: int, lines: int) -> tuple[bytes, int]:
    """The object's first `lines` lines (fewer when it has fewer), read through a growing prefix."""
    data = b""
    want = _FIRST_READ
    while len(data) < size and data.count(b"\n") < lines:
        data += get_range(store, key, len(data), min(want, size - len(data)))
        want *= 4
    fetched = len(data)
    cut = -1
    for _ in range(lines):
        cut = data.find(b"\n", cut + 1)
        if cut < 0:
            break
    if cut >= 0:
        data = data[: cut + 1]
    elif fetched < size:  # the last line is incomplete: drop it
        data = data[: data.rfind(b"\n") + 1]
    return data, fetched


def _parse_text(fmt: str, data: bytes) -> pd.DataFrame:
    if not data.strip():
        return pd.DataFrame()
    if fmt == "csv":
        return pd.read_csv(io.BytesIO(data))
    # Values as written: a string column that looks like dates stays strings for the expectations to judge.
    return pd.read_json(io.BytesIO(data), lines=True, dtype=False)


def read_rows(store: ObjectStore, key: str, size: int, fmt: str, rows: int | None) -> Read:
    """The file's rows (all of them, or the first `rows`) with GX-friendly dtypes."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        raw = RangedFile(store, key, size)
        with pq.ParquetFile(raw) as parquet:  # pyarrow asks for exactly the ranges it needs
            if rows is None:
                table = parquet.read()
            else:  # the first row groups that hold the rows asked for: their column chunks and nothing else
                groups, held = [], 0
                while held < rows and len(groups) < parquet.metadata.num_row_groups:
                    held += parquet.metadata.row_group(len(groups)).num_rows
                    groups.append(len(groups))
                table = parquet.read_row_groups(groups).slice(0, rows) if groups else parquet.schema_arrow.empty_table()
        return Read(_gx_friendly(table.to_pandas()), raw.bytes_read)
    if fmt == "tokens":
        length = size if rows is None else min(size, 2 * rows)
        data = get_range(store, key, 0, length) if length else b""
        tokens = np.frombuffer(data, dtype="<u2", count=len(data) // 2).astype(np.int64)
        return Read(pd.DataFrame({TOKEN_COLUMN: tokens}), len(data))
    if fmt in ("csv", "jsonl"):
        if rows is None:
            data = store.get_bytes(key)
            return Read(_gx_friendly(_parse_text(fmt, data)), len(data))
        head, fetched = _head(store, key, size, rows + (1 if fmt == "csv" else 0))  # CSV: the header line too
        return Read(_gx_friendly(_parse_text(fmt, head)), fetched)
    raise ValueError(f"{fmt}: not a tabular format ({', '.join(TABULAR)})")


def _count_lines(store: ObjectStore, key: str, size: int) -> int:
    lines, last = 0, b"\n"
    for offset in range(0, size, _COUNT_CHUNK):
        data = get_range(store, key, offset, min(_COUNT_CHUNK, size - offset))
        lines += data.count(b"\n")
        last = data[-1:] or last
    return lines + (last != b"\n")


def describe(store: ObjectStore, key: str, size: int, fmt: str) -> tuple[int, dict[str, str]]:
    """Row count and schema (column -> type) of a tabular file; Parquet's come from its footer alone."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with pq.ParquetFile(RangedFile(store, key, size)) as parquet:
            schema = parquet.schema_arrow
            return parquet.metadata.num_rows, {name: str(schema.field(name).type) for name in schema.names}
    if fmt == "tokens":
        return size // 2, {TOKEN_COLUMN: "uint16"}
    lines = _count_lines(store, key, size)
    sample = read_rows(store, key, size, fmt, 100).frame
    rows = max(0, lines - 1) if fmt == "csv" else lines
    return rows, {str(column): str(dtype) for column, dtype in sample.dtypes.items()}


class ByteCounter:
    """Bytes read from the store by validation's reader threads, added up."""

    def __init__(self) -> None:
        self.total = 0
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        with self._lock:
            self.total += count
