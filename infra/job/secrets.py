"""A job's secrets: it names where each value is kept (`training.secrets: {HF_TOKEN: {env: HF_TOKEN}}` or
`{prefect_secret: block-name}`); the run resolves the names when it starts a node command, here and nowhere else.

Values never enter the job spec, so they are never a flow-run parameter (shown in the Prefect UI and API), never in
the run's summary, and never on a command line (SSH nodes get their environment over the channel's stdin).
Resolving a Prefect Secret block needs Prefect, which infra does not import: the caller hands in a BlockReader.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from pydantic import Field, model_validator

from infra.strict_model import StrictModel

# A Prefect Secret block's value by the block's name; None when there is no such block.
BlockReader = Callable[[str], str | None]


class SecretMissing(ValueError):
    """A secret the job names cannot be found; one line naming it and the fix."""


class SecretRef(StrictModel):
    """Where one secret's value is kept: exactly one of env and prefect_secret."""

    env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="An environment variable of the "
                            "orchestrator (where `trainpipe run` or the deployment's worker runs), read when the run "
                            "starts each node command.")
    prefect_secret: str | None = Field(None, min_length=1, description="The name of a Prefect Secret block, read "
                                       "from the Prefect server when the run starts each node command.")

    @model_validator(mode="after")
    def _one_source(self) -> SecretRef:
        if (self.env is None) == (self.prefect_secret is None):
            raise ValueError("name exactly one place the value is kept: {env: VARIABLE} or "
                             "{prefect_secret: block-name}")
        return self

    def describe(self) -> str:
        return f"environment variable {self.env}" if self.env else f"Prefect Secret block '{self.prefect_secret}'"


def resolve_secrets(secrets: Mapping[str, SecretRef], blocks: BlockReader | None,
                    field: str = "training.secrets") -> dict[str, str]:
    """Each secret's value by the variable it is given as. Without a BlockReader (a plan outside a flow) Prefect
    blocks are left out: the flow's own plan checks them before anything is launched. field: the config section
    the secrets are named in, as an error names it."""
    values = {}
    for name, ref in secrets.items():
        if ref.env is not None:
            value = os.environ.get(ref.env)
            fix = f"export {ref.env} where trainpipe runs (the deployment's worker, for scheduled runs)"
        elif blocks is None:
            continue
        else:
            value = blocks(ref.prefect_secret or "")
            fix = f"create it (prefect block create secret, or Secret(value=...).save('{ref.prefect_secret}'))"
        if value is None:
            raise SecretMissing(f"{field}.{name}: {ref.describe()} is not set: {fix}")
        values[name] = value
    return values
