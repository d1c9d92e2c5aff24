"""One object over a run's checkpoints for its callers: what reading has (listing, manifests, latest, records,
verify), and the writes of commit and the restores of restore, each a call through to its module. The layout and
records are infra.checkpoints.layout."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

from infra.checkpoints import commit, restore
from infra.checkpoints.layout import Announcement, CheckpointManifest, CheckpointRef, EvalRecord, FileEntry, NodeRecord
from infra.checkpoints.lineage import Lineage
from infra.checkpoints.reading import CheckpointReader
from infra.checkpoints.restore import Fill


class CheckpointStore(CheckpointReader):
    """Checkpoints of one run, rooted at its checkpoint URL (e.g. file:///…/checkpoints/<run-id>)."""

    def announce(self, announcement: Announcement) -> None:
        commit.announce(self, announcement)

    def withdraw(self, step: int) -> None:
        commit.withdraw(self, step)

    def announce_final(self, attempt: str) -> None:
        commit.announce_final(self, attempt)

    def upload_files(self, local_root: Path, step: int, files: Sequence[str], attempt: str = "") -> list[FileEntry]:
        return commit.upload_files(self, local_root, step, files, attempt)

    def write_record(self, step: int, node_rank: int, files: list[FileEntry], attempt: str = "",
                     replica_url: str | None = None) -> NodeRecord:
        return commit.write_record(self, step, node_rank, files, attempt, replica_url)

    def upload_node_part(self, local_root: Path, step: int, node_rank: int, files: Sequence[str],
                         attempt: str = "") -> NodeRecord:
        return commit.upload_node_part(self, local_root, step, node_rank, files, attempt)

    def try_commit(self, step: int, nodes: int | Sequence[int], world_size: int, config_hash: str,
                   attempt: str = "", checkpoint: CheckpointRef | None = None,
                   required: Sequence[str] = (), lineage: Lineage | None = None) -> CheckpointManifest | None:
        return commit.try_commit(self, step, nodes, world_size, config_hash, attempt, checkpoint, required, lineage)

    def record_eval(self, step: int, metrics: dict[str, float], command: str) -> EvalRecord:
        return commit.record_eval(self, step, metrics, command)

    def apply_retention(self, keep: int, protected: Collection[int] = (), attempt: str = "") -> list[int]:
        return commit.apply_retention(self, keep, protected, attempt)

    def restore(self, dest_dir: Path, step: int | None = None, fill: Fill | None = None) -> Path:
        return restore.restore(self, dest_dir, step, fill)

    def restore_latest(self, dest_dir: Path, fill: Fill | None = None) -> tuple[Path, CheckpointManifest, list[str]]:
        return restore.restore_latest(self, dest_dir, fill)
