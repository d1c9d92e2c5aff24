"""A checkpoint's ancestry: its manifest's lineage names its parent (the init_from step URL), whose manifest names
its own, back to a checkpoint trained from scratch (the root)."""

from __future__ import annotations

from dataclasses import dataclass

from infra.checkpoints.layout import CheckpointManifest, EvalRecord
from infra.checkpoints.store import CheckpointStore
from infra.registry.refs import CheckpointTarget, RegistryError
from infra.registry.registry import resolve_checkpoint
from infra.storage import open_store


@dataclass(frozen=True)
class Link:
    target: CheckpointTarget
    manifest: CheckpointManifest
    eval: EvalRecord | None


def link(target: CheckpointTarget) -> Link:
    checkpoints = CheckpointStore(open_store(target.run_url))
    return Link(target, checkpoints.manifest(target.step), checkpoints.eval(target.step))


def lineage_chain(ref: str, root_url: str) -> list[Link]:
    """ref's checkpoint and its ancestors, root first. RegistryError naming an ancestor that no longer exists (or is
    no longer committed): the chain is broken there."""
    chain = [link(resolve_checkpoint(ref, root_url))]
    while (lineage := chain[-1].manifest.lineage) is not None and lineage.parent is not None:
        if any(known.target.url == lineage.parent for known in chain):
            raise RegistryError(f"{chain[-1].target.url}: its lineage loops back to {lineage.parent}: the manifests "
                                "were edited by hand; fix the parent")
        try:
            parent = resolve_checkpoint(lineage.parent, root_url)
        except RegistryError as exc:
            raise RegistryError(f"{chain[-1].target.url}: its parent {lineage.parent} is gone ({exc}): the lineage "
                                "is broken there (deleted by hand, or by a retention that did not know the alias)"
                                ) from None
        chain.append(link(parent))
    return chain[::-1]
