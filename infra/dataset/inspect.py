"""`trainpipe dataset inspect`: what a prefix holds (files, bytes, formats), the row counts and schemas of its
tabular files, and an expectation suite's verdict on them, as text or as JSON for scripts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from infra.dataset.expectations import load_expectations
from infra.dataset.formats import TABULAR, describe, detect_formats
from infra.dataset.gate import DatasetValidation, validate_files
from infra.dataset.listing import list_prefix
from infra.dataset.manifest import DatasetError
from infra.dataset.snapshot import select
from infra.storage import open_store

_THREADS = 8
_LISTED = 20  # tabular files shown one by one in the text output


def inspect_dataset(url: str, *, include: Sequence[str] = (), exclude: Sequence[str] = (),
                    expectations: str | None = None, validation: str = "full", sample_rows: int = 1000
                    ) -> dict[str, Any]:
    suite = load_expectations(expectations)
    store = open_store(url)
    chosen = select(list_prefix(store), store.url, include, exclude)
    formats = detect_formats(store, [item.key for item in chosen])
    by_format: dict[str, dict[str, int]] = {}
    for item in chosen:
        entry = by_format.setdefault(formats[item.key], {"files": 0, "bytes": 0})
        entry["files"] += 1
        entry["bytes"] += item.size
    tabular = [item for item in chosen if formats[item.key] in TABULAR]

    def described(item: Any) -> dict[str, Any]:
        fmt = formats[item.key]
        try:
            rows, schema = describe(store, item.key, item.size, fmt)
        except (ValueError, OSError) as exc:
            raise DatasetError(f"{store.url_for(item.key)}: not readable as {fmt} ({' '.join(str(exc).split())}): "
                               "fix the file, or leave it out with --exclude") from None
        return {"key": item.key, "format": fmt, "bytes": item.size, "rows": rows, "schema": schema}

    with ThreadPoolExecutor(max_workers=_THREADS) as pool:
        tables = list(pool.map(described, tabular))
    schemas = Counter(tuple(table["schema"].items()) for table in tables)
    checked = (validate_files(store, [(i.key, i.size) for i in chosen], formats, suite, validation, sample_rows)
               if suite else None)
    return {
        "url": store.url, "files": len(chosen), "bytes": sum(item.size for item in chosen), "formats": by_format,
        "store_checksums": sum(1 for item in chosen if item.checksum is not None),
        "rows": sum(table["rows"] for table in tables), "tabular": tables,
        "schemas": [{"schema": dict(schema), "files": count} for schema, count in schemas.most_common()],
        "validation": checked.to_dict() if checked is not None else None,
    }


def render(report: dict[str, Any]) -> str:
    kinds = ", ".join(f"{fmt} {v['files']} ({v['bytes'] / 1e6:,.1f} MB)" for fmt, v in
                      sorted(report["formats"].items(), key=lambda kv: -kv[1]["bytes"]))
    lines = [f"{report['url']}: {report['files']:,} files, {report['bytes'] / 1e6:,.1f} MB: {kinds}",
             f"  checksums kept by the store: {report['store_checksums']:,} of {report['files']:,} files "
             "(the rest are read once at plan)"]
    tables = report["tabular"]
    if tables:
        lines.append(f"  tabular: {len(tables):,} files, {report['rows']:,} rows")
        lines += [f"    {t['key']}  {t['format']}  {t['rows']:,} rows  {t['bytes'] / 1e6:,.2f} MB" for t in
                  tables[:_LISTED]]
        if len(tables) > _LISTED:
            lines.append(f"    … {len(tables) - _LISTED:,} more (--json lists every file)")
        for entry in report["schemas"]:
            columns = ", ".join(f"{name}: {kind}" for name, kind in entry["schema"].items())
            lines.append(f"  schema of {entry['files']:,} files: {columns}")
    if report["validation"] is not None:
        validation = DatasetValidation.from_dict(report["validation"])
        lines.append(f"  {validation.render()}")
        for row in validation.rows_table():
            column = f" ({row['column']})" if row["column"] else ""
            if row["success"]:
                detail = f"{row['rows']:,} rows"
            elif row["error"]:
                detail = row["error"]
            elif row["unexpected values"]:
                detail = (f"{row['unexpected']:,} of {row['rows']:,} rows unexpected, e.g. {row['unexpected values']} "
                          f"in {row['failed files']}")
            else:
                detail = f"observed {row['observed']} in {row['failed files']}"
            lines.append(f"    {'ok  ' if row['success'] else 'FAIL'} {row['expectation']}{column}: {detail}")
    return "\n".join(lines)
