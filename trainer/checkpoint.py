"""Checkpoints on node-local disk with torch.distributed.checkpoint (DCP), marked complete per node.

Layout under each node's own ckpt_root (nodes share no filesystem):

    step-00000040/            this node's ranks' DCP files (__<rank>_<n>.distcp); the node of global rank 0
                              also holds .metadata, which indexes the files of *every* node
    step-00000040.complete    JSON marker written last, atomically, by the node's local rank 0

A syncer uploads only steps that have a marker, so a step torn by a crash is never shipped. Loading reads a
step dir that holds the files of all nodes (merged from the store), with any number of ranks.

This module is usable from a user's own training script: save_checkpoint / load_checkpoint under torchrun,
inspect_checkpoint anywhere (no process group, no model).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

METADATA_NAME = ".metadata"
MARKER_SUFFIX = ".complete"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_MARKER = re.compile(r"^step-(\d{8})\.complete$")
# Top-level keys of the DCP state dict; "extra" holds a JSON string so its keys need not be known to load it.
_MODEL_KEY, _OPTIM_KEY, _EXTRA_KEY = "model", "optim", "extra"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or trusted; the message names the file and the fix."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def marker_path(ckpt_root: Path, step: int) -> Path:
    return ckpt_root / f"{step_dir_name(step)}{MARKER_SUFFIX}"


def parse_step_dir(path: Path) -> int | None:
    """The step a `step-NNNNNNNN` directory name stands for, or None for any other name."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def complete_steps(ckpt_root: Path) -> list[int]:
    """Steps with a completion marker in ckpt_root, oldest first: the only ones a syncer may trust."""
    if not ckpt_root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in ckpt_root.iterdir() if (m := _MARKER.match(p.name)))


def read_marker(ckpt_root: Path, step: int) -> dict[str, Any]:
    path = marker_path(ckpt_root, step)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no completion marker: step {step} was never completed on this node") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: corrupt completion marker ({exc.msg}): delete it and the step dir") from None


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Readers see the old file or the whole new one, never a torn write (tmp + fsync + rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        json.dump(payload, handle, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise CheckpointError(f"environment variable {name}={value!r} is not an integer: use torchrun") from None


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    keep_local: int | None = None,
) -> Path:
    """Collective: every rank calls it. Writes ckpt_root/step-NNNNNNNN/ and this node's completion marker.

    `extra` must be JSON-serialisable (step, data position, losses). With keep_local, the node then keeps
    only its newest keep_local complete steps.
    """
    if keep_local is not None and keep_local < 1:
        raise CheckpointError(f"keep_local={keep_local}: keep at least 1 local checkpoint (--keep-local >= 1)")
    is_node_leader = _env_int("LOCAL_RANK", 0) == 0
    step_dir = ckpt_root / step_dir_name(step)
    if is_node_leader:
        # A marker left by an earlier attempt at this step would vouch for files about to be overwritten.
        marker_path(ckpt_root, step).unlink(missing_ok=True)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {_MODEL_KEY: model_state, _OPTIM_KEY: optim_state, _EXTRA_KEY: json.dumps(extra, sort_keys=True)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(step_dir))
    # Every local rank's files must be on disk before the marker lists them.
    _barrier()
    if is_node_leader:
        files = sorted(p.name for p in step_dir.iterdir() if p.is_file())
        marker = {
            "step": step,
            "world_size": _env_int("WORLD_SIZE", 1),
            "node_rank": _env_int("GROUP_RANK", 0),
            "files": files,
        }
        write_json_atomic(marker_path(ckpt_root, step), marker)
        if keep_local is not None:
            prune_local(ckpt_root, keep_local)
    return step_dir


def prune_local(ckpt_root: Path, keep_local: int) -> list[int]:
    """Delete all but the newest keep_local complete steps; returns the steps deleted."""
    if keep_local < 1:
        raise CheckpointError(f"keep_local={keep_local}: keep at least 1 local checkpoint (--keep-local >= 1)")
    doomed = complete_steps(ckpt_root)[:-keep_local]
    for step in doomed:
        # Marker first: a step dir without a marker is ignored by syncers, a marker without its files is not.
        marker_path(ckpt_root, step).unlink()
        shutil.rmtree(ckpt_root / step_dir_name(step))
    return doomed


def _read_metadata(step_dir: Path) -> Metadata:
    path = step_dir / METADATA_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing: the step dir needs the files of every node, including the coordinator's .metadata"
        )
    try:
        return dcp.FileSystemReader(step_dir).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc}): re-download the checkpoint") from exc


def _files_by_key(step_dir: Path, metadata: Metadata) -> dict[str, set[str]]:
    """State-dict key -> the files holding it, after checking every file exists and is long enough."""
    needed_size: dict[str, int] = defaultdict(int)
    files_by_key: dict[str, set[str]] = defaultdict(set)
    for index, info in metadata.storage_data.items():
        needed_size[info.relative_path] = max(needed_size[info.relative_path], info.offset + info.length)
        files_by_key[index.fqn].add(info.relative_path)
    for name, size in sorted(needed_size.items()):
        path = step_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing: copy the files of every node's {step_dir.name} into {step_dir}")
        actual = path.stat().st_size
        if actual < size:
            raise CheckpointError(f"{path}: truncated ({actual} of {size} bytes): re-download the checkpoint")
    return files_by_key


def load_checkpoint(step_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: loads model and optimizer state in place (any world size) and returns the saved `extra`."""
    _files_by_key(step_dir, _read_metadata(step_dir))
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {_MODEL_KEY: model_state, _OPTIM_KEY: optim_state, _EXTRA_KEY: ""}
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(step_dir))
    except dcp.CheckpointException as exc:
        raise CheckpointError(
            f"{step_dir}: does not fit this model/optimizer ({_cause(exc)}): "
            "resume with the model config it was saved with"
        ) from exc
    set_state_dict(model, optimizer, model_state_dict=state[_MODEL_KEY], optim_state_dict=state[_OPTIM_KEY])
    return json.loads(state[_EXTRA_KEY])


def _cause(exc: BaseException) -> str:
    """One short line for an error, looking through DCP's per-rank wrapper to the first real failure."""
    if isinstance(exc, dcp.CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160]}" if lines else type(exc).__name__


def inspect_checkpoint(step_dir: Path) -> dict[str, Any]:
    """Reads every value of a complete step dir in this process alone: {step, num_tensors, num_params, bytes}.

    Each file's values are loaded separately so a failure names the file it came from.
    """
    metadata = _read_metadata(step_dir)
    files_by_key = _files_by_key(step_dir, metadata)
    keys_by_files: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for key, files in files_by_key.items():
        keys_by_files[tuple(sorted(files))].append(key)
    values: dict[str, Any] = {}
    for files, keys in sorted(keys_by_files.items()):
        values.update(_load_keys(step_dir, metadata, files, keys))
    if _EXTRA_KEY not in values:
        raise CheckpointError(f"{step_dir / METADATA_NAME}: no '{_EXTRA_KEY}' entry: not a trainpipe checkpoint")
    extra = json.loads(values[_EXTRA_KEY])
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    num_params = sum(v.size.numel() for k, v in tensors.items() if k.startswith(f"{_MODEL_KEY}."))
    referenced = {name for files in keys_by_files for name in files} | {METADATA_NAME}
    return {
        "step": int(extra["step"]),
        "num_tensors": len(tensors),
        "num_params": num_params,
        "bytes": sum((step_dir / name).stat().st_size for name in referenced),
    }


def _load_keys(step_dir: Path, metadata: Metadata, files: tuple[str, ...], keys: list[str]) -> dict[str, Any]:
    template: dict[str, Any] = {}
    for key in keys:
        entry = metadata.state_dict_metadata[key]
        if isinstance(entry, BytesStorageMetadata):
            template[key] = None
        else:
            template[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    try:
        with warnings.catch_warnings():
            # Loading without a process group is the point here; DCP warns about it on every call.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                template,
                storage_reader=dcp.FileSystemReader(step_dir),
                # Keys are already the flat names the metadata holds; without flattening, the planner also
                # fills non-tensor values into this very dict instead of a copy.
                planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                no_dist=True,
            )
    # CheckpointException derives from BaseException, so it needs naming on its own.
    except (dcp.CheckpointException, Exception) as exc:
        names = ", ".join(str(step_dir / f) for f in files)
        raise CheckpointError(f"{names}: corrupt ({_cause(exc)}): re-download the checkpoint") from exc
    return template
