"""Reading a run's checkpoints in its store: the listing, the manifests (committed means a valid manifest whose files
are all there), the newest commit, evaluations, the nodes' upload records, announcements, notes of set-aside commits,
and verifying a committed step against its manifest. Nothing here writes to the store (commit does, restore reads
into a node's disk)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from pydantic import ValidationError

from infra.checkpoints.layout import (
    EVAL_NAME,
    MANIFEST_NAME,
    NODES_DIR,
    PENDING_DIR,
    SET_ASIDE_DIR,
    Announcement,
    CheckpointError,
    CheckpointManifest,
    EvalRecord,
    NoCommittedCheckpoint,
    NodeRecord,
    SetAside,
    StepStatus,
    eval_key,
    final_key,
    manifest_key,
    node_record_key,
)
from infra.checkpoints.steps import PATTERN as STEP_PATTERN
from infra.checkpoints.steps import parse_step_name, step_name
from infra.storage.base import ObjectNotFound, ObjectStore
from infra.storage.checksum import Checksum, checksum_of_ranges

log = logging.getLogger(__name__)

VERIFY_CHUNK = 8 * 1024 * 1024
_STEP_KEY = re.compile(rf"^{STEP_PATTERN}/(.+)$")
_NODE_RECORD = re.compile(r"^_nodes/node-(\d+)\.json$")


@dataclass
class StepObjects:
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


class CheckpointReader:
    """Checkpoints of one run, as they are in its store (rooted at its checkpoint URL, e.g. file:///…/<run-id>)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    # ---- the listing and the manifests ---------------------------------------------------------------------

    def scan(self) -> dict[int, StepObjects]:
        """Every step with any object in the store, by step: what the listing shows of it."""
        steps: dict[int, StepObjects] = {}
        for info in self.store.list():
            match = _STEP_KEY.match(info.key)
            if not match:
                continue
            objects = steps.setdefault(int(match.group(1)), StepObjects())
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

    def read_manifest(self, step: int) -> CheckpointManifest | None:
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
            return self.read_manifest(step)
        except CheckpointError as exc:
            log.warning("%s", exc)
            return None

    def _whole_manifest(self, step: int, objects: StepObjects, skipped: list[str] | None = None
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
            for step, objects in sorted(self.scan().items())
        ]

    def _committed_newest_first(self, skipped: list[str] | None = None) -> Iterator[CheckpointManifest]:
        """One listing, then manifests read newest first only as far as the caller goes; a damaged step is skipped."""
        for step, objects in sorted(self.scan().items(), reverse=True):
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
            with_manifest = [s for s, objects in self.scan().items() if objects.has_manifest]
            if not with_manifest:
                raise NoCommittedCheckpoint(f"{self.store.url}: no committed checkpoint: train first or check the URL")
            step = max(with_manifest)
        manifest = self.read_manifest(step)
        if manifest is not None:
            return manifest
        raise CheckpointError(
            f"{self.store.url_for(manifest_key(step))}: step {step} is not committed: "
            "pick a committed step (trainpipe ckpt ls) or omit the step"
        )

    # ---- what else the store keeps of a run: evaluations, records, announcements, set-aside notes -----------

    def eval(self, step: int) -> EvalRecord | None:
        """The step's evaluation, None when it was never evaluated."""
        key = eval_key(step)
        try:
            return EvalRecord.model_validate_json(self.store.get_bytes(key))
        except ObjectNotFound:
            return None
        except ValidationError as exc:
            raise CheckpointError(f"{self.store.url_for(key)}: corrupt evaluation ({exc.errors()[0]['msg']}): "
                                  "evaluate the step again or delete it") from None

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

    def is_final(self, attempt: str) -> bool:
        return self.store.head(final_key(attempt)) is not None

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

    # ---- verifying ----------------------------------------------------------------------------------------

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

    def damage(self, step: int, deep: bool) -> str | None:
        """What verify finds wrong with the committed step in the store, or None when it checks out."""
        try:
            self.verify(step, deep=deep)
        except CheckpointError as exc:
            return str(exc)
        return None

    def _checksum(self, key: str, size: int, algorithm: str) -> Checksum:
        chunks = (self.store.get_range(key, start, min(VERIFY_CHUNK, size - start))
                  for start in range(0, size, VERIFY_CHUNK))
        return checksum_of_ranges(chunks, algorithm)

    def source(self, manifest: CheckpointManifest) -> ObjectStore:
        """Where a committed step's files are, each under its path."""
        return self.store.child(f"{step_name(manifest.step)}/{manifest.files_prefix}".rstrip("/"))
