"""Restoring a committed checkpoint onto a node's disk: one step, or the newest that verifies.

Every file is verified against the manifest on its way down, and valid files already in the folder stay. How the
files reach the folder is a fill: one download from the store (StoreFill), or the node's peers
(infra.node.peerrestore.PeerFill). A step found damaged in the store is set aside (infra.checkpoints.commit) and the
restore falls back to the next older one.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infra.checkpoints.commit import set_aside
from infra.checkpoints.layout import SET_ASIDE_DIR, CheckpointError, CheckpointManifest, NoCommittedCheckpoint
from infra.checkpoints.reading import CheckpointReader
from infra.storage.base import ChecksumMismatch, ObjectNotFound
from infra.storage.transfer import FileSpec, download

log = logging.getLogger(__name__)


# Fills a committed step's folder with its files, each verified against the manifest (infra/node/peerrestore.py);
# raises ObjectNotFound or ChecksumMismatch for a file the store does not have whole, as the store's download does.
Fill = Callable[[CheckpointReader, CheckpointManifest, Path], None]


@dataclass
class StoreFill:
    """The fill of a restore without peers: the step's files in one download from the store, each verified; the
    valid files already in the folder stay. Counts the bytes by where they came from (a restore that falls back to
    an older step adds that step's)."""

    store_bytes: int = 0  # downloaded
    local_bytes: int = 0  # already there, verified

    def __call__(self, checkpoints: CheckpointReader, manifest: CheckpointManifest, folder: Path) -> None:
        specs = [FileSpec(entry.path, entry.bytes, entry.sha256, entry.crc) for entry in manifest.files]
        result = download(checkpoints.source(manifest), specs, folder)
        self.store_bytes += result.bytes_moved
        self.local_bytes += result.bytes_skipped
        log.info("restored step %d into %s: %d files, %d skipped, %.1f MB/s", manifest.step, folder,
                 len(result.files), result.files_skipped, result.mb_per_s)

    @property
    def sources(self) -> dict[str, int]:
        return {"store": self.store_bytes, "local": self.local_bytes}


def restore(checkpoints: CheckpointReader, dest_dir: Path, step: int | None = None, fill: Fill | None = None
            ) -> Path:
    """Download a committed step into dest_dir/<its name>, verified; valid files already there stay.

    Returns that path: the checkpoint's folder, or its file for a checkpoint that is one file. fill: how the
    files reach the folder instead of one download from the store (a restore from peers)."""
    manifest = checkpoints.verify(step, deep=False)
    return _download(checkpoints, manifest, Path(dest_dir), fill)


def restore_latest(checkpoints: CheckpointReader, dest_dir: Path, fill: Fill | None = None
                   ) -> tuple[Path, CheckpointManifest, list[str]]:
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
    for step, objects in sorted(checkpoints.scan().items(), reverse=True):
        if not objects.has_manifest:
            continue
        manifest = None
        try:
            manifest = checkpoints.read_manifest(step)
            if manifest is None:
                continue
            committed_seen = True
            checkpoints.verify(step, deep=False)
            path = _download(checkpoints, manifest, Path(dest_dir), None if damaged_in_download else fill)
            return path, manifest, warnings + _set_aside_above(checkpoints, step, skipped)
        except CheckpointError as exc:
            warning = _skipped(checkpoints, step, str(exc))
        except (ObjectNotFound, ChecksumMismatch) as exc:
            # The store's bytes, or only the download's? Only the store's own damage is set aside.
            damaged_in_download = True
            damage = checkpoints.damage(step, deep=True)
            warning = (f"skipped checkpoint step {step}: {exc} (the store's copy verifies: the download was "
                       "damaged, not the checkpoint)") if damage is None else _skipped(checkpoints, step, damage)
        log.warning("%s", warning)
        warnings.append(warning)
        skipped.add(step)
        if manifest is not None:
            _discard(Path(dest_dir) / manifest.ref.name)
    if not committed_seen and not warnings:
        raise NoCommittedCheckpoint(f"{checkpoints.store.url}: no committed checkpoint: train first or check the URL")
    raise CheckpointError(
        f"{checkpoints.store.url}: every committed checkpoint is damaged ({'; '.join(warnings)}): "
        "start from scratch or repair the store"
    )


def _download(checkpoints: CheckpointReader, manifest: CheckpointManifest, dest_dir: Path, fill: Fill | None = None
              ) -> Path:
    ref = manifest.ref
    target = dest_dir / ref.name
    # A file checkpoint's one file sits beside its siblings: download into its folder, under its own name.
    folder = target if ref.kind == "dir" else target.parent
    (fill or StoreFill())(checkpoints, manifest, folder)
    log.info("restored step %d into %s", manifest.step, target)
    return target


def _skipped(checkpoints: CheckpointReader, step: int, damage: str) -> str:
    """A resume's word on a damaged step it skipped, once the step is set aside."""
    note = set_aside(checkpoints, step, damage)
    notes = checkpoints.store.url_for(SET_ASIDE_DIR)
    where = f"; set aside, its files kept (see {notes}/)" if note is not None else ""
    return f"skipped checkpoint step {step}: {damage}{where}"


def _set_aside_above(checkpoints: CheckpointReader, step: int, skipped: set[int]) -> list[str]:
    """The resume's word on commits above its step that were set aside before it looked (by another node's
    restore, say), so every node says why it resumed where it did."""
    return [f"skipped checkpoint step {note.step}: set aside at {note.set_aside_at}: {note.reason}"
            for note in checkpoints.set_aside_notes() if note.step > step and note.step not in skipped]


def _discard(path: Path) -> None:
    """Remove a skipped checkpoint's local folder or file, saying so."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    else:
        return
    log.warning("removed %s: the checkpoint it holds was skipped", path)
