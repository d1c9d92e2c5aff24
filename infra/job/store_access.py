"""Can a cloud job's nodes reach its stores? They read the dataset, fetch the code and write checkpoints with their
own credentials, never the orchestrator's: plan checks those with the orchestrator's keys, so a job whose nodes have
none would pass plan and fail at staging, after launch and bootstrap were paid for. Refused here instead.

An az:// store is no cloud's own here: nodes reach it with the Azure variables the job hands them as secrets
(training.secrets, which every node command that reads or writes a store gets in its environment). The account
itself may be named by the config instead (storage.azure_account): then a key or a service principal is enough.
"""

from __future__ import annotations

from collections.abc import Mapping

from infra.dataset.spec import InputSpec
from infra.job.spec import JobSpec
from infra.storage.azure_account import CREDENTIAL_SETS, account_conflict

# With the account named by storage.azure_account, what reaches it without an identity of the node's own.
ACCOUNT_CREDENTIAL_SETS = (("AZURE_STORAGE_CONNECTION_STRING",), ("AZURE_STORAGE_KEY",),
                           ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET"))
ENVIRONMENT_ACCOUNT = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT")

# The store each cloud's nodes get credentials for, and the section field that gives them.
NATIVE_STORE = {"aws": "s3", "gcp": "gs", "nebius": "s3", "azure": "az"}
# Nebius Object Storage is S3 with keys of a service account: its nodes have no instance credentials for it, so the
# job forwards what the S3 engine reads (the keys, and the endpoint and region it is reached at) as secrets.
NEBIUS_STORE_SECRETS = (("AWS_ACCESS_KEY_ID",), ("AWS_SECRET_ACCESS_KEY",), ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"),
                        ("AWS_REGION", "AWS_DEFAULT_REGION"))


def job_stores(job: JobSpec) -> list[tuple[str, str]]:
    """(field, URL) of every store the nodes themselves read or write."""
    stores = [("dataset.url", job.dataset.url), ("checkpoints.url", job.checkpoints.url)]
    code = job.training.code
    if code is not None and "://" in code:
        stores.append(("training.code", code))
    return stores


def _credentials_problem(job: JobSpec) -> str | None:
    """Why the cloud's nodes have no credentials for the cloud's own store, or None when they have."""
    if job.cluster.provider == "aws" and job.cluster.aws.instance_profile is None:
        return ("the aws nodes have no AWS credentials: set cluster.aws.instance_profile to an instance profile "
                "whose role may read and write it")
    if job.cluster.provider == "nebius":
        missing = [names[0] for names in NEBIUS_STORE_SECRETS if not set(names) & set(job.training.secrets)]
        if missing:
            return (f"the nebius nodes reach Nebius Object Storage with the S3 keys and endpoint the job forwards: add "
                    f"{', '.join(missing)} to training.secrets (e.g. AWS_ENDPOINT_URL: {{env: AWS_ENDPOINT_URL}} with "
                    "AWS_ENDPOINT_URL=https://storage.eu-north1.nebius.cloud and AWS_REGION=eu-north1)")
        return None
    account = job.cluster.gcp.service_account
    if job.cluster.provider == "gcp" and not account.reaches_storage():
        return ("the gcp nodes' service account has no storage scope: add cloud-platform or devstorage.read_write "
                "to cluster.gcp.service_account.scopes")
    if job.cluster.provider == "azure" and job.cluster.azure.identity is None:
        # A system-assigned identity is born with its VM: no role on the storage account can have been granted to it.
        return ("the azure nodes have no identity the storage account knows: set cluster.azure.identity to a "
                "user-assigned managed identity with Storage Blob Data Contributor on it")
    return None


def store_access_problem(job: JobSpec) -> str | None:
    """One line naming the first store the nodes could not reach and the fix, or None."""
    native = NATIVE_STORE.get(job.cluster.provider)
    if native is None:
        return None  # local, ssh and netns nodes use the credentials of their own machines
    for field, url in job_stores(job):
        scheme = url.split("://", 1)[0]
        if scheme == native:
            problem = _credentials_problem(job)
            if problem is not None:
                return f"{field} {url}: {problem}"
        elif scheme == "az":  # no cloud's own but Azure's: other clouds' nodes get its keys as secrets
            if _azure_credentials_given(job):
                continue
            wanted = ("AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY"
                      if job.storage.azure is None else
                      f"AZURE_STORAGE_KEY of storage.azure_account {job.storage.azure.name}, or a service "
                      "principal's AZURE_CLIENT_ID, AZURE_TENANT_ID and AZURE_CLIENT_SECRET")
            return (f"{field} {url}: {job.cluster.provider} nodes have no Azure credentials: hand them over as "
                    f"training.secrets ({wanted})")
        elif scheme in NATIVE_STORE.values():
            return (f"{field} {url}: {job.cluster.provider} nodes have no credentials for {scheme}:// stores: use "
                    f"a {native}:// store (or run the job on {_cloud_of(scheme)})")
    return None


def _azure_credentials_given(job: JobSpec) -> bool:
    given = job.training.secrets.keys()
    sets = CREDENTIAL_SETS if job.storage.azure is None else ACCOUNT_CREDENTIAL_SETS
    return any(all(name in given for name in names) for names in sets)


def _azure_stores(job: JobSpec) -> list[tuple[str, str]]:
    """(field, URL) of every az:// store the run reaches, the orchestrator's (inputs, init_from) among them."""
    stores = [*job_stores(job), ("training.init_from", job.training.init_from or "")]
    stores += [(f"inputs.{name}.url", entry.url) for name, entry in job.inputs.items() if isinstance(entry, InputSpec)]
    return [(field, url) for field, url in stores if url.startswith("az://")]


def azure_account_problem(job: JobSpec, environ: Mapping[str, str], secret_values: Mapping[str, str]) -> str | None:
    """One line when the run has az:// stores but no account to reach them by (neither storage.azure_account nor
    the orchestrator's environment names one), or a connection string, in the environment or among the job's
    secrets, for another account than the config's; None otherwise."""
    stores = _azure_stores(job)
    if not stores:
        return None
    field, url = stores[0]
    account = job.storage.azure
    if account is None and not any(environ.get(name) for name in ENVIRONMENT_ACCOUNT):
        return (f"{field} {url}: no Azure storage account: name it in storage.azure_account, or set "
                f"{' or '.join(ENVIRONMENT_ACCOUNT)} where trainpipe runs")
    for where, values in (("the environment", environ), ("training.secrets", secret_values)):
        if (problem := account_conflict(account, values)) is not None:
            return f"{field} {url}: {problem} (in {where})"
    return None


def _cloud_of(scheme: str) -> str:
    return next(cloud for cloud, native in NATIVE_STORE.items() if native == scheme)
