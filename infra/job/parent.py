"""A run's parent: the committed checkpoint training.init_from named at the run's first attempt, kept beside the run's
checkpoints (<checkpoints.url>/<run-id>/_run/parent.json).

Every recovery and every rerun of the run id (`trainpipe run --run-id` after a kill) takes the parent from there and
never resolves init_from again: an alias (gpt@production) may have moved since, even to this run's own promoted step,
and the lineage would name a parent the run never loaded; the step it named may have been deleted, which a resume
that continues from the run's own commit does not need.
"""

from __future__ import annotations

import json
import time
from typing import Literal

from pydantic import Field, ValidationError

from infra.checkpoints.layout import CheckpointError
from infra.checkpoints.store import CheckpointStore
from infra.registry import CheckpointTarget, RegistryError, resolve_checkpoint
from infra.storage import StorageError, open_store
from infra.storage.base import ObjectNotFound, ObjectStore
from infra.strict_model import StrictModel

PARENT_KEY = "_run/parent.json"  # under the run's checkpoint root
PARENT_FORMAT = "trainpipe-run-parent-v1"


class ParentError(ValueError):
    """The run's parent cannot be used as the job names it now; one line naming the thing and the fix."""


class RunParent(StrictModel):
    format: Literal["trainpipe-run-parent-v1"] = PARENT_FORMAT
    init_from: str = Field(description="training.init_from as the job named it at the run's first attempt.")
    run_url: str = Field(description="The parent's run checkpoint root.")
    step: int = Field(ge=0)
    url: str = Field(description="The parent's step URL: what the run loaded and its lineage names.")
    fixed_at: float

    @property
    def target(self) -> CheckpointTarget:
        return CheckpointTarget(run_url=self.run_url, step=self.step, url=self.url)


def load_parent(run_store: ObjectStore) -> RunParent | None:
    """The parent kept with the run (run_store: its checkpoint root); None when its first attempt has not fixed one."""
    try:
        raw = run_store.get_bytes(PARENT_KEY)
    except ObjectNotFound:
        return None
    try:
        return RunParent.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as exc:
        reason = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else "not valid JSON"
        raise ParentError(f"{run_store.url_for(PARENT_KEY)}: unreadable run parent ({reason}): restore it, or start "
                          "a new run (a new run id)") from None


def fix_parent(run_store: ObjectStore, parent: RunParent) -> str:
    """Keep the parent with the run: from now on every attempt of it starts from this one."""
    run_store.put_bytes(PARENT_KEY, parent.model_dump_json(indent=1).encode())
    return run_store.url_for(PARENT_KEY)


def resolve_parent(init_from: str, registry_root: str) -> RunParent:
    """init_from resolved now (the run's first attempt): the committed checkpoint it names."""
    try:
        target = resolve_checkpoint(init_from, registry_root)
    except (RegistryError, CheckpointError, StorageError) as exc:
        raise ParentError(f"training.init_from: {exc}") from None
    return RunParent(init_from=init_from, run_url=target.run_url, step=target.step, url=target.url,
                     fixed_at=time.time())


def kept_parent(parent: RunParent, init_from: str | None, run_id: str, warm_start: bool) -> RunParent:
    """The parent the run fixed at its first attempt, held to the job as it is now: init_from must name it as it
    did then. warm_start: the run has no commit of its own yet, so the parent is restored again and must still be
    committed; a resume continues from the run's own commit and does not read it."""
    if init_from != parent.init_from:
        raise ParentError(f"training.init_from is {init_from!r} but run {run_id} began from {parent.url} "
                          f"({parent.init_from!r} at its first attempt): restore training.init_from, or start a new "
                          "run (a new run id)")
    if warm_start:
        try:
            CheckpointStore(open_store(parent.run_url)).manifest(parent.step)
        except (CheckpointError, StorageError) as exc:
            raise ParentError(f"training.init_from: run {run_id} began from {parent.url} ({parent.init_from} at its "
                              f"first attempt), which is no longer committed ({exc}), and the run has no commit of its "
                              "own to resume: restore that checkpoint, or start a new run (a new run id)") from None
    return parent
