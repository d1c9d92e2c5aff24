"""The checkpoint commit protocol in the object store: a step exists for readers only once its manifest does.

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

Because the manifest is written last and deleted first, a crash at any instant leaves every committed
checkpoint either whole or invisible. Records carry the attempt that wrote them and a commit takes only the current
attempt's, so a step retrained after a resume is never committed with a dead attempt's files. `latest` is a hint for
outside readers (it may lag one commit behind after a crash); trainpipe itself lists manifests. Checkpoints written
before named checkpoints existed keep their files directly under `step-N/` and restore as `step-N/`; those written
before attempts had their own files prefix (and by callers without an attempt) use `files/`.

A damaged commit (a file missing, short, or with other bytes than its manifest says) is set aside, never deleted:
its manifest moves into a note under `_set_aside/` and its files stay where they are, so no reader, listing, `latest`
or retention counts it again, and a retrain of that step writes its own attempt's prefix beside them. Each attempt
having its own prefix is what keeps a retrained step from ever being a mix of two attempts' files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from infra.checkpoints.lineage import Lineage
from infra.checkpoints.steps import PATTERN as STEP_PATTERN
from infra.checkpoints.steps import parse_step_name, step_name
from infra.storage.base import ChecksumMismatch, ObjectNotFound, ObjectStore
from infra.storage.checksum import SHA256, TAGGED_CHECKSUM, Checksum, checksum_of_ranges, sha256_file
from infra.storage.transfer import FileSpec, download, upload
from infra.strict_model import SHA256_HEX, StrictModel

log = logging.getLogger(__name__)

FORMAT = "trainpipe-ckpt-v1"
LATEST_KEY = "latest"
MANIFEST_NAME = "manifest.json"
EVAL_NAME = "eval.json"
NODES_DIR = "_nodes"
PENDING_DIR = "_pending"
SET_ASIDE_DIR = "_set_aside"
FILES_PREFIX = "files/"
VERIFY_CHUNK = 8 * 1024 * 1024
_STEP_KEY = re.compile(rf"^{STEP_PATTERN}/(.+)$")
_NODE_RECORD = re.compile(r"^_nodes/node-(\d+)\.json$")


# ---- the node-local upload lease -------------------------------------------------------------------------------
# The syncer names the checkpoint it is uploading in its sync dir (TRAINPIPE_SYNC_DIR), so a trainer's local
# retention that honours it (trainer.checkpoint.prune_local) leaves that step alone; without it a syncer slower than
# two checkpoint intervals would see every upload deleted under it and never commit. The syncer still tolerates a
# checkpoint vanishing (a framework's own retention, the race between listing and leasing), so this lease is about
# progress, not safety. A lease whose process is gone (kill -9) does not count.
UPLOAD_LEASE = "uploading"


def write_lease(directory: Path, name: str, step: int) -> None:
    temp = directory / f".{name}.tmp-{os.getpid()}"
    temp.write_text(json.dumps({"step": step, "pid": os.getpid()}))
    os.replace(temp, directory / name)


def clear_lease(directory: Path, name: str) -> None:
    (directory / name).unlink(missing_ok=True)


def leased_step(directory: Path, name: str) -> int | None:
    """The step named by a live process's lease of that name in directory, or None."""
    try:
        lease = json.loads((directory / name).read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{directory / name}: corrupt lease ({exc.msg}): delete it") from None
    return int(lease["step"]) if _process_alive(int(lease["pid"])) else None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


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


@dataclass
class _StepObjects:
    has_manifest: bool = False
    nodes: list[int] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    sizes: dict[str, int] = field(default_factory=dict)  # every object under step-N/ by its key there

    def damage(self, manifest: CheckpointManifest) -> str | None:
        """What the listing shows wrong with a committed step (a file missing or of another size), or None.

        Free (the listing is there anyway), so every reader of "committed" uses it; only bytes changed in place
        need a checksum to be seen (verify, restore)."""
        for entry in manifest.files:
            rest = f"{manifest.files_prefix}{entry.path}"
            size = self.sizes.get(rest)
            if size is None:
                return f"{rest} is missing"
            if size != entry.bytes:
                return f"{rest} has {size} bytes, the manifest says {entry.bytes}"
        return None


# Fills a committed step's folder with its files, each verified against the manifest (infra/node/peerrestore.py);
# raises ObjectNotFound or ChecksumMismatch for a file the store does not have whole, as the store's download does.
Fill = Callable[["CheckpointStore", CheckpointManifest, Path], None]


@dataclass
class StoreFill:
    """The fill of a restore without peers: the step's files in one download from the store, each verified; the
    valid files already in the folder stay. Counts the bytes by where they came from (a restore that falls back to
    an older step adds that step's)."""

    store_bytes: int = 0  # downloaded
    local_bytes: int = 0  # already there, verified

    def __call__(self, checkpoints: CheckpointStore, manifest: CheckpointManifest, folder: Path) -> None:
        specs = [FileSpec(entry.path, entry.bytes, entry.sha256, entry.crc) for entry in manifest.files]
        result = download(checkpoints.source(manifest), specs, folder)
        self.store_bytes += result.bytes_moved
        self.local_bytes += result.bytes_skipped
        log.info("restored step %d into %s: %d files, %d skipped, %.1f MB/s", manifest.step, folder,
                 len(result.files), result.files_skipped, result.mb_per_s)

    @property
    def sources(self) -> dict[str, int]:
        return {"store": self.store_bytes, "local": self.local_bytes}


class CheckpointStore:
    """Checkpoints of one run, rooted at its checkpoint URL (e.g. file:///…/checkpoints/<run-id>)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    # ---- reading ------------------------------------------------------------------------------------------

    def _scan(self) -> dict[int, _StepObjects]:
        steps: dict[int, _StepObjects] = {}
        for info in self.store.list():
            match = _STEP_KEY.match(info.key)
            if not match:
                continue
            objects = steps.setdefault(int(match.group(1)), _StepObjects())
            rest = match.group(2)
            objects.sizes[rest] = info.size
            node = _NODE_RECORD.match(rest)
            if rest == MANIFEST_NAME:
                objects.has_manifest = True
            elif rest == EVAL_NAME:
                continue  # about the checkpoint, not part of it
            elif node:
                objects.nodes.append(int(node.group(1)))
            elif not rest.startswith(f"{NODES_DIR}/"):
                objects.files += 1
                objects.bytes += info.size
        return steps

    def _read_manifest(self, step: int) -> CheckpointManifest | None:
        """The step's manifest, None when there is none; CheckpointError when it exists but is unusable."""
        key = manifest_key(step)
        try:
            manifest = CheckpointManifest.model_validate_json(self.store.get_bytes(key))
        except ObjectNotFound:
            return None
        except ValidationError as exc:
            raise CheckpointError(
                f"{self.store.url_for(key)}: corrupt manifest ({exc.errors()[0]['msg']}): "
                f"step {step} is treated as uncommitted"
            ) from None
        if manifest.step != step:
            raise CheckpointError(
                f"{self.store.url_for(key)}: manifest says step {manifest.step}: step {step} is treated as uncommitted"
            )
        return manifest

    def _load_manifest(self, step: int) -> CheckpointManifest | None:
        """The step's manifest, or None when it is missing or unusable (the step then is not committed)."""
        try:
            return self._read_manifest(step)
        except CheckpointError as exc:
            log.warning("%s", exc)
            return None

    def _whole_manifest(self, step: int, objects: _StepObjects, skipped: list[str] | None = None
                        ) -> CheckpointManifest | None:
        """The step's manifest when it is committed and every file it lists is in the listing; None otherwise,
        with the reason logged (and added to skipped) when a manifest is there but its step is damaged."""
        if not objects.has_manifest:
            return None
        manifest = self._load_manifest(step)
        damage = objects.damage(manifest) if manifest is not None else None
        if damage:
            reason = f"step {step} is damaged ({self.store.url_for(step_name(step))}/{damage}): skipped"
            log.warning("%s", reason)
            if skipped is not None:
                skipped.append(reason)
            return None
        return manifest

    def list_steps(self) -> list[StepStatus]:
        """Every step with any object in the store, oldest first; committed means a valid manifest whose files are
        all there."""
        return [
            StepStatus(
                step,
                self._whole_manifest(step, objects) is not None,
                sorted(objects.nodes),
                objects.files,
                objects.bytes,
            )
            for step, objects in sorted(self._scan().items())
        ]

    def _committed_newest_first(self, skipped: list[str] | None = None) -> Iterator[CheckpointManifest]:
        """One listing, then manifests read newest first only as far as the caller goes; a damaged step is skipped."""
        for step, objects in sorted(self._scan().items(), reverse=True):
            manifest = self._whole_manifest(step, objects, skipped)
            if manifest is not None:
                yield manifest

    def committed(self) -> list[CheckpointManifest]:
        """Committed checkpoints, newest first."""
        return list(self._committed_newest_first())

    def latest(self) -> CheckpointManifest | None:
        """The newest committed checkpoint, found by listing manifests.

        Not read from `latest`: a committer killed between its manifest and the pointer leaves the pointer one
        commit behind, and a reader racing a commit would see it behind too. The pointer serves outside readers.
        """
        return next(self._committed_newest_first(), None)

    def latest_and_skipped(self) -> tuple[CheckpointManifest | None, list[str]]:
        """latest(), and one line per newer committed step skipped because the listing shows it damaged."""
        skipped: list[str] = []
        return next(self._committed_newest_first(skipped), None), skipped

    def manifest(self, step: int | None = None) -> CheckpointManifest:
        """The manifest of a committed step (the newest when None).

        CheckpointError when the step is not committed, or when its manifest (or, for None, the newest step's
        manifest) is corrupt: someone asking for "the newest" must hear that it is damaged, not get an older one.
        """
        if step is None:
            with_manifest = [s for s, objects in self._scan().items() if objects.has_manifest]
            if not with_manifest:
                raise NoCommittedCheckpoint(f"{self.store.url}: no committed checkpoint: train first or check the URL")
            step = max(with_manifest)
        manifest = self._read_manifest(step)
        if manifest is not None:
            return manifest
        raise CheckpointError(
            f"{self.store.url_for(manifest_key(step))}: step {step} is not committed: "
            "pick a committed step (trainpipe ckpt ls) or omit the step"
        )

    # ---- evaluations -----------------------------------------------------------------------------------------

    def record_eval(self, step: int, metrics: dict[str, float], command: str) -> EvalRecord:
        """Write a committed step's evaluation beside its manifest (step-N/eval.json); a re-evaluation replaces it."""
        self.manifest(step)
        record = EvalRecord(step=step, metrics=metrics, command=command,
                            recorded_at=datetime.now(UTC).isoformat(timespec="seconds"))
        self.store.put_bytes(f"{step_name(step)}/{EVAL_NAME}", record.model_dump_json(indent=1).encode())
        return record

    def eval(self, step: int) -> EvalRecord | None:
        """The step's evaluation, None when it was never evaluated."""
        key = f"{step_name(step)}/{EVAL_NAME}"
        try:
            return EvalRecord.model_validate_json(self.store.get_bytes(key))
        except ObjectNotFound:
            return None
        except ValidationError as exc:
            raise CheckpointError(f"{self.store.url_for(key)}: corrupt evaluation ({exc.errors()[0]['msg']}): "
                                  "evaluate the step again or delete it") from None

    # ---- announcing (the coordinator) and finding announcements (every other node) ----------------------------

    def announce(self, announcement: Announcement) -> None:
        self.store.put_bytes(announcement_key(announcement.step), announcement.model_dump_json().encode())

    def withdraw(self, step: int) -> None:
        """A checkpoint that will never be committed: the nodes stop waiting to ship it."""
        self.store.delete(announcement_key(step))

    def announcements(self, attempt: str) -> list[Announcement]:
        """This attempt's announcements still waiting for their commit, oldest step first."""
        found = []
        for info in self.store.list(f"{PENDING_DIR}/"):
            name = info.key.removeprefix(f"{PENDING_DIR}/")
            if parse_step_name(name, ".json") is None:
                continue
            try:
                announcement = Announcement.model_validate_json(self.store.get_bytes(info.key))
            except ObjectNotFound:
                continue  # committed (and withdrawn) between the listing and the read
            except ValidationError as exc:
                raise CheckpointError(f"{self.store.url_for(info.key)}: corrupt announcement "
                                      f"({exc.errors()[0]['msg']}): delete it and restart the job") from None
            if announcement.attempt == attempt:
                found.append(announcement)
        return sorted(found, key=lambda a: a.step)

    def announce_final(self, attempt: str) -> None:
        """The coordinator is stopping: nothing more will be announced in this attempt."""
        self.store.put_bytes(final_key(attempt), b"{}")

    def is_final(self, attempt: str) -> bool:
        return self.store.head(final_key(attempt)) is not None

    # ---- writing ------------------------------------------------------------------------------------------

    def upload_files(self, local_root: Path, step: int, files: Sequence[str], attempt: str = "") -> list[FileEntry]:
        """Upload a node's files of a checkpoint (paths relative to local_root) under the attempt's own prefix; no
        record yet."""
        # The syncer's check of a file rewritten in place still compares sha256 (infra/node/sync.py
        # `_still_as_uploaded`): taken before the upload, so a file that changes during it cannot match afterwards.
        # Drop it once that check compares `entry.checksum`, the CRC of the bytes the store received.
        sha256 = {rel: sha256_file(Path(local_root) / rel) for rel in files}
        result = upload(Path(local_root), list(files), self.store.child(f"{step_name(step)}/{files_prefix(attempt)}"))
        return [FileEntry(path=item.key, bytes=item.size, crc=item.crc, sha256=sha256[item.key])
                for item in result.files]

    def write_record(self, step: int, node_rank: int, files: list[FileEntry], attempt: str = "",
                     replica_url: str | None = None) -> NodeRecord:
        """The node's part is in the store: the record is what the committer waits for (and, with replica_url, what
        the node's replica holder pulls from where)."""
        record = NodeRecord(node_rank=node_rank, attempt=attempt, files=files, replica_url=replica_url)
        self.store.put_bytes(node_record_key(step, node_rank), record.model_dump_json().encode())
        return record

    def upload_node_part(self, local_root: Path, step: int, node_rank: int, files: Sequence[str],
                         attempt: str = "") -> NodeRecord:
        """Upload this node's files of a checkpoint, then its record."""
        return self.write_record(step, node_rank, self.upload_files(local_root, step, files, attempt), attempt)

    def _load_record(self, step: int, node_rank: int) -> NodeRecord | None:
        key = node_record_key(step, node_rank)
        try:
            return NodeRecord.model_validate_json(self.store.get_bytes(key))
        except ObjectNotFound:
            return None
        except ValidationError as exc:
            raise CheckpointError(
                f"{self.store.url_for(key)}: corrupt upload record ({exc.errors()[0]['msg']}): "
                f"delete it and restart node {node_rank}'s syncer"
            ) from None

    def current_record(self, step: int, node_rank: int, attempt: str) -> NodeRecord | None:
        """The node's record of this step from this attempt; one left by a dead attempt does not count."""
        record = self._load_record(step, node_rank)
        return record if record is not None and record.attempt == attempt else None

    def missing_records(self, step: int, nodes: int | Sequence[int], attempt: str = "") -> list[int]:
        """Node ranks whose upload record of this step, from this attempt, is not in the store yet."""
        ranks = range(nodes) if isinstance(nodes, int) else nodes
        return [rank for rank in ranks if self.current_record(step, rank, attempt) is None]

    def try_commit(self, step: int, nodes: int | Sequence[int], world_size: int, config_hash: str,
                   attempt: str = "", checkpoint: CheckpointRef | None = None,
                   required: Sequence[str] = (), lineage: Lineage | None = None) -> CheckpointManifest | None:
        """Write the manifest once the records of `nodes` (a count, or the ranks) from this attempt all exist (None
        until then); idempotent after a crash. CheckpointError when the parts lack a required file: such a
        checkpoint could not be loaded, so it is never committed.

        A manifest already there from another attempt (or unreadable) is not this commit: this attempt resumed
        from an older step and retrained this one, so once its own parts are all in, that commit is set aside (kept,
        and named in the log) and this attempt's is written in its place."""
        try:
            existing = self._read_manifest(step)
            unreadable = None
        except CheckpointError as exc:
            existing, unreadable = None, str(exc)
        if existing is not None and existing.attempt == attempt:
            self._advance_latest(existing)
            return existing
        ranks = list(range(nodes) if isinstance(nodes, int) else nodes)
        records = []
        for rank in ranks:
            record = self.current_record(step, rank, attempt)
            if record is None:
                return None
            records.append(record)
        files = self._union(step, records, attempt)
        missing = sorted(set(required) - {entry.path for entry in files})
        if missing:
            raise CheckpointError(
                f"{self.store.url_for(step_name(step))}: the nodes' parts lack {', '.join(missing[:5])}"
                f"{' …' if len(missing) > 5 else ''}: a node lost its part (deleted locally?): step {step} is not "
                "committed"
            )
        if unreadable is not None:
            self.set_aside(step, unreadable, keep_prefix=files_prefix(attempt))
        elif existing is not None:
            self.set_aside(step, f"committed by attempt {existing.attempt!r}, but attempt {attempt!r} resumed from an "
                           "older step and retrained it: the retrained step replaces it")
        manifest = CheckpointManifest(
            step=step,
            world_size=world_size,
            nodes=len(ranks),
            config_hash=config_hash,
            files=files,
            committed_at=datetime.now(UTC).isoformat(timespec="seconds"),
            checkpoint=checkpoint or CheckpointRef(name=step_name(step)),
            attempt=attempt,
            files_prefix=files_prefix(attempt),
            lineage=lineage,
        )
        self.store.put_bytes(manifest_key(step), manifest.model_dump_json(indent=1).encode())
        self._advance_latest(manifest)
        self.store.delete(announcement_key(step))
        return manifest

    def _union(self, step: int, records: list[NodeRecord], attempt: str) -> list[FileEntry]:
        by_path: dict[str, FileEntry] = {}
        for record in records:
            for entry in record.files:
                other = by_path.setdefault(entry.path, entry)
                if other != entry:
                    raise CheckpointError(
                        f"{self.store.url_for(step_name(step) + '/' + files_prefix(attempt) + entry.path)}: two nodes "
                        "uploaded different contents: each node must write distinct file names (check the "
                        "script's node ranks)"
                    )
        return sorted(by_path.values(), key=lambda entry: entry.path)

    def _advance_latest(self, manifest: CheckpointManifest) -> None:
        # Only forward: a re-run commit of an older step (a restarted committer) must not move readers back.
        current = self.latest()
        if current is not None and current.step > manifest.step:
            return
        self._point_latest_at(manifest)

    def _point_latest_at(self, manifest: CheckpointManifest | None) -> None:
        if manifest is None:
            self.store.delete(LATEST_KEY)
            return
        pointer = LatestPointer(step=manifest.step, manifest=manifest_key(manifest.step), attempt=manifest.attempt)
        self.store.put_bytes(LATEST_KEY, pointer.model_dump_json().encode())

    # ---- setting a commit aside -----------------------------------------------------------------------------

    def set_aside(self, step: int, reason: str, keep_prefix: str | None = None) -> SetAside | None:
        """Take the step's commit out of the checkpoints without deleting anything of it; None when it has no
        manifest (nothing committed, or another node set it aside first).

        The note (its manifest, its files' keys, the reason) is written before the manifest is deleted, so a crash
        in between leaves the step to be set aside again under the same note. Its files stay in place: a retrain of
        the step uploads under its own attempt's prefix (keep_prefix, never counted as the set-aside commit's)."""
        key = manifest_key(step)
        try:
            raw = self.store.get_bytes(key)
        except ObjectNotFound:
            return None
        try:
            manifest: CheckpointManifest | None = CheckpointManifest.model_validate_json(raw)
        except ValidationError:
            manifest = None
        under = f"{step_name(step)}/"
        present = [info.key for info in self.store.list(under)]
        if manifest is not None and manifest.step == step:
            listed = {manifest.file_key(entry) for entry in manifest.files}
            own = f"{under}{manifest.files_prefix}" if manifest.files_prefix else None
            keys = [k for k in present if k in listed or (own is not None and k.startswith(own))]
        else:
            # An unreadable manifest names no files: every file of the step but a retrain's own is kept as its.
            skip = tuple(f"{under}{rest}" for rest in (MANIFEST_NAME, f"{NODES_DIR}/", keep_prefix) if rest)
            keys = [k for k in present if not k.startswith(skip)]
        note = SetAside(step=step, reason=reason, set_aside_at=datetime.now(UTC).isoformat(timespec="seconds"),
                        manifest=raw.decode(errors="replace"), attempt=manifest.attempt if manifest else None,
                        keys=keys)
        # Named by the manifest's bytes: every node that finds the same damage writes the same note.
        note_key = f"{SET_ASIDE_DIR}/{step_name(step)}-{hashlib.sha256(raw).hexdigest()[:16]}.json"
        self.store.put_bytes(note_key, note.model_dump_json(indent=1).encode())
        self.store.delete(key)
        log.warning("set aside step %d (%d files kept in place, see %s): %s", step, len(keys),
                    self.store.url_for(note_key), reason)
        self._repoint_latest_from(step)
        return note

    def _repoint_latest_from(self, step: int) -> None:
        """`latest` named a commit that is gone: it names the newest committed step now (back, this once)."""
        try:
            pointer = LatestPointer.model_validate_json(self.store.get_bytes(LATEST_KEY))
        except ObjectNotFound:
            return
        except ValidationError:
            pointer = None
        if pointer is None or pointer.step == step:
            self._point_latest_at(self.latest())

    def set_aside_notes(self) -> list[SetAside]:
        """Every commit set aside in this store, oldest step first."""
        notes = []
        for info in self.store.list(f"{SET_ASIDE_DIR}/"):
            try:
                notes.append(SetAside.model_validate_json(self.store.get_bytes(info.key)))
            except ValidationError as exc:
                raise CheckpointError(f"{self.store.url_for(info.key)}: corrupt note of a set-aside commit "
                                      f"({exc.errors()[0]['msg']}): fix or move it") from None
        return sorted(notes, key=lambda note: note.step)

    def apply_retention(self, keep: int, protected: Collection[int] = ()) -> list[int]:
        """Delete committed steps beyond the newest `keep` and uncommitted ones older than the newest committed,
        never a `protected` one (a step a model alias points at, or pointed at recently: Registry.protected).

        Returns the deleted steps. Nothing newer than the newest committed step is touched: it may be mid-upload.
        A commit found damaged (unreadable manifest, a file missing or of another size) is set aside first, so it
        never counts as one of the `keep`, never as the newest, and is never deleted: a good commit is not lost
        because a damaged one looked newer. The files of set-aside commits stay when their step's other files go.
        """
        if keep < 1:
            raise ValueError(f"keep={keep}: must be at least 1 so the newest committed checkpoint survives")
        steps = self._scan()
        committed = [step for step, objects in steps.items() if self._good_or_set_aside(step, objects)]
        if not committed:
            return []
        newest = max(committed)
        keep_steps = set(sorted(committed, reverse=True)[:keep])
        doomed = sorted(step for step in steps if step < newest and step not in keep_steps and step not in protected)
        kept_keys = {key for note in self.set_aside_notes() for key in note.keys} if doomed else set()
        for step in doomed:
            # The manifest goes first, so a crash mid-delete leaves an uncommitted (ignored) step, never a
            # "committed" one with files missing.
            self.store.delete(manifest_key(step))
            under = f"{step_name(step)}/"
            if any(key.startswith(under) for key in kept_keys):
                for info in self.store.list(under):
                    if info.key not in kept_keys:
                        self.store.delete(info.key)
            else:
                self.store.delete_prefix(under)
            self.store.delete(announcement_key(step))
            log.info("retention: deleted %s", self.store.url_for(step_name(step)))
        return doomed

    def _good_or_set_aside(self, step: int, objects: _StepObjects) -> bool:
        """Whether the step is committed and whole in the listing; a damaged commit (confirmed by its files' heads,
        not only by a listing that may be a moment old) is set aside."""
        if not objects.has_manifest:
            return False
        try:
            manifest = self._read_manifest(step)
        except CheckpointError as exc:
            self.set_aside(step, str(exc))
            return False
        if manifest is None:
            return False
        if objects.damage(manifest) is None:
            return True
        damage = self._damage(step, deep=False)
        if damage is None:
            return True
        self.set_aside(step, damage)
        return False

    def _skipped(self, step: int, damage: str) -> str:
        """A resume's word on a damaged step it skipped, once the step is set aside."""
        note = self.set_aside(step, damage)
        where = f"; set aside, its files kept (see {self.store.url_for(SET_ASIDE_DIR)}/)" if note is not None else ""
        return f"skipped checkpoint step {step}: {damage}{where}"

    def _set_aside_above(self, step: int, skipped: set[int]) -> list[str]:
        """The resume's word on commits above its step that were set aside before it looked (by another node's
        restore, say), so every node says why it resumed where it did."""
        return [f"skipped checkpoint step {note.step}: set aside at {note.set_aside_at}: {note.reason}"
                for note in self.set_aside_notes() if note.step > step and note.step not in skipped]

    def _damage(self, step: int, deep: bool) -> str | None:
        """What verify finds wrong with the committed step in the store, or None when it checks out."""
        try:
            self.verify(step, deep=deep)
        except CheckpointError as exc:
            return str(exc)
        return None

    # ---- verifying and restoring --------------------------------------------------------------------------

    def verify(self, step: int | None = None, deep: bool = True) -> CheckpointManifest:
        """Check every file of a committed step exists with its size (and, deep, its checksum)."""
        manifest = self.manifest(step)
        for entry in manifest.files:
            key = manifest.file_key(entry)
            info = self.store.head(key)
            if info is None:
                raise CheckpointError(
                    f"{self.store.url_for(key)}: missing from committed step {manifest.step}: "
                    "the checkpoint is damaged; restore an older step"
                )
            if info.size != entry.bytes:
                raise CheckpointError(
                    f"{self.store.url_for(key)}: {info.size} bytes, manifest says {entry.bytes}: "
                    "the checkpoint is damaged; restore an older step"
                )
            expected = entry.checksum
            if deep and self._checksum(key, entry.bytes, expected.algorithm) != expected:
                raise CheckpointError(
                    f"{self.store.url_for(key)}: {expected.algorithm} differs from the manifest: "
                    "the checkpoint is damaged; restore an older step"
                )
        return manifest

    def _checksum(self, key: str, size: int, algorithm: str) -> Checksum:
        chunks = (self.store.get_range(key, start, min(VERIFY_CHUNK, size - start))
                  for start in range(0, size, VERIFY_CHUNK))
        return checksum_of_ranges(chunks, algorithm)

    def uploaders(self, manifest: CheckpointManifest) -> dict[str, int]:
        """File path -> the node rank that uploaded it in the committed attempt (the lowest, when several did): the
        node that may still hold it on its disk. A record that cannot be read leaves its files out (a restore from
        peers fetches those from the store), never failing the restore."""
        owners: dict[str, int] = {}
        for rank in range(manifest.nodes):
            try:
                record = self.current_record(manifest.step, rank, manifest.attempt)
            except CheckpointError as exc:
                log.warning("%s: its files come from the store", exc)
                continue
            for entry in record.files if record is not None else ():
                owners.setdefault(entry.path, rank)
        return owners

    def restore(self, dest_dir: Path, step: int | None = None, fill: Fill | None = None) -> Path:
        """Download a committed step into dest_dir/<its name>, verified; valid files already there stay.

        Returns that path: the checkpoint's folder, or its file for a checkpoint that is one file. fill: how the
        files reach the folder instead of one download from the store (a restore from peers)."""
        manifest = self.verify(step, deep=False)
        return self._download(manifest, Path(dest_dir), fill)

    def source(self, manifest: CheckpointManifest) -> ObjectStore:
        """Where a committed step's files are, each under its path."""
        return self.store.child(f"{step_name(manifest.step)}/{manifest.files_prefix}".rstrip("/"))

    def _download(self, manifest: CheckpointManifest, dest_dir: Path, fill: Fill | None = None) -> Path:
        ref = manifest.ref
        target = dest_dir / ref.name
        # A file checkpoint's one file sits beside its siblings: download into its folder, under its own name.
        folder = target if ref.kind == "dir" else target.parent
        (fill or StoreFill())(self, manifest, folder)
        log.info("restored step %d into %s", manifest.step, target)
        return target

    def restore_latest(self, dest_dir: Path, fill: Fill | None = None) -> tuple[Path, CheckpointManifest, list[str]]:
        """Restore the newest committed step that verifies, falling back to older ones.

        Returns the restored path, its manifest and one warning per newer checkpoint skipped. Only damage to a
        checkpoint (missing object, bad size/checksum) makes it fall back; other storage or disk errors are
        raised, because an older checkpoint would not fix them and silently losing progress would hide them.
        A step skipped for damage the store itself shows is set aside (the warning says where), so the attempt
        that resumes below it retrains that step into a clean commit, and nothing counts the damaged one again.
        A download whose bytes differ while the store's copy verifies is only skipped: that damage was in transit.
        What the node holds of a skipped checkpoint (this download's part, a survivor's own copy) is removed, so the
        retrain of its step starts from an empty folder instead of mixing its files with those.
        fill (a restore from peers) fills the step's folder; once a download found a step damaged, the older steps
        come from the store (the peers that did not find it may be filling the damaged step still).
        """
        warnings = []
        skipped: set[int] = set()
        committed_seen = False
        damaged_in_download = False
        for step, objects in sorted(self._scan().items(), reverse=True):
            if not objects.has_manifest:
                continue
            manifest = None
            try:
                manifest = self._read_manifest(step)
                if manifest is None:
                    continue
                committed_seen = True
                self.verify(step, deep=False)
                path = self._download(manifest, Path(dest_dir), None if damaged_in_download else fill)
                return path, manifest, warnings + self._set_aside_above(step, skipped)
            except CheckpointError as exc:
                warning = self._skipped(step, str(exc))
            except (ObjectNotFound, ChecksumMismatch) as exc:
                # The store's bytes, or only the download's? Only the store's own damage is set aside.
                damaged_in_download = True
                damage = self._damage(step, deep=True)
                warning = (f"skipped checkpoint step {step}: {exc} (the store's copy verifies: the download was "
                           "damaged, not the checkpoint)") if damage is None else self._skipped(step, damage)
            log.warning("%s", warning)
            warnings.append(warning)
            skipped.add(step)
            if manifest is not None:
                _discard(Path(dest_dir) / manifest.ref.name)
        if not committed_seen and not warnings:
            raise NoCommittedCheckpoint(f"{self.store.url}: no committed checkpoint: train first or check the URL")
        raise CheckpointError(
            f"{self.store.url}: every committed checkpoint is damaged ({'; '.join(warnings)}): "
            "start from scratch or repair the store"
        )


def _discard(path: Path) -> None:
    """Remove a skipped checkpoint's local folder or file, saying so."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    else:
        return
    log.warning("removed %s: the checkpoint it holds was skipped", path)
