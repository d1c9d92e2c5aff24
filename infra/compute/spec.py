"""The cluster a job runs on: how many nodes of what, where and at what price, and what is measured once it is up.

The `cluster:` section of the job spec (infra.job.spec composes it), and what every provider's launch() reads. A
provider's own section (cluster.ssh, cluster.netns, cluster.aws, cluster.gcp) is defined, and checked against the
cluster, in that provider's package; the names and what each supports come from the provider table.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from infra.compute.providers.aws.config import AwsClusterSpec
from infra.compute.providers.azure.config import AzureClusterSpec
from infra.compute.providers.gcp.config import GcpClusterSpec
from infra.compute.providers.nebius.config import NebiusClusterSpec
from infra.compute.providers.netns.config import NetnsClusterSpec
from infra.compute.providers.section import ProviderSection
from infra.compute.providers.slurm.config import SlurmClusterSpec
from infra.compute.providers.ssh.config import SshClusterSpec
from infra.compute.providers.table import PROVIDER_NAMES
from infra.strict_model import StrictModel, one_of

SpotPolicy = Literal["never", "prefer", "only"]


class VerifySpec(StrictModel):
    """The verify stage's cluster bench: does the cluster deliver the network and disk the job pays for."""

    bench: Literal["off", "warn", "fail"] = Field(
        "warn", description="off: skip the bench; warn: log figures below expectation and train anyway; fail: stop "
        "the run before training when a figure is below expectation.")
    min_fraction: float = Field(0.8, gt=0, le=1, description="A measured figure below this fraction of what is "
                                "expected (the job's floors, the catalog's figures) misses.")
    tcp_streams: int = Field(4, ge=1, le=64, description="Parallel TCP streams per node-to-node link.")
    tcp_seconds: float = Field(3.0, gt=0, le=60, description="How long each node-to-node TCP test sends.")
    allreduce_sizes_mb: tuple[int, ...] = Field(
        (1, 16, 64), min_length=1, description="All-reduce message sizes in MB; the largest gives the bus bandwidth "
        "that is compared.")
    disk_bytes_mb: int = Field(256, ge=1, description="Size of the file each node writes and reads back with direct "
                               "I/O on its data dir, in MB.")
    measure: Literal["needed", "all"] = Field(
        "needed", description="needed: only the figures something holds the cluster to (a floor, the catalog's "
        "figure for the instance type), so a run pays no seconds for figures reported only; all: every figure.")

    @field_validator("bench", mode="before")
    @classmethod
    def _bench_from_yaml_bool(cls, value: object) -> object:
        # YAML 1.1 reads a bare off/no/false as False (and on/yes/true as True) before we see the word.
        if value is False:
            return "off"
        if value is True:
            raise ValueError("bench: on/yes/true reads as a boolean and names no mode: use warn or fail "
                             "(off, no or false turn the bench off)")
        return value

    @field_validator("allreduce_sizes_mb")
    @classmethod
    def _positive_sizes(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(size < 1 for size in value):
            raise ValueError(f"allreduce_sizes_mb {list(value)}: every size must be at least 1 MB")
        return value


class ClusterSpec(StrictModel):
    provider: str = Field("local", description=f"Where nodes run: one of {', '.join(PROVIDER_NAMES)}.")
    nodes: int = Field(2, ge=1, le=1024, description="Number of nodes (machines).")
    procs_per_node: int = Field(1, ge=1, le=64, description="Training processes per node (one per GPU).")
    accelerator: str | None = Field(None, description="GPU type each process needs (e.g. H100); none trains on CPU.")
    min_network_gbps: float = Field(0.0, ge=0, description="Floor on the inter-node network bandwidth, in Gbit/s.")
    local_nvme: bool = Field(False, description="Require node-local NVMe for data and checkpoints.")
    instance_type: str | None = Field(None, description="Pin one instance type (e.g. p5.48xlarge); none lets the "
                                      "optimizer pick the cheapest that meets the floors.")
    spot: SpotPolicy = Field("never", description="never: on-demand only; prefer: spot first, on-demand when no spot "
                             "launches; only: spot or nothing. (true/false mean prefer/never.)")
    regions: tuple[str, ...] = Field((), description="Regions to consider, in order of preference; empty = any.")
    zones: tuple[str, ...] = Field((), description="Zones to consider (e.g. us-east-1a); empty = any in the regions.")
    max_price_per_hour: float | None = Field(None, gt=0, description="Price cap for the whole cluster, USD/hour.")
    lease_ttl_s: float = Field(120.0, ge=10, description="Nodes tear themselves down after this long without "
                               "hearing from the orchestrator (bounds how long a cluster outlives a dead run).")
    ssh: SshClusterSpec = Field(default_factory=SshClusterSpec, description="provider ssh: the machines to use and "
                                "how to reach them.")
    verify: VerifySpec = Field(default_factory=VerifySpec, description="After provisioning: measure node-to-node "
                               "network, all-reduce and local disk throughput against the floors and the catalog.")
    netns: NetnsClusterSpec = Field(default_factory=NetnsClusterSpec, description="provider netns: how its emulated "
                                    "links are shaped.")
    aws: AwsClusterSpec = Field(default_factory=AwsClusterSpec, description="provider aws: the instance profile "
                                "the nodes reach their stores with.")
    gcp: GcpClusterSpec = Field(default_factory=GcpClusterSpec, description="provider gcp: the service account the "
                                "nodes reach their stores with.")
    slurm: SlurmClusterSpec = Field(default_factory=SlurmClusterSpec, description="provider slurm: the allocation "
                                    "to ask the site's Slurm for, and where on a node to work.")
    nebius: NebiusClusterSpec = Field(default_factory=NebiusClusterSpec, description="provider nebius: the "
                                      "InfiniBand fabric, subnet, disks and filesystem of the nodes.")
    azure: AzureClusterSpec = Field(default_factory=AzureClusterSpec, description="provider azure: the managed "
                                    "identity the nodes reach their stores with, and the image they boot.")

    @field_validator("provider")
    @classmethod
    def _known_provider(cls, value: str) -> str:
        return one_of(value, PROVIDER_NAMES, "unknown provider")

    @field_validator("spot", mode="before")
    @classmethod
    def _spot_from_bool(cls, value: object) -> object:
        # Configs written before the three-way policy said `spot: true/false`.
        return {True: "prefer", False: "never"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _provider_section_fits(self) -> ClusterSpec:
        self.provider_section().check_fits(self.nodes)
        return self

    def provider_section(self) -> ProviderSection:
        """The job's provider's own section: the field named after it (infra.compute.providers.table); a provider
        without one (local) has an empty section, which fits any cluster and warns of nothing."""
        section = getattr(self, self.provider, None)
        return section if isinstance(section, ProviderSection) else ProviderSection()

    def plan_warnings(self) -> tuple[str, ...]:
        """What the provider's own section says the plan should warn of (most say nothing)."""
        return self.provider_section().plan_warnings()
