"""The model registry (aliases with an append-only history, in the checkpoint store), checkpoint references, and
the lineage recorded in every committed manifest. Plain Python: no Prefect."""

from infra.checkpoints.lineage import Lineage, LineageCluster, LineageSnapshot
from infra.registry.refs import AliasConflict, CheckpointTarget, RegistryError, parse_model_ref, registry_root_of
from infra.registry.registry import ANY, RECENT_MOVES, REGISTRY_DIR, AliasMove, Registry, resolve_checkpoint

K = RECENT_MOVES

__all__ = [
    "ANY",
    "RECENT_MOVES",
    "REGISTRY_DIR",
    "AliasConflict",
    "AliasMove",
    "CheckpointTarget",
    "K",
    "Lineage",
    "LineageCluster",
    "LineageSnapshot",
    "Registry",
    "RegistryError",
    "parse_model_ref",
    "registry_root_of",
    "resolve_checkpoint",
]
