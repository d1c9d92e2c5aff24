"""The base every trainpipe record model shares: unknown fields are errors, records never change once built."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

SHA256_HEX = r"^[0-9a-f]{64}$"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
