"""Azurite, the real Azure Storage emulator (npm `azurite`, installed by scripts/install-azure-tools into
.cache/azurite), serving Blob Storage on a free loopback port; and AzCopy (npm `@azure-tools/azcopy-linux`), the peer
client the benchmark measures the az:// store against.

Plain Python (no pytest), so the benchmark starts the very same server the tests use.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from servers import _serving, free_port

REPO = Path(__file__).resolve().parent.parent
AZURITE_BLOB = REPO / ".cache" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
AZCOPY = REPO / ".cache" / "azcopy" / "node_modules" / "@azure-tools" / "azcopy-linux" / "dist" / "bin" / (
    "azcopy_linux_amd64")
SAS_HOURS = 12
# Azurite's one built-in account (the same in every installation, documented by Microsoft).
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@dataclass(frozen=True)
class AzuriteServer:
    endpoint: str  # the account's blob endpoint: http://127.0.0.1:<port>/devstoreaccount1

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
                f"BlobEndpoint={self.endpoint};")

    def env(self) -> dict[str, str]:
        """What an az:// store needs in its environment to reach this server."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def container_sas_url(self, container: str, prefix: str = "") -> str:
        """The URL of container/prefix with a SAS token in it: how AzCopy is given an account it may write."""
        from azure.storage.blob import ContainerSasPermissions, generate_container_sas

        permissions = ContainerSasPermissions(read=True, add=True, create=True, write=True, delete=True, list=True)
        expiry = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=SAS_HOURS)
        token = generate_container_sas(ACCOUNT, container, account_key=ACCOUNT_KEY, permission=permissions,
                                       expiry=expiry)
        return f"{self.endpoint}/{container}/{prefix}?{token}"

    def make_container(self, name: str) -> str:
        from azure.storage.blob import BlobServiceClient

        BlobServiceClient.from_connection_string(self.connection_string).create_container(name)
        return f"az://{name}"


@contextmanager
def azurite(location: Path) -> Iterator[AzuriteServer]:
    """azurite-blob over location; --loose and --skipApiVersionCheck so the SDK's newer API versions and headers
    Azurite does not know yet are accepted rather than refused."""
    if not AZURITE_BLOB.exists():
        raise RuntimeError(f"{AZURITE_BLOB} is missing: run scripts/install-azure-tools (make test does)")
    location.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [str(AZURITE_BLOB), "--silent", "--loose", "--skipApiVersionCheck", "--location", str(location),
            "--blobHost", "127.0.0.1", "--blobPort", str(port)]
    with _serving(argv, port, location.parent / f"azurite-{port}.log"):
        yield AzuriteServer(f"http://127.0.0.1:{port}/{ACCOUNT}")
