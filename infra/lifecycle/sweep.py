"""The orphan sweeper: tear down clusters whose run is gone, on every provider. Used by `trainpipe sweep` and the
sweep-orphans flow alike, so a scheduled sweep and a hand-typed one decide the same way."""

from __future__ import annotations

from collections.abc import Callable

from infra.compute.providers import ClusterRecord, Provider, all_providers


def sweep_clusters(include_alive: bool = False, dry_run: bool = False,
                   on_cluster: Callable[[ClusterRecord], None] | None = None,
                   providers: list[Provider] | None = None) -> list[ClusterRecord]:
    """Clusters torn down (or, with dry_run, that would be); on_cluster hears of each before it is touched.
    providers: where to look (default: every provider)."""
    swept = []
    for provider in all_providers() if providers is None else providers:
        for record in provider.list_clusters():
            if record.owner_alive and not include_alive:
                continue
            if on_cluster is not None:
                on_cluster(record)
            if not dry_run:
                provider.terminate(record.name)  # the one that listed it: the same cloud, account and endpoint
            swept.append(record)
    return swept
