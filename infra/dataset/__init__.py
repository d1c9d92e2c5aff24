"""Datasets: any prefix of objects, frozen per run as a snapshot (snapshot), assigned to nodes (assign), staged
through a node's object cache (stagecache), read by format (formats) and checked at plan with a Great Expectations
suite (expectations, gate, docs); planning puts these together. The bundled trainer's token format (manifest, synth,
validate) is one format among them.

Great Expectations is imported only when a suite is first loaded or run, so importing this package stays cheap.

May import: storage and the shared infra modules; planning alone also reads the job's DatasetSpec (infra.job.spec),
and the node agent never imports planning.
"""

from infra.dataset.manifest import DatasetError, DatasetManifest, ShardInfo, load_manifest, write_manifest
from infra.dataset.synth import synthesize
from infra.dataset.validate import ValidationReport, validate_dataset

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
