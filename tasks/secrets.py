"""The job's secrets resolved for a node command: infra.job.secrets with Prefect Secret blocks read from the server.

The one place a run turns secret names into values (the train and setup tasks, through workload_env); the values go
straight into the command's environment and are kept nowhere else.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from infra.job.secrets import SecretRef, resolve_secrets
from infra.job.spec import JobSpec, StorageSpec
from infra.storage.azure_account import job_account_environment


def read_secret_block(name: str) -> str | None:
    """A Prefect Secret block's value, None when the server has no Secret block of that name."""
    from prefect.blocks.system import Secret
    from prefect.exceptions import ObjectNotFound

    try:
        block = Secret.load(name)
    except ValueError as exc:
        if isinstance(exc.__cause__, ObjectNotFound):
            return None
        raise
    value = block.get()
    return value if isinstance(value, str) else json.dumps(value)


def job_secrets(job: JobSpec) -> dict[str, str]:
    """Every secret the job names, by the variable it is given as, and the storage accounts its config names;
    SecretMissing names the first secret that is not set."""
    return secrets_env(job.training.secrets, job.storage)


def secrets_env(secrets: Mapping[str, SecretRef] | None, storage: StorageSpec | None = None) -> dict[str, str]:
    """The job's secrets (training.secrets: names, never values) resolved for a node command that reads a store
    (stage, restore, code, verify-ckpt): a store credential given as a secret reaches a node that has none of its own.
    Tasks take the names as a parameter (recorded by Prefect) and resolve them here, as the command starts.
    storage: the job's storage section: the account it names (not a secret) is laid over the secrets', as the
    variables the node's stores read, so the nodes reach the account the orchestrator does."""
    account = storage.azure if storage is not None else None
    return {**resolve_secrets(secrets or {}, read_secret_block), **job_account_environment(account, os.environ)}
