"""Which Azure storage account az:// stores reach, and with which credentials: the job config's account
(storage.azure_account, use_job_account), else the standard environment.

    AZURE_STORAGE_CONNECTION_STRING                      the account, its endpoint and a key or SAS (Azurite's too)
    AZURE_STORAGE_ACCOUNT + AZURE_STORAGE_KEY            the account and its key
    AZURE_STORAGE_ACCOUNT alone                          an identity: DefaultAzureCredential (a VM's managed
                                                         identity, a service principal's AZURE_CLIENT_* variables,
                                                         the az CLI's login)
    AZURE_STORAGE_BLOB_ENDPOINT                          with an account: its blob endpoint where it is not
                                                         https://<account>.blob.core.windows.net (a sovereign cloud)

The config's account wins over AZURE_STORAGE_ACCOUNT: it is laid over the environment as those same variables
(job_account_environment), on the orchestrator and in every node command's environment, so both reach one account
the same way; a connection string for another account is refused (account_conflict), never silently preferred.

One client per environment and read timeout is shared by every store in the process; its connection pool is as wide
as the engine's widest pool. The SDK is imported when the first client is made: plan reads CREDENTIAL_SETS from here
without paying for it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from infra.storage.base import StorageError

if TYPE_CHECKING:
    import requests
    from azure.storage.blob import BlobServiceClient

ENVIRONMENT = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY",
               "AZURE_STORAGE_BLOB_ENDPOINT")
NO_ACCOUNT = ("set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY or an identity "
              "(a managed identity, AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, or `az login`), or name the "
              "account in the job config's storage.azure_account")
# The variables that reach an account without an identity of the machine's own: any one set is enough.
CREDENTIAL_SETS = (("AZURE_STORAGE_CONNECTION_STRING",), ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY"),
                   ("AZURE_STORAGE_ACCOUNT", "AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET"))
# Azurite's shorthand connection string names its one built-in account.
DEVELOPMENT_ACCOUNT = "devstoreaccount1"
MAX_POOL_CONNECTIONS = 128  # connections are opened only when used, so a large pool costs nothing
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class JobAccount:
    """The storage account a job's config names (storage.azure_account), and its blob endpoint where it is not the
    public cloud's."""

    name: str
    blob_endpoint: str | None = None


_job_account: JobAccount | None = None


def use_job_account(account: JobAccount | None) -> None:
    """Make account the one this process's az:// stores reach (None: the environment's). Set by plan, which every
    run and `trainpipe plan` go through before any store is opened, so the orchestrator's stores follow the config
    the run was planned with."""
    global _job_account
    _job_account = account


def connection_string_account(connection_string: str) -> str:
    """The account a connection string is for (AccountName=..., or Azurite's UseDevelopmentStorage=true)."""
    fields = dict(part.split("=", 1) for part in connection_string.split(";") if "=" in part)
    if fields.get("UseDevelopmentStorage", "").lower() == "true":
        return DEVELOPMENT_ACCOUNT
    return fields.get("AccountName", "")


def account_conflict(account: JobAccount | None, environ: Mapping[str, str]) -> str | None:
    """Why the environment's connection string cannot be used with the config's account, or None."""
    connection_string = environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if account is None or not connection_string:
        return None
    other = connection_string_account(connection_string)
    if other == account.name:
        return None
    return (f"storage.azure_account is {account.name} but AZURE_STORAGE_CONNECTION_STRING is for account "
            f"{other or '(none named)'}: unset AZURE_STORAGE_CONNECTION_STRING (give {account.name}'s key as "
            f"AZURE_STORAGE_KEY, or use an identity) or name {other or 'its account'} in storage.azure_account")


def job_account_environment(account: JobAccount | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that make account the one reached, laid over environ (empty without one). The endpoint is
    always given: the environment's AZURE_STORAGE_BLOB_ENDPOINT is kept only when it is for that same account."""
    if account is None:
        return {}
    endpoint = account.blob_endpoint
    if endpoint is None and environ.get("AZURE_STORAGE_ACCOUNT") == account.name:
        endpoint = environ.get("AZURE_STORAGE_BLOB_ENDPOINT")
    return {"AZURE_STORAGE_ACCOUNT": account.name,
            "AZURE_STORAGE_BLOB_ENDPOINT": endpoint or f"https://{account.name}.blob.core.windows.net"}


def _environment() -> dict[str, str]:
    """The Azure variables as they apply in this process: the environment's, with the job's account over them."""
    environ = {name: os.environ[name] for name in ENVIRONMENT if name in os.environ}
    if (problem := account_conflict(_job_account, environ)) is not None:
        raise StorageError(problem)
    return {**environ, **job_account_environment(_job_account, environ)}


_clients: dict[tuple[object, ...], BlobServiceClient] = {}
_clients_lock = threading.Lock()


def _session() -> requests.Session:
    import requests.adapters

    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=MAX_POOL_CONNECTIONS)
    for scheme in ("http://", "https://"):
        session.mount(scheme, adapter)
    return session


def _options(read_timeout_s: float) -> dict[str, Any]:
    # One attempt per call (the engine retries); no byte for read_timeout_s is a stall.
    return {"retry_total": 0, "connection_timeout": min(CONNECT_TIMEOUT_S, read_timeout_s),
            "read_timeout": read_timeout_s, "session": _session(), "session_owner": False}


def _new_client(environ: Mapping[str, str], read_timeout_s: float) -> BlobServiceClient:
    from azure.storage.blob import BlobServiceClient

    options = _options(read_timeout_s)
    connection_string = environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if connection_string:
        return BlobServiceClient.from_connection_string(connection_string, **options)
    account = environ.get("AZURE_STORAGE_ACCOUNT")
    if not account:
        raise StorageError(f"no Azure storage account: {NO_ACCOUNT}")
    endpoint = environ.get("AZURE_STORAGE_BLOB_ENDPOINT") or f"https://{account}.blob.core.windows.net"
    key = environ.get("AZURE_STORAGE_KEY")
    if key:
        return BlobServiceClient(endpoint, credential={"account_name": account, "account_key": key}, **options)
    from azure.identity import DefaultAzureCredential  # only where an identity is what reaches the account

    return BlobServiceClient(endpoint, credential=DefaultAzureCredential(), **options)


def service_client(read_timeout_s: float) -> BlobServiceClient:
    """The account's client for this environment, job account and read timeout (made once per process)."""
    environ = _environment()
    cache_key = (*(environ.get(name) for name in ENVIRONMENT), read_timeout_s)
    with _clients_lock:
        client = _clients.get(cache_key)
        if client is None:
            client = _clients[cache_key] = _new_client(environ, read_timeout_s)
        return client
