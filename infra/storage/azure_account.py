"""Which Azure storage account az:// stores reach, and with which credentials: the standard environment.

    AZURE_STORAGE_CONNECTION_STRING                      the account, its endpoint and a key or SAS (Azurite's too)
    AZURE_STORAGE_ACCOUNT + AZURE_STORAGE_KEY            the account and its key
    AZURE_STORAGE_ACCOUNT alone                          an identity: DefaultAzureCredential (a VM's managed
                                                         identity, a service principal's AZURE_CLIENT_* variables,
                                                         the az CLI's login)
    AZURE_STORAGE_BLOB_ENDPOINT                          with an account: its blob endpoint where it is not
                                                         https://<account>.blob.core.windows.net (a sovereign cloud)

One client per environment and read timeout is shared by every store in the process; its connection pool is as wide
as the engine's widest pool. The SDK is imported when the first client is made: plan reads CREDENTIAL_SETS from here
without paying for it.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from infra.storage.base import StorageError

if TYPE_CHECKING:
    import requests
    from azure.storage.blob import BlobServiceClient

ENVIRONMENT = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY",
               "AZURE_STORAGE_BLOB_ENDPOINT")
NO_ACCOUNT = ("set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY or an identity "
              "(a managed identity, AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, or `az login`)")
# The variables that reach an account without an identity of the machine's own: any one set is enough.
CREDENTIAL_SETS = (("AZURE_STORAGE_CONNECTION_STRING",), ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY"),
                   ("AZURE_STORAGE_ACCOUNT", "AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET"))
MAX_POOL_CONNECTIONS = 128  # connections are opened only when used, so a large pool costs nothing
CONNECT_TIMEOUT_S = 10.0

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


def _new_client(read_timeout_s: float) -> BlobServiceClient:
    from azure.storage.blob import BlobServiceClient

    options = _options(read_timeout_s)
    connection_string = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if connection_string:
        return BlobServiceClient.from_connection_string(connection_string, **options)
    account = os.environ.get("AZURE_STORAGE_ACCOUNT")
    if not account:
        raise StorageError(f"no Azure storage account: {NO_ACCOUNT}")
    endpoint = os.environ.get("AZURE_STORAGE_BLOB_ENDPOINT") or f"https://{account}.blob.core.windows.net"
    key = os.environ.get("AZURE_STORAGE_KEY")
    if key:
        return BlobServiceClient(endpoint, credential={"account_name": account, "account_key": key}, **options)
    from azure.identity import DefaultAzureCredential  # only where an identity is what reaches the account

    return BlobServiceClient(endpoint, credential=DefaultAzureCredential(), **options)


def service_client(read_timeout_s: float) -> BlobServiceClient:
    """The account's client for this environment and read timeout (made once per process)."""
    cache_key = (*(os.environ.get(name) for name in ENVIRONMENT), read_timeout_s)
    with _clients_lock:
        client = _clients.get(cache_key)
        if client is None:
            client = _clients[cache_key] = _new_client(read_timeout_s)
        return client
