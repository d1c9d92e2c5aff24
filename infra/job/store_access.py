"""Can a cloud job's nodes reach its stores? They read the dataset, fetch the code and write checkpoints with their
own credentials, never the orchestrator's: plan checks those with the orchestrator's keys, so a job whose nodes have
none would pass plan and fail at staging, after launch and bootstrap were paid for. Refused here instead.
"""

from __future__ import annotations

from infra.job.spec import JobSpec

# The store each cloud's nodes get credentials for, and the section field that gives them.
NATIVE_STORE = {"aws": "s3", "gcp": "gs", "azure": "az"}


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
        elif scheme in NATIVE_STORE.values():
            return (f"{field} {url}: {job.cluster.provider} nodes have no credentials for {scheme}:// stores: use "
                    f"a {native}:// store (or run the job on {_cloud_of(scheme)})")
    return None


def _cloud_of(scheme: str) -> str:
    return next(cloud for cloud, native in NATIVE_STORE.items() if native == scheme)
