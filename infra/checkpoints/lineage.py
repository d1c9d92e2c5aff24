"""Where a committed checkpoint came from: recorded in its manifest (CheckpointManifest.lineage).

Plain data, written by the train task into a JSON file on each node and put by the syncer into every manifest it
commits; `trainpipe model lineage` follows `parent` (the init_from step URL) back to the root, and `ckpt verify`
checks that the parent still exists. Lives beside the manifest (not in infra.registry) so the commit protocol does
not import the registry, which imports it.
"""

from __future__ import annotations

from pydantic import Field

from infra.strict_model import StrictModel


class LineageSnapshot(StrictModel):
    url: str
    snapshot_digest: str | None = None


class LineageCluster(StrictModel):
    provider: str
    instance_type: str | None = None
    nodes: int = Field(ge=1)
    network_gbps: float | None = None


class LineageEnvironment(StrictModel):
    """The training environment the checkpoint was trained in."""

    kind: str  # host, container, pyxis, oci
    image: str | None = None  # training.image as the job named it
    digest: str | None = None  # what the nodes pulled (repo@sha256:..., or a local image's id)
    python: str | None = None  # the interpreter (training.python, the node's own, the image's python3)
    torch: str | None = None  # its torch version, as verify found it


class Lineage(StrictModel):
    run_id: str
    attempt: str
    dataset: LineageSnapshot
    inputs: dict[str, LineageSnapshot] = Field(default_factory=dict)
    code_sha256: str | None = None
    config_hash: str
    parent: str | None = None  # the init_from checkpoint's step URL; None: trained from scratch
    cluster: LineageCluster
    environment: LineageEnvironment | None = None  # None: a manifest from before it was recorded
