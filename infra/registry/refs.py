"""Checkpoint references as users write them: a step URL, a run's root (its newest commit) or `<model>@<alias>`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from infra.checkpoints.commit import CheckpointStore
from infra.checkpoints.steps import PATTERN as STEP_PATTERN
from infra.checkpoints.steps import step_name
from infra.storage import as_url, open_store

# Model and alias names: what a key part and a shell word can hold without quoting.
NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_MODEL_REF = re.compile(rf"^(?P<model>{NAME})@(?P<alias>{NAME})$")
_STEP_URL = re.compile(rf"^(?P<run>.+)/{STEP_PATTERN}/?$")


class RegistryError(Exception):
    """A model reference, alias or move that cannot be used; one line naming the thing and the fix."""


class AliasConflict(RegistryError):
    """A concurrent move of the alias won; this move wrote nothing."""


@dataclass(frozen=True)
class CheckpointTarget:
    """A committed checkpoint, resolved."""

    run_url: str  # the run's checkpoint root, e.g. s3://b/ckpts/<run-id>
    step: int
    url: str  # the step URL as `trainpipe run` prints it (run_url/step-XXXXXXXX)


def parse_model_ref(text: str) -> tuple[str, str] | None:
    """("name", "alias") for "name@alias"; None for anything else (a URL, a path)."""
    match = _MODEL_REF.match(text.strip())
    return (match["model"], match["alias"]) if match else None


def check_name(kind: str, name: str) -> str:
    if not re.fullmatch(NAME, name):
        raise RegistryError(f"{kind} {name!r}: use letters, digits, '.', '_' or '-' (starting with a letter or digit)")
    return name


def step_url(run_url: str, step: int) -> str:
    return f"{run_url.rstrip('/')}/{step_name(step)}"


def resolve_checkpoint(ref: str, root_url: str) -> CheckpointTarget:
    """The committed checkpoint ref names: a step URL, a run's root (its newest commit), or "<model>@<alias>" in the
    registry under root_url. RegistryError naming the ref and the fix when it names nothing committed."""
    model_ref = parse_model_ref(ref)
    if model_ref is not None:
        from infra.registry.registry import Registry  # the registry resolves its targets through here

        move = Registry(root_url).resolve(*model_ref)
        if move is None or move.target is None:
            raise RegistryError(f"{ref}: the alias names no checkpoint in {Registry(root_url).url}: promote one first "
                                f"(trainpipe model promote {ref} CKPT) or check the name (trainpipe model ls)")
        return resolve_checkpoint(move.target, root_url)
    url = as_url(ref.strip()).rstrip("/")
    found = _STEP_URL.match(url)
    run_url, step = (found["run"], int(found["step"])) if found else (url, None)
    checkpoints = CheckpointStore(open_store(run_url))
    committed = checkpoints.committed()
    if step is None:
        if not committed:
            raise RegistryError(f"{ref}: no committed checkpoint under it: give a run's checkpoint root or a step URL "
                                "as `trainpipe run` prints it, or <model>@<alias>")
        step = committed[0].step
    elif step not in {manifest.step for manifest in committed}:
        raise RegistryError(f"{ref}: step {step} is not committed (or is damaged): pick a committed step "
                            f"(trainpipe ckpt ls {run_url})")
    return CheckpointTarget(run_url=checkpoints.store.url, step=step, url=step_url(checkpoints.store.url, step))


def registry_root_of(run_url: str) -> str:
    """The registry root of a run's checkpoint root (<checkpoints.url>/<run_id>): its parent."""
    return as_url(run_url).rstrip("/").rsplit("/", 1)[0]

