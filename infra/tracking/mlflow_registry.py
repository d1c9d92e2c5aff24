"""MLflow's model registry as a mirror of trainpipe's: the store's alias history decides, MLflow follows.

Every checkpoint an alias has pointed at is one model version whose source is the committed checkpoint's URL (no
bytes copied), with its lineage as tags and its trainpipe run's MLflow run as its run; the MLflow alias is set to
the version of the checkpoint the store's alias points at now. mirror_alias brings one alias in line from the whole
history, so a promotion, a rollback and `trainpipe model sync --mlflow` are the same idempotent call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from infra.registry import Registry, resolve_checkpoint
from infra.registry.chain import link
from infra.tracking.mlflow_run import RUN_ID_TAG, flatten

CHECKPOINT_TAG = "trainpipe.checkpoint"


@dataclass(frozen=True)
class Mirrored:
    """One alias as MLflow holds it after a mirror: the version its alias names (None: the alias names nothing)."""

    model: str
    alias: str
    version: str | None
    created: int  # model versions created by this call (0 when MLflow was in line already)
    alias_moved: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _missing(exc: MlflowException) -> bool:
    return exc.error_code == "RESOURCE_DOES_NOT_EXIST"


def mlflow_run_of(client: MlflowClient, run_id: str | None, known: Mapping[str, str]) -> str | None:
    """The MLflow run of a trainpipe run id: given (the run that promotes) or found by its tag in any experiment."""
    if run_id is None:
        return None
    if run_id in known:
        return known[run_id]
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(experiments, filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'", max_results=1)
    return found[0].info.run_id if found else None


def version_tags(root_url: str, target: str, run_id: str | None) -> dict[str, str]:
    """The checkpoint's lineage (its manifest's) as a version's tags."""
    tags = {CHECKPOINT_TAG: target, RUN_ID_TAG: str(run_id)}
    manifest = link(resolve_checkpoint(target, root_url)).manifest
    if manifest.lineage is not None:
        tags.update({f"trainpipe.lineage.{k}": v for k, v in flatten(manifest.lineage.model_dump(mode="json")).items()})
    return tags


def mirror_alias(client: MlflowClient, root_url: str, model: str, alias: str,
                 known_runs: Mapping[str, str] | None = None) -> Mirrored:
    """A version for every checkpoint model@alias has named, the MLflow alias on the one it names now. Raises what
    the client raises (the caller reports it); repeating it changes nothing."""
    registry = Registry(root_url)
    history = registry.history(model, alias)
    known = dict(known_runs or {})
    try:
        client.get_registered_model(model)
    except MlflowException as exc:
        if not _missing(exc):
            raise
        client.create_registered_model(model, tags={"trainpipe.registry": root_url})
    versions = {v.tags.get(CHECKPOINT_TAG, v.source): v.version
                for v in client.search_model_versions(f"name='{model}'")}
    created = 0
    for move in history:
        if move.target is None or move.target in versions:
            continue
        run = mlflow_run_of(client, move.run_id, known)
        version = client.create_model_version(model, source=move.target, run_id=run,
                                              tags=version_tags(root_url, move.target, move.run_id),
                                              description=move.reason)
        versions[move.target] = version.version
        created += 1
    head = history[-1] if history else None
    wanted = versions.get(head.target) if head is not None and head.target is not None else None
    now: str | None = client.get_registered_model(model).aliases.get(alias)
    if now is not None:
        now = str(now)
    if now != wanted:
        if wanted is None:
            client.delete_registered_model_alias(model, alias)
        else:
            client.set_registered_model_alias(model, alias, wanted)
    return Mirrored(model, alias, wanted, created, now != wanted)


def mirror_all(client: MlflowClient, root_url: str) -> list[Mirrored]:
    """`trainpipe model sync --mlflow`: every alias of every model in the store."""
    return [mirror_alias(client, root_url, model, alias)
            for model, aliases in Registry(root_url).models().items() for alias in aliases]
