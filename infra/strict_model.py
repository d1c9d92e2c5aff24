"""The base every trainpipe record model shares: unknown fields are errors, records never change once built. And
the checks config sections share (a file the config names must be readable before anything runs)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

SHA256_HEX = r"^[0-9a-f]{64}$"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def readable_file(value: str, what: str, fix: str) -> str:
    """An absolute path to a file this process can read (relative paths count from the cwd)."""
    path = Path(value).expanduser().resolve()
    if not path.is_file() or not os.access(path, os.R_OK):
        raise ValueError(f"{what} {path}: not a readable file: {fix}")
    return str(path)


def one_of(value: str, known: Sequence[str], what: str) -> str:
    """value when it is among known; else the error a validator raises: what, the value and every choice."""
    if value not in known:
        raise ValueError(f"{what} {value!r}: use one of {', '.join(known)}")
    return value
