"""Every provider in one table: its name, the class that implements it and what the job spec needs to know of it.

Adding a provider is one row here (and its package). The cluster spec (infra.compute.spec) and the job spec read the
names and the chaos column from this table, and a provider with its own config section has a ClusterSpec field named
after it (`cluster.ssh:`, `cluster.netns:`) whose model lives in the provider's package; a section with a
`check_fits(nodes)` method is asked whether it can hold the cluster. The table names each class as text, imported on
first use (infra.compute.providers.get_provider): aws pulls in boto3, gcp google-cloud-compute, and most commands
need neither. It imports nothing itself, so the specs read it without loading any provider.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProviderEntry:
    name: str
    implementation: str  # "module:Class"
    chaos: bool  # the chaos injector can take its nodes away (tests only; a cloud takes nodes away by itself)


PROVIDERS = (
    ProviderEntry("local", "infra.compute.providers.local:LocalProvider", chaos=True),
    ProviderEntry("aws", "infra.compute.providers.aws.provider:AwsProvider", chaos=False),
    ProviderEntry("gcp", "infra.compute.providers.gcp.provider:GcpProvider", chaos=False),
    ProviderEntry("ssh", "infra.compute.providers.ssh.provider:SshProvider", chaos=True),
    ProviderEntry("netns", "infra.compute.providers.netns.provider:NetnsProvider", chaos=True),
    ProviderEntry("slurm", "infra.compute.providers.slurm.provider:SlurmProvider", chaos=False),
    ProviderEntry("nebius", "infra.compute.providers.nebius.provider:NebiusProvider", chaos=False),
    ProviderEntry("azure", "infra.compute.providers.azure.provider:AzureProvider", chaos=False),
)
PROVIDER_NAMES = tuple(entry.name for entry in PROVIDERS)
CHAOS_PROVIDERS = tuple(entry.name for entry in PROVIDERS if entry.chaos)


def provider_entry(name: str) -> ProviderEntry | None:
    return next((entry for entry in PROVIDERS if entry.name == name), None)
