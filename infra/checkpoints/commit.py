"""The checkpoint commit protocol in the object store: a step exists for readers only once its manifest does.

Layout under a run's checkpoint root:
    _pending/step-00000100.json            the coordinator's announcement: which checkpoint (its name in the
                                           nodes' checkpoint dirs, format, attempt) and whose parts a commit needs
    _pending/final-<attempt>.json          the coordinator announces nothing more in this attempt (it is stopping)
    step-00000100/files/<path>             each node's files of the checkpoint
    step-00000100/_nodes/node-<r>.json     a node's upload record (its attempt, files, sizes, checksums)
    step-00000100/manifest.json            THE COMMIT: written once every node's record of this attempt exists
    latest                                 {"step": 100, "manifest": "step-00000100/manifest.json"}, after the manifest

Because the manifest is written last and deleted first, a crash at any instant leaves every committed
checkpoint either whole or invisible. Records carry the attempt that wrote them and a commit takes only the current
attempt's, so a step retrained after a resume is never committed with a dead attempt's files. `latest` is a hint for
outside readers (it may lag one commit behind after a crash); trainpipe itself lists manifests. Checkpoints written
before named checkpoints existed keep their files directly under `step-N/` and restore as `step-N/`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from infra.checkpoints.steps import PATTERN as STEP_PATTERN
from infra.checkpoints.steps import parse_step_name, step_name
from infra.models import SHA256_HEX, StrictModel
from infra.storage.base import ChecksumMismatch, ObjectNotFound, ObjectStore
from infra.storage.checksum import SHA256, TAGGED_CHECKSUM, Checksum, checksum_of_ranges, sha256_file
from infra.storage.transfer import FileSpec, download, upload

log = logging.getLogger(__name__)

FORMAT = "trainpipe-ckpt-v1"
LATEST_KEY = "latest"
MANIFEST_NAME = "manifest.json"
NODES_DIR = "_nodes"
PENDING_DIR = "_pending"
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

    @property
    def total_bytes(self) -> int:
        return sum(entry.bytes for entry in self.files)

    @property
    def ref(self) -> CheckpointRef:
        return self.checkpoint or CheckpointRef(name=step_name(self.step))

    def file_key(self, entry: FileEntry) -> str:
        return f"{step_name(self.step)}/{self.files_prefix}{entry.path}"


class LatestPointer(StrictModel):
    step: int = Field(ge=0)
    manifest: str


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
            node = _NODE_RECORD.match(rest)
            if rest == MANIFEST_NAME:
                objects.has_manifest = True
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

    def list_steps(self) -> list[StepStatus]:
        """Every step with any object in the store, oldest first; committed means a valid manifest."""
        return [
            StepStatus(
                step,
                objects.has_manifest and self._load_manifest(step) is not None,
                sorted(objects.nodes),
                objects.files,
                objects.bytes,
            )
            for step, objects in sorted(self._scan().items())
        ]

    def _committed_newest_first(self) -> Iterator[CheckpointManifest]:
        """One listing, then manifests read newest first only as far as the caller goes."""
        for step, objects in sorted(self._scan().items(), reverse=True):
            manifest = self._load_manifest(step) if objects.has_manifest else None
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

    def upload_files(self, local_root: Path, step: int, files: Sequence[str]) -> list[FileEntry]:
        """Upload a node's files of a checkpoint (paths relative to local_root); no record yet."""
        # The syncer's check of a file rewritten in place still compares sha256 (infra/node/sync.py
        # `_still_as_uploaded`): taken before the upload, so a file that changes during it cannot match afterwards.
        # Drop it once that check compares `entry.checksum`, the CRC of the bytes the store received.
        sha256 = {rel: sha256_file(Path(local_root) / rel) for rel in files}
        result = upload(Path(local_root), list(files), self.store.child(f"{step_name(step)}/{FILES_PREFIX}"))
        return [FileEntry(path=item.key, bytes=item.size, crc=item.crc, sha256=sha256[item.key])
                for item in result.files]

    def write_record(self, step: int, node_rank: int, files: list[FileEntry], attempt: str = "") -> NodeRecord:
        """The node's part is in the store: the record is what the committer waits for."""
        record = NodeRecord(node_rank=node_rank, attempt=attempt, files=files)
        self.store.put_bytes(node_record_key(step, node_rank), record.model_dump_json().encode())
        return record

    def upload_node_part(self, local_root: Path, step: int, node_rank: int, files: Sequence[str],
                         attempt: str = "") -> NodeRecord:
        """Upload this node's files of a checkpoint, then its record."""
        return self.write_record(step, node_rank, self.upload_files(local_root, step, files), attempt)

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

    def _current_record(self, step: int, node_rank: int, attempt: str) -> NodeRecord | None:
        """The node's record of this step from this attempt; one left by a dead attempt does not count."""
        record = self._load_record(step, node_rank)
        return record if record is not None and record.attempt == attempt else None

    def missing_records(self, step: int, nodes: int | Sequence[int], attempt: str = "") -> list[int]:
        """Node ranks whose upload record of this step, from this attempt, is not in the store yet."""
        ranks = range(nodes) if isinstance(nodes, int) else nodes
        return [rank for rank in ranks if self._current_record(step, rank, attempt) is None]

    def try_commit(self, step: int, nodes: int | Sequence[int], world_size: int, config_hash: str,
                   attempt: str = "", checkpoint: CheckpointRef | None = None,
                   required: Sequence[str] = ()) -> CheckpointManifest | None:
        """Write the manifest once the records of `nodes` (a count, or the ranks) from this attempt all exist (None
        until then); idempotent after a crash. CheckpointError when the parts lack a required file: such a
        checkpoint could not be loaded, so it is never committed."""
        existing = self._load_manifest(step)
        if existing is not None:
            self._advance_latest(existing)
            return existing
        ranks = list(range(nodes) if isinstance(nodes, int) else nodes)
        records = []
        for rank in ranks:
            record = self._current_record(step, rank, attempt)
            if record is None:
                return None
            records.append(record)
        files = self._union(step, records)
        missing = sorted(set(required) - {entry.path for entry in files})
        if missing:
            raise CheckpointError(
                f"{self.store.url_for(step_name(step))}: the nodes' parts lack {', '.join(missing[:5])}"
                f"{' …' if len(missing) > 5 else ''}: a node lost its part (deleted locally?): step {step} is not "
                "committed"
            )
        manifest = CheckpointManifest(
            step=step,
            world_size=world_size,
            nodes=len(ranks),
            config_hash=config_hash,
            files=files,
            committed_at=datetime.now(UTC).isoformat(timespec="seconds"),
            checkpoint=checkpoint or CheckpointRef(name=step_name(step)),
            attempt=attempt,
            files_prefix=FILES_PREFIX,
        )
        self.store.put_bytes(manifest_key(step), manifest.model_dump_json(indent=1).encode())
        self._advance_latest(manifest)
        self.store.delete(announcement_key(step))
        return manifest

    def _union(self, step: int, records: list[NodeRecord]) -> list[FileEntry]:
        by_path: dict[str, FileEntry] = {}
        for record in records:
            for entry in record.files:
                other = by_path.setdefault(entry.path, entry)
                if other != entry:
                    raise CheckpointError(
                        f"{self.store.url_for(step_name(step) + '/' + FILES_PREFIX + entry.path)}: two nodes "
                        "uploaded different contents: each node must write distinct file names (check the "
                        "script's node ranks)"
                    )
        return sorted(by_path.values(), key=lambda entry: entry.path)

    def _advance_latest(self, manifest: CheckpointManifest) -> None:
        # Only forward: a re-run commit of an older step (a restarted committer) must not move readers back.
        current = self.latest()
        if current is not None and current.step > manifest.step:
            return
        pointer = LatestPointer(step=manifest.step, manifest=manifest_key(manifest.step))
        self.store.put_bytes(LATEST_KEY, pointer.model_dump_json().encode())

    def apply_retention(self, keep: int) -> list[int]:
        """Delete committed steps beyond the newest `keep` and uncommitted ones older than the newest committed.

        Returns the deleted steps. Nothing newer than the newest committed step is touched: it may be mid-upload.
        """
        if keep < 1:
            raise ValueError(f"keep={keep}: must be at least 1 so the newest committed checkpoint survives")
        statuses = self.list_steps()
        committed = [status.step for status in statuses if status.committed]
        if not committed:
            return []
        newest = max(committed)
        keep_steps = set(sorted(committed, reverse=True)[:keep])
        doomed = [s.step for s in statuses if s.step < newest and s.step not in keep_steps]
        for step in doomed:
            # The manifest goes first, so a crash mid-delete leaves an uncommitted (ignored) step, never a
            # "committed" one with files missing.
            self.store.delete(manifest_key(step))
            self.store.delete_prefix(step_name(step) + "/")
            self.store.delete(announcement_key(step))
            log.info("retention: deleted %s", self.store.url_for(step_name(step)))
        return doomed

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

    def restore(self, dest_dir: Path, step: int | None = None) -> Path:
        """Download a committed step into dest_dir/<its name>, verified; valid files already there stay.

        Returns that path: the checkpoint's folder, or its file for a checkpoint that is one file."""
        manifest = self.verify(step, deep=False)
        return self._download(manifest, Path(dest_dir))

    def _download(self, manifest: CheckpointManifest, dest_dir: Path) -> Path:
        ref = manifest.ref
        target = dest_dir / ref.name
        # A file checkpoint's one file sits beside its siblings: download into its folder, under its own name.
        folder = target if ref.kind == "dir" else target.parent
        specs = [FileSpec(entry.path, entry.bytes, entry.sha256, entry.crc) for entry in manifest.files]
        source = self.store.child(f"{step_name(manifest.step)}/{manifest.files_prefix}".rstrip("/"))
        result = download(source, specs, folder)
        log.info(
            "restored step %d into %s: %d files, %d skipped, %.1f MB/s",
            manifest.step,
            target,
            len(result.files),
            result.files_skipped,
            result.mb_per_s,
        )
        return target

    def restore_latest(self, dest_dir: Path) -> tuple[Path, CheckpointManifest, list[str]]:
        """Restore the newest committed step that verifies, falling back to older ones.

        Returns the restored path, its manifest and one warning per newer checkpoint skipped. Only damage to a
        checkpoint (missing object, bad size/checksum) makes it fall back; other storage or disk errors are
        raised, because an older checkpoint would not fix them and silently losing progress would hide them.
        """
        warnings = []
        committed_seen = False
        for step, objects in sorted(self._scan().items(), reverse=True):
            if not objects.has_manifest:
                continue
            try:
                manifest = self._read_manifest(step)
                if manifest is None:
                    continue
                committed_seen = True
                self.verify(step, deep=False)
                return self._download(manifest, Path(dest_dir)), manifest, warnings
            except (CheckpointError, ObjectNotFound, ChecksumMismatch) as exc:
                warning = f"skipped checkpoint step {step}: {exc}"
                log.warning("%s", warning)
                warnings.append(warning)
        if not committed_seen and not warnings:
            raise NoCommittedCheckpoint(f"{self.store.url}: no committed checkpoint: train first or check the URL")
        raise CheckpointError(
            f"{self.store.url}: every committed checkpoint is damaged ({'; '.join(warnings)}): "
            "start from scratch or repair the store"
        )
