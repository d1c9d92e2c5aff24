"""Token datasets: the manifest format, a synthetic source with a known loss floor, and validation.

validate_dataset imports Great Expectations only when first called, so importing this package stays cheap.
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
