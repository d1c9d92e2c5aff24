"""What a logger said, for tests: Prefect's logging setup leaves pytest's caplog without the records of many loggers."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [record.getMessage() for record in self.records]


@contextlib.contextmanager
def listening(name: str) -> Iterator[Said]:
    """Warnings and worse of the logger name (and its children) while the block runs."""
    said = Said()
    logging.getLogger(name).addHandler(said)
    try:
        yield said
    finally:
        logging.getLogger(name).removeHandler(said)
