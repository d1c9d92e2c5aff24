"""What the catalog holds about one instance type, and where each figure came from."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

NetworkKind = Literal["efa", "infiniband", "gpudirect-tcpx", "gpudirect-tcpxo", "ethernet"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RegionOffer(_Frozen):
    """Prices in one region (USD per node-hour). None means unknown or not sold there (e.g. no spot market)."""

    on_demand: float | None = Field(None, gt=0)
    spot: float | None = Field(None, gt=0)
    zones: tuple[str, ...] = ()  # where the type is offered; empty lets the provider choose
    source: str  # where the prices came from; "estimate: …" when they are not from a price list


class InstanceType(_Frozen):
    provider: str
    name: str
    accelerator: str | None  # GPU or accelerator model, e.g. "H100"; None for CPU-only types
    gpus: int = Field(ge=0)
    gpu_memory_gb: float = Field(ge=0)  # per GPU
    vcpus: int = Field(ge=1)
    memory_gb: float = Field(gt=0)
    network_gbps: float = Field(gt=0)  # aggregate between nodes
    network_kind: NetworkKind
    efa_interfaces: int = Field(0, ge=0)  # EFA-capable network cards to attach (AWS)
    local_nvme_bytes: int = Field(0, ge=0)
    local_nvme_count: int = Field(0, ge=0)
    regions: dict[str, RegionOffer]
    source: str  # where the hardware figures (GPUs, CPUs, memory, network, disks) came from

    @property
    def key(self) -> str:
        return f"{self.provider}/{self.name}"

    def describe(self) -> str:
        gpus = f"{self.gpus}×{self.accelerator} {self.gpu_memory_gb:g}GB" if self.gpus else "no GPU"
        nvme = f"{self.local_nvme_count}×{self.local_nvme_bytes / self.local_nvme_count / 1e9:.0f}GB NVMe" \
            if self.local_nvme_count else "no local NVMe"
        return f"{self.name} ({gpus}, {self.network_gbps:g} Gbps {self.network_kind}, {nvme})"


class CatalogFile(_Frozen):
    """The JSON document: shipped in the package, or written by `trainpipe catalog refresh`."""

    version: int = 1
    generated_at: str
    instances: tuple[InstanceType, ...]
