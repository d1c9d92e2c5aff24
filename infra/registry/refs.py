"""Checkpoint references as users write them: a step URL, a run's root (its newest commit) or `<model>@<alias>`; the
names and errors of the registry. Resolving a reference to a committed checkpoint is the registry's
(infra.registry.registry.resolve_checkpoint): an alias resolves through it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from infra.checkpoints.steps import step_name
from infra.storage import as_url

# Model and alias names: what a key part and a shell word can hold without quoting.
NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_MODEL_REF = re.compile(rf"^(?P<model>{NAME})@(?P<alias>{NAME})$")


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


def registry_root_of(run_url: str) -> str:
    """The registry root of a run's checkpoint root (<checkpoints.url>/<run_id>): its parent."""
    return as_url(run_url).rstrip("/").rsplit("/", 1)[0]

