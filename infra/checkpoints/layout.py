"""Where a run's checkpoints live in its store, and the records kept there.

Layout under a run's checkpoint root:
    _pending/step-00000100.json            the coordinator's announcement: which checkpoint (its name in the
                                           nodes' checkpoint dirs, format, attempt) and whose parts a commit needs
    _pending/final-<attempt>.json          the coordinator announces nothing more in this attempt (it is stopping)
    step-00000100/files-<attempt>/<path>   each node's files of the checkpoint, as that attempt uploaded them
    step-00000100/_nodes/node-<r>.json     a node's upload record (its attempt, files, sizes, checksums)
    step-00000100/manifest.json            THE COMMIT: written once every node's record of this attempt exists
    step-00000100/eval.json                the step's evaluation (metrics, command), written after its commit
                                           (the manifest is immutable once committed)
    latest                                 {"step": 100, "manifest": …, "attempt": …}, after the manifest
    _set_aside/step-00000100-<id>.json     a commit set aside (damaged, or replaced by a retrain): its manifest,
                                           its files' keys (left in place, never written again) and why

Checkpoints written before named checkpoints existed keep their files directly under `step-N/` and restore as
`step-N/`; those written before attempts had their own files prefix (and by callers without an attempt) use
`files/`. How the store is read: infra.checkpoints.reading; written: commit; restored: restore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from infra.checkpoints.lineage import Lineage
from infra.checkpoints.steps import step_name
from infra.storage.checksum import SHA256, TAGGED_CHECKSUM, Checksum
from infra.strict_model import SHA256_HEX, StrictModel

FORMAT = "trainpipe-ckpt-v1"
LATEST_KEY = "latest"
MANIFEST_NAME = "manifest.json"
EVAL_NAME = "eval.json"
NODES_DIR = "_nodes"
PENDING_DIR = "_pending"
SET_ASIDE_DIR = "_set_aside"
FILES_PREFIX = "files/"


class CheckpointError(Exception):
    """A checkpoint that cannot be committed, verified or restored; the message names the object and the fix."""


class NoCommittedCheckpoint(CheckpointError):
    """The store holds no committed checkpoint at all (a fresh run, not a damaged one)."""


def manifest_key(step: int) -> str:
    return f"{step_name(step)}/{MANIFEST_NAME}"


def node_record_key(step: int, node_rank: int) -> str:
    return f"{step_name(step)}/{NODES_DIR}/node-{node_rank}.json"


def announcement_key(step: int) -> str:
    return f"{PENDING_DIR}/{step_name(step)}.json"


def final_key(attempt: str) -> str:
    return f"{PENDING_DIR}/final-{attempt}.json"


def files_prefix(attempt: str) -> str:
    """Where an attempt's files of a step go under step-N/: its own prefix, so a retrain never writes over (or mixes
    with) the files another attempt committed for the same step."""
    return f"files-{attempt}/" if attempt else FILES_PREFIX


def eval_key(step: int) -> str:
    return f"{step_name(step)}/{EVAL_NAME}"


class FileEntry(StrictModel):
    path: str
    bytes: int = Field(ge=0)
    sha256: str | None = Field(default=None, pattern=SHA256_HEX)
    crc: str | None = Field(default=None, pattern=TAGGED_CHECKSUM)  # "crc64nvme:<base64>" (infra.storage.checksum)

    @model_validator(mode="after")
    def _has_checksum(self) -> FileEntry:
        if self.sha256 is None and self.crc is None:
            raise ValueError(f"{self.path}: no checksum: a file entry needs its crc (or, written before, its sha256)")
        return self

    @property
    def checksum(self) -> Checksum:
        """What the file is verified by: its CRC, or the sha256 of a manifest written before the CRCs."""
        if self.crc is not None:
            return Checksum.parse(self.crc)
        assert self.sha256 is not None, "the validator requires one of them"
        return Checksum(SHA256, self.sha256)


class NodeRecord(StrictModel):
    node_rank: int = Field(ge=0)
    attempt: str = ""  # records written before attempts were recorded carry none
    files: list[FileEntry]
    # Where the node serves this part to its replica holder while it trains (peer replicas: infra/node/replica.py);
    # None: it serves none. Its port is picked free when the syncer starts, so the holder learns it here.
    replica_url: str | None = None


class CheckpointRef(StrictModel):
    """Which checkpoint in the nodes' checkpoint dirs a step is, and how it restores there."""

    name: str = Field(min_length=1)  # path relative to the checkpoint dir: "checkpoint-500", "snapshot.pt"
    kind: Literal["dir", "file"] = "dir"
    format: str = "marker"


class Announcement(StrictModel):
    """The coordinator's word that a complete checkpoint exists: every node in `nodes` ships its part of it."""

    step: int = Field(ge=0)
    checkpoint: CheckpointRef
    attempt: str
    nodes: list[int] = Field(min_length=1)
    required: list[str] = Field(default_factory=list)  # files the union must hold (DCP's data files, RNG states)
    announced_at: float


class CheckpointManifest(StrictModel):
    format: Literal["trainpipe-ckpt-v1"] = FORMAT
    step: int = Field(ge=0)
    world_size: int = Field(ge=1)
    nodes: int = Field(ge=1)
    config_hash: str
    files: list[FileEntry]
    committed_at: str
    checkpoint: CheckpointRef | None = None  # None: written before named checkpoints (a `step-N/` dir)
    attempt: str = ""
    files_prefix: str = ""  # where the files sit under step-N/ ("files/" since named checkpoints)
    lineage: Lineage | None = None  # where it came from; None: committed without one (before lineage, or by hand)

    @property
    def total_bytes(self) -> int:
        return sum(entry.bytes for entry in self.files)

    @property
    def ref(self) -> CheckpointRef:
        return self.checkpoint or CheckpointRef(name=step_name(self.step))

    def file_key(self, entry: FileEntry) -> str:
        return f"{step_name(self.step)}/{self.files_prefix}{entry.path}"


class EvalRecord(StrictModel):
    """A committed step's evaluation: what the evaluate command wrote, and the command."""

    step: int = Field(ge=0)
    metrics: dict[str, float]
    command: str
    recorded_at: str


class LatestPointer(StrictModel):
    step: int = Field(ge=0)
    manifest: str
    attempt: str = ""  # which attempt's commit of the step: a retrained step has the same manifest key


class SetAside(StrictModel):
    """A commit taken out of the checkpoints (damaged, or replaced by a retrain of its step), kept for a person."""

    step: int = Field(ge=0)
    reason: str
    set_aside_at: str
    manifest: str  # the manifest's text as it was (it may be the damage)
    attempt: str | None  # the attempt that committed it, None when the manifest is unreadable
    keys: list[str]  # its files in the store, left where they are: retention never deletes them


@dataclass(frozen=True)
class StepStatus:
    step: int
    committed: bool
    nodes_uploaded: list[int]
    files: int
    bytes: int
