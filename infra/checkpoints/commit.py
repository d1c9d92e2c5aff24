"""The checkpoint commit protocol in the object store: a step exists for readers only once its manifest does; and
what takes commits away again, without ever losing a good one (set-aside, retention).

The coordinator announces a complete checkpoint, every node uploads its part under its attempt's own prefix and
writes its record, and the manifest is written once every record of this attempt exists (try_commit); `latest`
follows it. Because the manifest is written last and deleted first, a crash at any instant leaves every committed
checkpoint either whole or invisible. Records carry the attempt that wrote them and a commit takes only the current
attempt's, so a step retrained after a resume is never committed with a dead attempt's files. `latest` is a hint for
outside readers (it may lag one commit behind after a crash); trainpipe itself lists manifests (reading).

A damaged commit (a file missing, short, or with other bytes than its manifest says) is set aside, never deleted:
its manifest moves into a note under `_set_aside/` and its files stay where they are, so no reader, listing, `latest`
or retention counts it again, and a retrain of that step writes its own attempt's prefix beside them. Each attempt
having its own prefix is what keeps a retrained step from ever being a mix of two attempts' files. Layout:
infra.checkpoints.layout.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection, Sequence
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from infra.checkpoints.layout import (
    LATEST_KEY,
    MANIFEST_NAME,
    NODES_DIR,
    SET_ASIDE_DIR,
    Announcement,
    CheckpointError,
    CheckpointManifest,
    CheckpointRef,
    EvalRecord,
    FileEntry,
    LatestPointer,
    NodeRecord,
    SetAside,
    announcement_key,
    eval_key,
    files_prefix,
    final_key,
    manifest_key,
    node_record_key,
)
from infra.checkpoints.lineage import Lineage
from infra.checkpoints.protected import ProtectedSteps
from infra.checkpoints.reading import CheckpointReader, StepObjects
from infra.checkpoints.steps import step_name
from infra.storage.base import ObjectNotFound
from infra.storage.checksum import sha256_file
from infra.storage.transfer import upload

log = logging.getLogger(__name__)


# ---- announcing (the coordinator) --------------------------------------------------------------------------------

def announce(checkpoints: CheckpointReader, announcement: Announcement) -> None:
    checkpoints.store.put_bytes(announcement_key(announcement.step), announcement.model_dump_json().encode())


def withdraw(checkpoints: CheckpointReader, step: int) -> None:
    """A checkpoint that will never be committed: the nodes stop waiting to ship it."""
    checkpoints.store.delete(announcement_key(step))


def announce_final(checkpoints: CheckpointReader, attempt: str) -> None:
    """The coordinator is stopping: nothing more will be announced in this attempt."""
    checkpoints.store.put_bytes(final_key(attempt), b"{}")


# ---- a node's part: its files, then its record -------------------------------------------------------------------

def upload_files(checkpoints: CheckpointReader, local_root: Path, step: int, files: Sequence[str],
                 attempt: str = "") -> list[FileEntry]:
    """Upload a node's files of a checkpoint (paths relative to local_root) under the attempt's own prefix; no
    record yet."""
    # The syncer's check of a file rewritten in place still compares sha256 (infra/node/sync.py
    # `_still_as_uploaded`): taken before the upload, so a file that changes during it cannot match afterwards.
    # Drop it once that check compares `entry.checksum`, the CRC of the bytes the store received.
    sha256 = {rel: sha256_file(Path(local_root) / rel) for rel in files}
    under = checkpoints.store.child(f"{step_name(step)}/{files_prefix(attempt)}")
    result = upload(Path(local_root), list(files), under)
    return [FileEntry(path=item.key, bytes=item.size, crc=item.crc, sha256=sha256[item.key])
            for item in result.files]


def write_record(checkpoints: CheckpointReader, step: int, node_rank: int, files: list[FileEntry], attempt: str = "",
                 replica_url: str | None = None) -> NodeRecord:
    """The node's part is in the store: the record is what the committer waits for (and, with replica_url, what
    the node's replica holder pulls from where)."""
    record = NodeRecord(node_rank=node_rank, attempt=attempt, files=files, replica_url=replica_url)
    checkpoints.store.put_bytes(node_record_key(step, node_rank), record.model_dump_json().encode())
    return record


def upload_node_part(checkpoints: CheckpointReader, local_root: Path, step: int, node_rank: int, files: Sequence[str],
                     attempt: str = "") -> NodeRecord:
    """Upload this node's files of a checkpoint, then its record."""
    files_in_store = upload_files(checkpoints, local_root, step, files, attempt)
    return write_record(checkpoints, step, node_rank, files_in_store, attempt)


# ---- the commit, and `latest` ------------------------------------------------------------------------------------

def try_commit(checkpoints: CheckpointReader, step: int, nodes: int | Sequence[int], world_size: int, config_hash: str,
               attempt: str = "", checkpoint: CheckpointRef | None = None,
               required: Sequence[str] = (), lineage: Lineage | None = None) -> CheckpointManifest | None:
    """Write the manifest once the records of `nodes` (a count, or the ranks) from this attempt all exist (None
    until then); idempotent after a crash. CheckpointError when the parts lack a required file: such a
    checkpoint could not be loaded, so it is never committed.

    A manifest already there from another attempt (or unreadable) is not this commit: this attempt resumed
    from an older step and retrained this one, so once its own parts are all in, that commit is set aside (kept,
    and named in the log) and this attempt's is written in its place."""
    try:
        existing = checkpoints.read_manifest(step)
        unreadable = None
    except CheckpointError as exc:
        existing, unreadable = None, str(exc)
    if existing is not None and existing.attempt == attempt:
        _advance_latest(checkpoints, existing)
        return existing
    ranks = list(range(nodes) if isinstance(nodes, int) else nodes)
    records = []
    for rank in ranks:
        record = checkpoints.current_record(step, rank, attempt)
        if record is None:
            return None
        records.append(record)
    files = _union(checkpoints, step, records, attempt)
    missing = sorted(set(required) - {entry.path for entry in files})
    if missing:
        raise CheckpointError(
            f"{checkpoints.store.url_for(step_name(step))}: the nodes' parts lack {', '.join(missing[:5])}"
            f"{' …' if len(missing) > 5 else ''}: a node lost its part (deleted locally?): step {step} is not "
            "committed"
        )
    _check_uploaded(checkpoints, step, files, attempt)
    if unreadable is not None:
        set_aside(checkpoints, step, unreadable, keep_prefix=files_prefix(attempt))
    elif existing is not None:
        set_aside(checkpoints, step, f"committed by attempt {existing.attempt!r}, but attempt {attempt!r} resumed "
                  "from an older step and retrained it: the retrained step replaces it")
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
    checkpoints.store.put_bytes(manifest_key(step), manifest.model_dump_json(indent=1).encode())
    _advance_latest(checkpoints, manifest)
    checkpoints.store.delete(announcement_key(step))
    return manifest


def _check_uploaded(checkpoints: CheckpointReader, step: int, files: list[FileEntry], attempt: str) -> None:
    """Every file the manifest will list is in the store at its recorded size: a record says what a node uploaded,
    not that it is still there (retention, a lifecycle rule or a person may have deleted it since), and a manifest
    over a missing file would be a commit that cannot be restored."""
    under = f"{step_name(step)}/{files_prefix(attempt)}"
    sizes = {info.key.removeprefix(under): info.size for info in checkpoints.store.list(under)}
    for entry in files:
        size = sizes.get(entry.path)
        if size != entry.bytes:
            found = "is missing" if size is None else f"has {size} bytes, its record says {entry.bytes}"
            raise CheckpointError(f"{checkpoints.store.url_for(under + entry.path)} {found}: step {step} is not "
                                  "committed (a newer commit or the next attempt's is)")


def _union(checkpoints: CheckpointReader, step: int, records: list[NodeRecord], attempt: str) -> list[FileEntry]:
    by_path: dict[str, FileEntry] = {}
    for record in records:
        for entry in record.files:
            other = by_path.setdefault(entry.path, entry)
            if other != entry:
                raise CheckpointError(
                    f"{checkpoints.store.url_for(step_name(step) + '/' + files_prefix(attempt) + entry.path)}: two "
                    "nodes uploaded different contents: each node must write distinct file names (check the "
                    "script's node ranks)"
                )
    return sorted(by_path.values(), key=lambda entry: entry.path)


def _advance_latest(checkpoints: CheckpointReader, manifest: CheckpointManifest) -> None:
    # Only forward: a re-run commit of an older step (a restarted committer) must not move readers back.
    current = checkpoints.latest()
    if current is not None and current.step > manifest.step:
        return
    _point_latest_at(checkpoints, manifest)


def _point_latest_at(checkpoints: CheckpointReader, manifest: CheckpointManifest | None) -> None:
    if manifest is None:
        checkpoints.store.delete(LATEST_KEY)
        return
    pointer = LatestPointer(step=manifest.step, manifest=manifest_key(manifest.step), attempt=manifest.attempt)
    checkpoints.store.put_bytes(LATEST_KEY, pointer.model_dump_json().encode())


def record_eval(checkpoints: CheckpointReader, step: int, metrics: dict[str, float], command: str) -> EvalRecord:
    """Write a committed step's evaluation beside its manifest (step-N/eval.json); a re-evaluation replaces it."""
    checkpoints.manifest(step)
    record = EvalRecord(step=step, metrics=metrics, command=command,
                        recorded_at=datetime.now(UTC).isoformat(timespec="seconds"))
    checkpoints.store.put_bytes(eval_key(step), record.model_dump_json(indent=1).encode())
    return record


# ---- setting a commit aside --------------------------------------------------------------------------------------

def set_aside(checkpoints: CheckpointReader, step: int, reason: str, keep_prefix: str | None = None
              ) -> SetAside | None:
    """Take the step's commit out of the checkpoints without deleting anything of it; None when it has no
    manifest (nothing committed, or another node set it aside first).

    The note (its manifest, its files' keys, the reason) is written before the manifest is deleted, so a crash
    in between leaves the step to be set aside again under the same note. Its files stay in place: a retrain of
    the step uploads under its own attempt's prefix (keep_prefix, never counted as the set-aside commit's)."""
    key = manifest_key(step)
    try:
        raw = checkpoints.store.get_bytes(key)
    except ObjectNotFound:
        return None
    try:
        manifest: CheckpointManifest | None = CheckpointManifest.model_validate_json(raw)
    except ValidationError:
        manifest = None
    under = f"{step_name(step)}/"
    present = [info.key for info in checkpoints.store.list(under)]
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
    checkpoints.store.put_bytes(note_key, note.model_dump_json(indent=1).encode())
    checkpoints.store.delete(key)
    log.warning("set aside step %d (%d files kept in place, see %s): %s", step, len(keys),
                checkpoints.store.url_for(note_key), reason)
    _repoint_latest_from(checkpoints, step)
    return note


def _repoint_latest_from(checkpoints: CheckpointReader, step: int) -> None:
    """`latest` named a commit that is gone: it names the newest committed step now (back, this once)."""
    try:
        pointer = LatestPointer.model_validate_json(checkpoints.store.get_bytes(LATEST_KEY))
    except ObjectNotFound:
        return
    except ValidationError:
        pointer = None
    if pointer is None or pointer.step == step:
        _point_latest_at(checkpoints, checkpoints.latest())


# ---- retention ---------------------------------------------------------------------------------------------------

def apply_retention(checkpoints: CheckpointReader, keep: int, protected: Collection[int] = (),
                    attempt: str = "") -> list[int]:
    """Delete committed steps beyond the newest `keep` and uncommitted ones older than the newest committed,
    never a `protected` one (a step a model alias points at, or pointed at recently: Registry.protected), and never
    an uncommitted step the current `attempt` is writing: an attempt that resumed from below a newer commit (one it
    could not restore) uploads steps below it, which are its work in flight, not a dead attempt's leftovers.

    Returns the deleted steps. Nothing newer than the newest committed step is touched: it may be mid-upload.
    A commit found damaged (unreadable manifest, a file missing or of another size) is set aside first, so it
    never counts as one of the `keep`, never as the newest, and is never deleted: a good commit is not lost
    because a damaged one looked newer. The files of set-aside commits stay when their step's other files go.
    """
    if keep < 1:
        raise ValueError(f"keep={keep}: must be at least 1 so the newest committed checkpoint survives")
    steps = checkpoints.scan()
    committed = [step for step, objects in steps.items() if _good_or_set_aside(checkpoints, step, objects)]
    if not committed:
        return []
    newest = max(committed)
    keep_steps = set(sorted(committed, reverse=True)[:keep])
    in_flight = _in_flight(checkpoints, steps, committed, attempt) if attempt else set()
    doomed = sorted(step for step in steps if step < newest and step not in keep_steps and step not in protected
                    and step not in in_flight)
    kept_keys = {key for note in checkpoints.set_aside_notes() for key in note.keys} if doomed else set()
    deleted: list[int] = []
    for step in doomed:
        # The manifest goes first, so a crash mid-delete leaves an uncommitted (ignored) step, never a
        # "committed" one with files missing.
        if not _uncommit_unless_protected(checkpoints, step, protected):
            log.info("retention: kept %s: an alias moved to it meanwhile", checkpoints.store.url_for(step_name(step)))
            continue
        under = f"{step_name(step)}/"
        if any(key.startswith(under) for key in kept_keys):
            for info in checkpoints.store.list(under):
                if info.key not in kept_keys:
                    checkpoints.store.delete(info.key)
        else:
            checkpoints.store.delete_prefix(under)
        checkpoints.store.delete(announcement_key(step))
        log.info("retention: deleted %s", checkpoints.store.url_for(step_name(step)))
        deleted.append(step)
    return deleted


def _in_flight(checkpoints: CheckpointReader, steps: dict[int, StepObjects], committed: list[int],
               attempt: str) -> set[int]:
    """The uncommitted steps this attempt has uploaded to or announced above its own newest commit: a step of its
    own below that is one it gave up on (a newer one was committed in its place)."""
    own = [step for step in committed if (manifest := checkpoints.read_manifest(step)) and manifest.attempt == attempt]
    newest_own = max(own, default=-1)
    prefix = files_prefix(attempt)
    uploading = {step for step, objects in steps.items()
                 if not objects.has_manifest and any(key.startswith(prefix) for key in objects.sizes)}
    announced = {announcement.step for announcement in checkpoints.announcements(attempt)}
    return {step for step in uploading | announced if step > newest_own}


def _uncommit_unless_protected(checkpoints: CheckpointReader, step: int, protected: Collection[int]) -> bool:
    """Delete the step's manifest, then, when the protected steps can be read again (ProtectedSteps), read them and
    put the manifest back if an alias reached the step meanwhile. With the promotion's own check after its move is
    written (Registry), one of the two always sees the other: a promotion whose move is in this second reading
    keeps the step; one whose move comes later finds the manifest gone and undoes its move. Whether the step is
    uncommitted now (its files may go)."""
    key = manifest_key(step)
    if not isinstance(protected, ProtectedSteps):
        checkpoints.store.delete(key)
        return True
    try:
        manifest = checkpoints.store.get_bytes(key)
    except ObjectNotFound:
        return True  # never committed (or already uncommitted): no alias can point at it
    checkpoints.store.delete(key)
    try:
        protected_now = step in protected.reread()
    except BaseException:
        # Unknown whether an alias reaches it now: it stays committed, and the failure is the caller's to see.
        checkpoints.store.put_bytes(key, manifest)
        raise
    if protected_now:
        checkpoints.store.put_bytes(key, manifest)
    return not protected_now


def _good_or_set_aside(checkpoints: CheckpointReader, step: int, objects: StepObjects) -> bool:
    """Whether the step is committed and whole in the listing; a damaged commit (confirmed by its files' heads,
    not only by a listing that may be a moment old) is set aside."""
    if not objects.has_manifest:
        return False
    try:
        manifest = checkpoints.read_manifest(step)
    except CheckpointError as exc:
        set_aside(checkpoints, step, str(exc))
        return False
    if manifest is None:
        return False
    if objects.damage(manifest) is None:
        return True
    damage = checkpoints.damage(step, deep=False)
    if damage is None:
        return True
    set_aside(checkpoints, step, damage)
    return False
