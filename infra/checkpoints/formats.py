"""Which checkpoints in a node's checkpoint dir are complete, by each framework's own completion signal.

A training script writes checkpoints into $TRAINPIPE_CHECKPOINT_DIR however its framework does; the syncer asks
this module what is complete there, and never ships anything half-written:

    dcp, torchtitan  a folder holding `.metadata` (DCP's coordinator writes it once every rank's files are on disk)
    hf               `checkpoint-N/` holding `trainer_state.json` (the Trainer's main process writes it last) and
                     every file name the newest such folder holds (the Trainer's rotation deletes an old folder file
                     by file: one killed mid-delete keeps its trainer_state.json and loses its weights)
    lightning        a closed `*.ckpt` file (symlinks such as `last.ckpt` resolve to their target)
    marker           any file or folder `X` next to `X.complete` (trainpipe_sdk.mark_complete writes it)
    file             one file overwritten in place (`snapshot.pt`): each new closed version is a checkpoint
    auto             whichever of these appears

Only the coordinator node sees these signals for the whole job (DCP's `.metadata`, HF's `trainer_state.json` and
Lightning's files are written by global rank 0). The other nodes learn of a checkpoint from the coordinator's
announcement and ship their own part of the same folder once it has settled (`part_settled`).

"Closed" means no process has the file open for writing (read from /proc), and a file in a known container
format (torch.save's zip, safetensors) must also be whole: a writer killed mid-save leaves a closed, truncated
file, which is never a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

FORMATS = ("auto", "dcp", "hf", "lightning", "torchtitan", "marker", "file")
CheckpointFormat = Literal["auto", "dcp", "hf", "lightning", "torchtitan", "marker", "file"]
Kind = Literal["dir", "file"]

MARKER_SUFFIX = ".complete"
DCP_METADATA = ".metadata"
HF_STATE = "trainer_state.json"
HF_FOLDER = re.compile(r"^checkpoint-(\d+)$")
LIGHTNING_STEP = re.compile(r"step=(\d+)")
TRAILING_NUMBER = re.compile(r"(\d+)\D*$")
# Files that `file` (and `auto`, at the top of the dir) take for a checkpoint written in place.
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors", ".bin")
# How deep checkpoints may sit below the checkpoint dir (torchtitan: <dump>/checkpoint/step-N).
MAX_DEPTH = 4
# Names a framework writes while saving and renames (or deletes) when done: never part of a checkpoint. (Other
# hidden files are: DCP's index is `.metadata`.)
_TEMPORARY = re.compile(r"(^\.tmp|^\..*\.tmp|\.tmp$|\.tmp[-.]|\.part$|\.partial$|~$)")


@dataclass(frozen=True)
class Found:
    """A complete checkpoint in the coordinator's checkpoint dir."""

    name: str  # path relative to the checkpoint dir: "checkpoint-500", "step-00000100", "snapshot.pt"
    kind: Kind
    format: str  # the format whose signal vouched for it (auto resolves to one of the others)
    step: int | None  # from its name or its framework's state; None: the syncer numbers it
    version: int  # mtime_ns of the completion signal: a checkpoint written again is a new version
    # A folder's files when it was found complete (part_files): each must be in the commit, for a framework's own
    # retention may start deleting it between this scan and its upload, leaving a short part that lists consistently.
    files: tuple[str, ...] = ()

    def path(self, ckpt_dir: Path) -> Path:
        return ckpt_dir / self.name


def is_temporary(name: str) -> bool:
    return bool(_TEMPORARY.search(name))


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def step_from_name(name: str) -> int | None:
    """The step a checkpoint's own name carries: Lightning's `step=N`, else the last number in it."""
    base = Path(name).name
    match = LIGHTNING_STEP.search(base) or TRAILING_NUMBER.search(Path(base).stem if "." in base else base)
    return int(match.group(1)) if match else None


# -- open files -------------------------------------------------------------------------------------------------


def files_open_for_writing(root: Path) -> set[Path] | None:
    """Files under root that some process has open for writing; None where /proc cannot tell (not Linux)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    prefix = str(root.resolve()) + os.sep
    found: set[Path] = set()
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(proc / pid / "fd")
        except OSError:  # gone, or not ours to look at
            continue
        for fd in fds:
            try:
                target = os.readlink(proc / pid / "fd" / fd)
                if not target.startswith(prefix):
                    continue
                flags = _fd_flags(proc / pid / "fdinfo" / fd)
            except OSError:
                continue
            if flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
                found.add(Path(target))
    return found


def _fd_flags(fdinfo: Path) -> int:
    for line in fdinfo.read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    return 0


# -- whole files ------------------------------------------------------------------------------------------------


def file_is_whole(path: Path) -> bool:
    """False for an empty file, or one in a known container format that is cut short (a writer killed mid-save)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
            if not head:
                return False  # truncated for a rewrite that has not begun writing: never a checkpoint
            if head[:4] == b"PK\x03\x04":  # torch.save's default (zip) format
                try:
                    with zipfile.ZipFile(handle) as archive:
                        archive.infolist()
                except (zipfile.BadZipFile, OSError, EOFError):
                    return False
                return True
            if path.suffix == ".safetensors" and len(head) == 8:
                header_len = struct.unpack("<Q", head)[0]
                header = json.loads(handle.read(header_len))
                ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
                return path.stat().st_size == 8 + header_len + max(ends, default=0)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return False
    return True


def _valid_json(path: Path) -> bool:
    """The Trainer writes trainer_state.json in place: a writer killed mid-write leaves it there, cut short."""
    try:
        json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return True


# -- detection on the coordinator -------------------------------------------------------------------------------


class Detector:
    """Finds complete checkpoints in one checkpoint dir for one format (auto: any)."""

    def __init__(self, ckpt_dir: Path, fmt: str) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"checkpoint format {fmt!r}: use one of {', '.join(FORMATS)}")
        self.ckpt_dir = ckpt_dir
        self.format = "dcp" if fmt == "torchtitan" else fmt

    def _wants(self, fmt: str) -> bool:
        return self.format in ("auto", fmt)

    def scan(self) -> list[Found]:
        """Complete checkpoints, oldest signal first; what is open for writing or cut short is left out."""
        candidates = list(self._candidates(self.ckpt_dir, depth=1))
        if not candidates:
            return []
        writing = files_open_for_writing(self.ckpt_dir)
        found = [c for c in candidates if self._closed(c, writing)]
        return sorted(_without_rotated_hf(found), key=lambda c: c.version)

    def _closed(self, found: Found, writing: set[Path] | None) -> bool:
        path = found.path(self.ckpt_dir).resolve()
        if found.kind == "dir":
            return writing is None or not any(p.is_relative_to(path) for p in writing)
        if writing is not None and path in writing:
            return False
        return file_is_whole(path)

    def _candidates(self, directory: Path, depth: int) -> Iterator[Found]:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except FileNotFoundError:
            return
        names = {entry.name for entry in entries}
        for entry in entries:
            # Hidden entries of the checkpoint dir itself are not checkpoints (a writer's scratch dir, state files).
            if entry.name.startswith(".") or is_temporary(entry.name) or entry.name.endswith(MARKER_SUFFIX):
                continue
            path = Path(entry.path)
            rel = path.relative_to(self.ckpt_dir).as_posix()
            marked = entry.name + MARKER_SUFFIX in names
            if entry.is_dir(follow_symlinks=False):
                found = self._folder(path, rel, marked)
                if found is not None:
                    yield found
                elif depth < MAX_DEPTH:
                    yield from self._candidates(path, depth + 1)
            elif entry.is_file():
                found = self._file(path, rel, marked, top_level=depth == 1)
                if found is not None:
                    yield found

    def _folder(self, path: Path, rel: str, marked: bool) -> Found | None:
        if marked and self._wants("marker"):
            return self._found(rel, "dir", "marker", Path(str(path) + MARKER_SUFFIX))
        if self._wants("hf") and HF_FOLDER.match(path.name) and _valid_json(path / HF_STATE):
            return self._found(rel, "dir", "hf", path / HF_STATE, int(HF_FOLDER.match(path.name).group(1)))
        if self._wants("dcp") and (path / DCP_METADATA).is_file():
            return self._found(rel, "dir", "dcp", path / DCP_METADATA)
        return None

    def _file(self, path: Path, rel: str, marked: bool, top_level: bool) -> Found | None:
        if marked and self._wants("marker"):
            return self._found(rel, "file", "marker", Path(str(path) + MARKER_SUFFIX))
        if path.is_symlink():
            return None  # `last.ckpt` pointing at a real checkpoint: that one is found under its own name
        if self._wants("lightning") and path.suffix == ".ckpt":
            return self._found(rel, "file", "lightning", path)
        in_place = self.format == "file" or (self.format == "auto" and top_level)
        if in_place and path.suffix in CHECKPOINT_SUFFIXES:
            return self._found(rel, "file", "file", path, step=None)
        return None

    def _found(self, rel: str, kind: Kind, fmt: str, signal: Path, step: int | None = -1) -> Found | None:
        version = _mtime_ns(signal)
        if version is None:
            return None
        files = tuple(part_files(self.ckpt_dir / rel)) if kind == "dir" else ()
        return Found(rel, kind, fmt, step_from_name(rel) if step == -1 else step, version, files)


def _without_rotated_hf(found: list[Found]) -> list[Found]:
    """HF folders missing a file name that the newest HF folder beside them holds are left out.

    The Trainer saves the same files at every step (the weights, optimizer, scheduler and RNG states, then
    trainer_state.json) and its rotation (save_total_limit) deletes the oldest folders with rmtree, in directory
    order: a Trainer killed mid-rotation leaves a folder with a valid trainer_state.json and some of its files gone.
    Rotation only deletes folders older than a complete save, so the newest complete folder is the reference."""
    folders = [f for f in found if f.format == "hf"]
    if len(folders) < 2:
        return found
    newest = max(folders, key=lambda f: f.version)
    torn = {f.name for f in folders if not set(newest.files) <= set(f.files)}
    return [f for f in found if f.name not in torn]


# -- a non-coordinator node's part ------------------------------------------------------------------------------


def part_files(root: Path) -> list[str]:
    """Every file of a checkpoint folder, relative to it, in order (temporary names left out)."""
    if not root.is_dir():
        return []
    # os.walk, not rglob: the script's own retention may delete the folder mid-walk, which ends os.walk's descent
    # quietly (rglob raised FileNotFoundError and ended the syncer); what vanished is then simply not listed.
    found = [Path(folder, name) for folder, _, names in os.walk(root) for name in names]
    files = []
    for path in sorted(found):
        rel = path.relative_to(root)
        if path.is_file() and not any(is_temporary(part) for part in rel.parts):
            files.append(rel.as_posix())
    return files


_DCP_FILE = re.compile(rb"__(\d+)_\d+\.distcp")
_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|rng_state_(\d+)\.pth)$")


def required_files(folder: Path, world_size: int) -> list[str]:
    """Files every node's ranks must have contributed before the checkpoint in this (coordinator's) folder is whole:
    the data files DCP's `.metadata` indexes (their names appear in it as plain strings), and with several ranks the
    per-rank RNG states the HF Trainer writes beside its own."""
    required: set[str] = set()
    metadata = folder / DCP_METADATA
    if metadata.is_file():
        required |= {match.group(0).decode() for match in _DCP_FILE.finditer(metadata.read_bytes())}
    if world_size > 1 and (folder / "rng_state_0.pth").is_file():
        required |= {f"rng_state_{rank}.pth" for rank in range(world_size)}
    return sorted(required)


def rank_of(name: str) -> int | None:
    """The global rank a per-rank checkpoint file belongs to (DCP's __<rank>_<n>.distcp, HF's rng_state_<rank>)."""
    match = _RANK_FILE.match(Path(name).name)
    return int(match.group(1) or match.group(2)) if match else None


def own_required(required: Iterable[str], ranks: Iterable[int]) -> list[str]:
    """Of a checkpoint's required files, the ones this node's ranks write."""
    mine = set(ranks)
    return [name for name in required if rank_of(name) in mine]


def part_settled(ckpt_dir: Path, name: str, fmt: str, expected: Iterable[str]) -> bool:
    """Whether this node's part of an announced folder checkpoint is complete: its own completion marker where
    the format has one per node, the files its ranks must write present, and nothing in it open for writing."""
    root = ckpt_dir / name
    if fmt == "marker" and root.exists() and not Path(str(root) + MARKER_SUFFIX).exists():
        return False
    if any(not (root / rel).is_file() for rel in expected):
        return False
    writing = files_open_for_writing(ckpt_dir) if root.exists() else set()
    if writing is not None and any(p.is_relative_to(root.resolve()) for p in writing):
        return False
    return all(file_is_whole(root / rel) for rel in part_files(root) if rel.endswith((".pt", ".pth", ".ckpt")))
