"""Sync: the run's last checkpoint is committed in the store and every byte of it checks out."""

from __future__ import annotations

from prefect import get_run_logger, task

from infra.checkpoints.store import CheckpointStore
from infra.compute.providers import Cluster, agent_for
from infra.job.secrets import SecretRef
from infra.job.spec import StorageSpec
from infra.node.events import NodeEvent
from infra.node.protocol import VerifyCkptRequest
from infra.storage import open_store
from tasks.node_output import last_event, node_line_sink
from tasks.policy import TRANSIENT_RETRIES
from tasks.results import Verified
from tasks.secrets import secrets_env


class NoCheckpointError(RuntimeError):
    """Training ended without a checkpoint trainpipe could commit: the run has produced nothing to keep."""


@task(name="verify-committed-checkpoint", **TRANSIENT_RETRIES)
def verify_committed_checkpoint(cluster: Cluster, checkpoint_url: str, checkpoint_format: str,
                                secrets: dict[str, SecretRef] | None = None, storage: StorageSpec | None = None
                                ) -> Verified:
    """Runs on the head node, so checksumming reads the store over the cluster's network, not the orchestrator's.
    secrets: the job's training.secrets (names): resolved here, they reach the command's environment; storage: the
    job's storage section (the account its stores reach)."""
    if CheckpointStore(open_store(checkpoint_url)).latest() is None:
        raise NoCheckpointError(
            f"training finished, but {checkpoint_url} holds no committed checkpoint: the script wrote no checkpoint "
            f"that checkpoints.format {checkpoint_format} recognises into TRAINPIPE_CHECKPOINT_DIR: save one there "
            "(the format's completion signal: see README, 'Checkpoints the syncer recognises') or fix the format")
    head = cluster.head
    result = agent_for(cluster, head, secrets_env(secrets, storage)).run(
        VerifyCkptRequest(url=checkpoint_url), timeout=3600, on_line=node_line_sink(get_run_logger(), head.name))
    return Verified.from_event(last_event(result.output, NodeEvent.VERIFIED))


@task(name="find-latest-commit", **TRANSIENT_RETRIES)
def latest_committed_step(checkpoint_url: str) -> int | None:
    """What a recovery resumes from: asked of the store, which outlives every node. A newer commit whose files the
    store's listing shows missing or cut short is skipped, and said so; the nodes' restore checks every byte, falls
    back further if it must and sets damaged commits aside."""
    latest, skipped = CheckpointStore(open_store(checkpoint_url)).latest_and_skipped()
    for reason in skipped:
        get_run_logger().warning("resume: %s: falling back to step %s", reason, latest.step if latest else "none")
    return latest.step if latest is not None else None
