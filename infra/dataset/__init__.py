"""Datasets: any prefix of objects, frozen per run as a snapshot (snapshot), assigned to nodes (assign), staged
through a node's object cache (stagecache), read by format (formats) and checked at plan with a Great Expectations
suite (expectations, gate, docs); planning puts these together for the job's `dataset:` and `inputs:` sections
(spec). The bundled trainer's token format (manifest, synth, validate) is one format among them.

Great Expectations is imported only when a suite is first loaded or run, and the names below only when first used,
so importing this package (or any of its modules) stays cheap.

May import: storage and the shared infra modules; the node agent never imports planning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infra.dataset.errors import DatasetError
    from infra.dataset.manifest import DatasetManifest, ShardInfo, load_manifest, write_manifest
    from infra.dataset.synth import synthesize
    from infra.dataset.validate import ValidationReport, validate_dataset

# name -> its module, imported on first use: the node agent imports infra.dataset.* for every stage, and the token
# format's synth and validate pull numpy and pandas (~0.4 s of a stager's start on an idle core, seconds on loaded
# ones) that staging never uses.
_LAZY = {
    "DatasetError": "errors", "DatasetManifest": "manifest", "ShardInfo": "manifest", "load_manifest": "manifest",
    "write_manifest": "manifest", "synthesize": "synth", "ValidationReport": "validate",
    "validate_dataset": "validate",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "DatasetError",
    "DatasetManifest",
    "ShardInfo",
    "ValidationReport",
    "load_manifest",
    "synthesize",
    "validate_dataset",
    "write_manifest",
]
