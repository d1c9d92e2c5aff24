"""Stage: every node pulls the dataset and the inputs (and, when resuming, the latest committed checkpoint) to its own
disk."""

from __future__ import annotations

import re
from collections.abc import Callable

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from infra.compute.providers import Cluster, Node, agent_for
from infra.dataset.stagecache import node_cache_dir
from infra.job.secrets import SecretRef
from infra.job.spec import StorageSpec
from infra.node.events import Event, NodeEvent, parse
from infra.node.fanout import SHARE_DIR
from infra.node.protocol import PeerExchange, RestoreRequest, StageRequest
from infra.node.replica import REPLICA_DIR
from infra.workload.contract import INPUTS_DIR
from tasks.node_output import last_event, node_line_sink
from tasks.policy import TRANSIENT_RETRIES
from tasks.results import Restored, Staged, StagedNode
from tasks.secrets import secrets_env


def _progress_artifact(node: Node, what: str) -> Callable[[Event], None]:
    """A Prefect progress artifact for one node's transfer, moved along by its `progress` events."""
    # Artifact keys allow only lowercase letters, digits and dashes.
    key = re.sub(r"[^a-z0-9-]+", "-", f"{what}-{node.name}".lower())
    artifact_id = create_progress_artifact(0.0, key=key, description=f"{node.name}: {what} starting")

    def on_event(event: Event) -> None:
        if event.kind in (NodeEvent.STAGED, NodeEvent.INPUT_STAGED):  # done, even when everything was already there
            part = event.get("name", "dataset")
            update_progress_artifact(artifact_id, 100.0, description=(
                f"{node.name}: {what} {part} done: {event['files']} files, {event['bytes'] / 1e6:,.0f} MB at "
                f"{event['mb_per_s']} MB/s; {event['skipped_files']} files already there"))
            return
        if event.kind is not NodeEvent.PROGRESS:
            return
        total = event["bytes_total"] or 1
        part = event.get("what", "")
        update_progress_artifact(
            artifact_id,
            min(100.0, 100.0 * event["bytes_done"] / total),
            description=(f"{node.name}: {what} {part} {event['bytes_done'] / 1e6:,.0f} of "
                         f"{event['bytes_total'] / 1e6:,.0f} MB"
                         f", {event['files_done']}/{event['files_total']} files, {event['mb_per_s']} MB/s, "
                         f"ETA {event['eta_s']} s"),
        )

    return on_event


@task(name="stage-data", **TRANSIENT_RETRIES)
def stage_node(cluster: Cluster, node: Node, snapshot_url: str | None, shard: str, inputs: dict[str, str],
               timeout_s: float = 3600, peers: list[str] | None = None,
               peer_env: dict[str, str] | None = None, holders: list[int] | None = None,
               secrets: dict[str, SecretRef] | None = None, storage: StorageSpec | None = None) -> StagedNode:
    """Mirror the node's files of the run's dataset snapshot into its data dir (<workdir>/data-files.txt lists them;
    snapshot_url None: the dataset is read from the store, not staged), and each input's snapshot (inputs: name ->
    snapshot URL) whole into <workdir>/inputs/<name>, through the node's one cache.

    Each `staged` (`input-staged`) event: files and node_bytes (what the node holds), bytes (fetched), skipped_files
    and skipped_bytes (reused from the node's cache or data dir), seconds and mb_per_s (of the fetch).

    peers (fan-out, tasks/fanout.py): every node's peer server URL by rank; peer_env their credentials; holders: the
    ranks that hold the files already (the survivors of a replace-one recovery): the others are filled from them.

    secrets: the job's training.secrets (names): resolved here, they reach the stager's environment (a store
    credential given as a secret); storage: the job's storage section (the account its stores reach)."""
    sink = node_line_sink(get_run_logger(), node.name, on_event=_progress_artifact(node, "stage"))
    request = StageRequest(
        rank=node.rank, nodes=len(cluster.nodes), workdir=node.workdir,
        cache=node_cache_dir(cluster.provider, node.workdir), run=cluster.run_id, shard=shard,
        snapshot=snapshot_url, dest=node.data_dir if snapshot_url is not None else None,
        inputs=inputs, inputs_dir=node.path(INPUTS_DIR) if inputs else None,
        peers=PeerExchange(urls=tuple(peers), share_dir=node.path(SHARE_DIR)) if peers else None,
        holders=tuple(holders or ()) if peers else ())
    result = agent_for(cluster, node, secrets_env(secrets, storage)).run(request, env=peer_env, timeout=timeout_s,
                                                                 on_line=sink)
    staged = {event["name"]: Staged.from_event(event) for event in map(parse, result.output.splitlines())
              if event is not None and event.kind is NodeEvent.INPUT_STAGED}
    if missing := sorted(inputs.keys() - staged.keys()):
        raise RuntimeError(f"{node.name}: no '{NodeEvent.INPUT_STAGED}' event for input {', '.join(missing)} in the "
                           "stage command's output")
    return StagedNode(Staged.from_event(last_event(result.output, NodeEvent.STAGED))
                      if snapshot_url is not None else None, staged)


@task(name="restore-checkpoint", **TRANSIENT_RETRIES)
def restore_checkpoint(cluster: Cluster, node: Node, checkpoint_url: str, checkpoint_format: str,
                       timeout_s: float = 3600, step: int | None = None, dest: str | None = None,
                       peers: list[str] | None = None, peer_env: dict[str, str] | None = None,
                       prune: bool = False, holders: list[int] | None = None,
                       secrets: dict[str, SecretRef] | None = None, storage: StorageSpec | None = None
                       ) -> Restored:
    """Download the latest committed checkpoint (or `step`) into the node's checkpoint dir (the whole union of every
    node's files, under the name the script saved it as); returns its step and local path (TRAINPIPE_RESUME_FROM).

    With `dest` it lands there instead, apart from the run's own checkpoints, and the node's syncer is not told:
    a warm start's weights (TRAINPIPE_INIT_FROM) or the checkpoint an evaluation reads are never this run's
    commits.

    peers (fan-out, tasks/fanout.py): every node's peer server URL by rank, peer_env their credentials: the nodes
    fill each other and the store serves each file of the checkpoint once per cluster.

    prune: the node's checkpoint dir keeps only the restored checkpoint (a survivor of a replace-one recovery).
    holders: the survivors of a replace-one: a replaced node's part comes from its replica on a survivor
    (checkpoints.peer_replica, infra/node/replica.py), else from the store.

    secrets: the job's training.secrets (names): resolved here, they reach the restore's environment; storage: the
    job's storage section (the account its stores reach)."""
    sink = node_line_sink(get_run_logger(), node.name)
    request = RestoreRequest(
        url=checkpoint_url, dest=dest if dest is not None else node.ckpt_dir,
        sync_dir=node.sync_dir if dest is None else None, format=checkpoint_format, step=step, prune=prune,
        rank=node.rank if peers else 0,
        peers=PeerExchange(urls=tuple(peers), share_dir=node.path(SHARE_DIR)) if peers else None,
        replica_dir=node.path(REPLICA_DIR) if peers else None, holders=tuple(holders or ()) if peers else ())
    result = agent_for(cluster, node, secrets_env(secrets, storage)).run(request, env=peer_env, timeout=timeout_s,
                                                                 on_line=sink)
    return Restored.from_event(last_event(result.output, NodeEvent.RESTORED))
