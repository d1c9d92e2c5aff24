"""What every provider's own section of `cluster:` (cluster.ssh, cluster.azure, ...) answers, whatever the provider:
the job spec asks these of the section of the provider the job names, and never looks a provider up by name."""

from __future__ import annotations

from infra.strict_model import StrictModel


class ProviderSection(StrictModel):
    def check_fits(self, nodes: int) -> None:
        """Raise ValueError when the section cannot give the cluster its `nodes` nodes (a list of hosts too short);
        a section that names no machines fits any number."""

    def plan_warnings(self) -> tuple[str, ...]:
        """What the plan warns of before a cluster is paid for (a guarantee this section's settings weaken)."""
        return ()
