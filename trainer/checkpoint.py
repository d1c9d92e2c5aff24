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
import shutil
import threading
import time
import warnings
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from infra.checkpoints.layout import CheckpointError as StoreCheckpointError
from infra.checkpoints.steps import parse_step_name, step_name
from infra.checkpoints.upload_lease import UPLOAD_LEASE, leased_step
from infra.node.sync import SyncError, read_state, state_path
from infra.workload.contract import SYNC_DIR_VAR

METADATA_NAME = ".metadata"
MARKER_SUFFIX = ".complete"
# Top-level keys of the DCP state dict; "extra" holds a JSON string so its keys need not be known to load it.
_MODEL_KEY, _OPTIM_KEY, _EXTRA_KEY = "model", "optim", "extra"
# direct saves as sync does; the trainer then also waits for the node's syncer to upload the step (wait_for_upload).
SAVE_MODES = ("async", "sync", "direct")
# How often a direct-mode wait looks at the syncer's state file: small beside an upload, cheap (one small read).
UPLOAD_POLL_S = 0.01
WARMUP_DIR = ".writer-warmup"  # not a step: syncers never look at it
# The trainer's public name for a step's dir (users' scripts, tests and benches import it); the naming is the store's.
step_dir_name = step_name


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or trusted; the message names the file and the fix."""


def marker_path(ckpt_root: Path, step: int) -> Path:
    return ckpt_root / f"{step_name(step)}{MARKER_SUFFIX}"


def parse_step_dir(path: Path) -> int | None:
    """The step a `step-NNNNNNNN` directory name stands for, or None for any other name."""
    return parse_step_name(path.name)


def complete_steps(ckpt_root: Path) -> list[int]:
    """Steps with a completion marker in ckpt_root, oldest first: the only ones a syncer may trust."""
    if not ckpt_root.is_dir():
        return []
    return sorted(step for p in ckpt_root.iterdir() if (step := parse_step_name(p.name, MARKER_SUFFIX)) is not None)


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


@dataclass(frozen=True)
class SaveRecord:
    """One finished save: how long training was blocked, how long the write to local disk took, what it wrote."""

    step: int
    mode: str
    stall_s: float  # the training loop was blocked this long (waiting for the previous save + staging, or all)
    write_s: float  # from staging (after any wait for the previous save) until the files were on disk and marked
    bytes: int  # this node's files of the step

    def to_event(self) -> dict[str, Any]:
        return {"event": "checkpoint", **asdict(self)}


@dataclass
class _InFlight:
    step: int
    stall_s: float
    done: Future[SaveRecord]


class Checkpointer:
    """Collective saves of one training run to node-local disk, synchronous or in the background.

    async: the state is copied into a CPU staging buffer (pinned when CUDA is there) that is reused across
    saves, then `dcp.async_save` writes it in a background thread while training goes on. At most one save is
    in flight: the next one waits for it, because it would overwrite the staging buffer being written.
    sync: `dcp.save` blocks until the files are on disk (kept to measure what async saves).
    direct: saves as sync does (the wait for the upload is wait_for_upload's, called by the training loop).
    Either way this node's completion marker is written only once its files are whole, so a syncer never
    ships a partial step. Every rank must construct it (the async mode creates a process group).
    """

    def __init__(
        self, ckpt_root: Path, mode: str = "async", keep_local: int | None = None, timeout_s: float | None = None
    ) -> None:
        """timeout_s bounds the background writer's collectives (a dead peer); None keeps torch's default."""
        if mode not in SAVE_MODES:
            raise CheckpointError(f"checkpoint mode {mode!r}: use one of {', '.join(SAVE_MODES)} (--ckpt-mode)")
        if keep_local is not None and keep_local < 1:
            raise CheckpointError(f"keep_local={keep_local}: keep at least 1 local checkpoint (--keep-local >= 1)")
        self.ckpt_root = ckpt_root
        self.mode = mode
        self.keep_local = keep_local
        self.is_node_leader = _env_int("LOCAL_RANK", 0) == 0
        ckpt_root.mkdir(parents=True, exist_ok=True)
        self._in_flight: _InFlight | None = None
        self._finished_records: list[SaveRecord] = []
        self._stager: DefaultStager | None = None
        self._group: dist.ProcessGroup | None = None
        self._warmup: Future[Any] | None = None
        self._prepared: Future[Any] | None = None
        if mode == "async":
            cuda = torch.cuda.is_available()
            distributed = dist.is_available() and dist.is_initialized()
            # No async staging: the copy is short and must end before the next optimizer step changes the state.
            # Shared memory lets the writer process read the staged copy without pickling it.
            self._stager = DefaultStager(StagingOptions(cuda, distributed, False, cuda))
            # A writer process, not a thread: serialising the state holds the GIL, which would slow every training
            # step while a checkpoint is written. Without a process group (a single-process script) DCP offers
            # only the thread.
            self._writer = AsyncCheckpointerType.PROCESS if distributed else AsyncCheckpointerType.THREAD
            if distributed:
                # The background writer's collectives get their own gloo group: sharing the training group from a
                # second thread would interleave with DDP's all-reduces in a different order on each rank.
                timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
                self._group = dist.new_group(backend="gloo", timeout=timeout)
                self._warmup = self._start_writer_process()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, Any],
        blocking: bool = False,
    ) -> None:
        """Collective. Returns as soon as training may continue; `finished()` reports saves that completed.

        blocking saves from this process whatever the mode: the last save on SIGTERM, which also reaches the
        writer process (torchrun signals the worker's whole process group).
        """
        started = time.perf_counter()
        self._finish_warmup()
        self._finish_prepare()
        self._finished_records.extend(self.wait())
        began = time.perf_counter()  # this save's own work starts here; the waits above are stall, not write
        if self.is_node_leader:
            # A marker left by an earlier attempt at this step would vouch for files about to be overwritten. No
            # rank writes before DCP's planning collective, which this rank joins only after the unlink.
            marker_path(self.ckpt_root, step).unlink(missing_ok=True)
        state = _save_state(model, optimizer, extra)
        writer = dcp.FileSystemWriter(self.ckpt_root / step_name(step))
        if self._stager is None or blocking:
            dcp.save(state, storage_writer=writer)
            stall_s = time.perf_counter() - started
            # A blocking save of an async run is a sync save; direct names its own.
            mode = "sync" if self.mode == "async" else self.mode
            self._finished_records.append(self._complete(step, began, stall_s, mode))
            return
        upload = dcp.async_save(state, storage_writer=writer, process_group=self._group, async_stager=self._stager,
                                async_checkpointer_type=self._writer)
        if not isinstance(upload, Future):
            raise CheckpointError(f"dcp.async_save returned {type(upload).__name__}: expected a Future (torch 2.13)")
        stall_s = time.perf_counter() - started
        done: Future[SaveRecord] = Future()

        def finish(written: Future[Any]) -> None:
            # Runs on the writer thread. Errors travel through `done` to the training thread: never swallowed.
            try:
                written.result()
                done.set_result(self._complete(step, began, stall_s, self.mode))
            except BaseException as exc:
                done.set_exception(exc)

        upload.add_done_callback(finish)
        self._in_flight = _InFlight(step, stall_s, done)

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Async mode: allocate the staging buffer now, on a background thread, so the first save only copies.

        Call it once the optimizer has stepped (its state exists from then on). The copy it makes is discarded:
        only the buffers, reused by every save, matter; training goes on meanwhile, as it does during a write.
        """
        if self._stager is None or self._prepared is not None:
            return
        stager, state = self._stager, _save_state(model, optimizer, {})
        prepared: Future[Any] = Future()

        def allocate() -> None:
            try:
                stager.stage(state)
                prepared.set_result(None)
            except BaseException as exc:  # reaches the training thread through the future
                prepared.set_exception(exc)

        threading.Thread(target=allocate, name="checkpoint-staging-prepare", daemon=True).start()
        self._prepared = prepared

    def _finish_prepare(self) -> None:
        prepared, self._prepared = self._prepared, None
        _await_setup(prepared, f"{self.ckpt_root}: allocating the checkpoint staging buffer failed",
                     "check free memory and /dev/shm")

    def _start_writer_process(self) -> Future[Any]:
        """DCP spawns its writer process on the first save, which takes seconds (a fresh interpreter imports
        torch); a tiny save now lets that happen while training starts instead of delaying the first checkpoint."""
        warmup = dcp.async_save(
            {"warmup": torch.zeros(1)},
            storage_writer=dcp.FileSystemWriter(self.ckpt_root / WARMUP_DIR),
            process_group=self._group,
            async_checkpointer_type=self._writer,
        )
        if not isinstance(warmup, Future):
            raise CheckpointError(f"dcp.async_save returned {type(warmup).__name__}: expected a Future (torch 2.13)")
        return warmup

    def ready(self) -> None:
        """Wait until the async writer process is up (at once in the other modes)."""
        self._finish_warmup()

    def _finish_warmup(self) -> None:
        warmup, self._warmup = self._warmup, None
        if warmup is None:
            return
        _await_setup(warmup, f"{self.ckpt_root / WARMUP_DIR}: the checkpoint writer process failed to start",
                     "check the local disk and /dev/shm")
        shutil.rmtree(self.ckpt_root / WARMUP_DIR, ignore_errors=True)

    def finished(self) -> list[SaveRecord]:
        """Saves completed since the last call, oldest first (polls the one in flight without waiting)."""
        if self._in_flight is not None and self._in_flight.done.done():
            self._finished_records.extend(self.wait())
        records, self._finished_records = self._finished_records, []
        return records

    def wait(self) -> list[SaveRecord]:
        """Blocks until the save in flight (if any) is on disk and marked; raises its error."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return []
        try:
            return [in_flight.done.result()]
        except Exception as exc:
            raise CheckpointError(
                f"{self.ckpt_root / step_name(in_flight.step)}: background save failed ({_cause(exc)}): "
                "check the local disk (space, permissions)"
            ) from exc

    def close(self) -> None:
        """Waits for the save in flight and frees the staging buffer; collective in async mode."""
        try:
            self._finish_warmup()
            self._finish_prepare()
            self._finished_records.extend(self.wait())
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None

    @property
    def in_flight_step(self) -> int | None:
        return self._in_flight.step if self._in_flight is not None else None

    def _complete(self, step: int, started: float, stall_s: float, mode: str) -> SaveRecord:
        """Marks this node's part of the step complete. DCP's save ends with a gather of every rank's write
        results on the coordinator, so when it returns on any rank every rank's files are fsynced on disk."""
        step_dir = self.ckpt_root / step_name(step)
        files = sorted(p.name for p in step_dir.iterdir() if p.is_file())
        size = sum((step_dir / name).stat().st_size for name in files)
        if self.is_node_leader:
            marker = {
                "step": step,
                "world_size": _env_int("WORLD_SIZE", 1),
                "node_rank": _env_int("GROUP_RANK", 0),
                "files": files,
            }
            write_json_atomic(marker_path(self.ckpt_root, step), marker)
            if self.keep_local is not None:
                prune_local(self.ckpt_root, self.keep_local)
        return SaveRecord(step, mode, round(stall_s, 4), round(time.perf_counter() - started, 4), size)


def sync_dir() -> Path | None:
    """The node syncer's dir (its state and upload lease), when trainpipe runs this script."""
    value = os.environ.get(SYNC_DIR_VAR)
    return Path(value) if value else None


def wait_for_upload(step: int, node_rank: int, timeout_s: float, poll_s: float = UPLOAD_POLL_S) -> None:
    """Mode direct, on the node's local rank 0: blocks until the node's syncer has uploaded its part of `step`.

    The syncer's state belongs to one attempt of the run, so an upload of an older save of the same step (by a dead
    attempt) does not count for the one just written.
    """
    directory = sync_dir()
    if directory is None:
        raise CheckpointError(f"--ckpt-mode direct needs the node's checkpoint syncer: {SYNC_DIR_VAR} is not set "
                              "(run the script through trainpipe, or use --ckpt-mode async)")
    path = state_path(directory, node_rank)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = read_state(path)
        except SyncError as exc:
            raise CheckpointError(str(exc)) from None
        if state is not None and state.has_step(step):
            return
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"{path}: step {step} not uploaded by this node's checkpoint syncer within {timeout_s:.1f}s "
                "(--ckpt-mode direct): check that `python -m infra.node sync` runs on this node and read its log "
                f"(under the flow: {directory.parent / 'logs' / 'sync.log'})"
            )
        time.sleep(poll_s)


def _await_setup(setup: Future[Any] | None, failed: str, fix: str) -> None:
    """Waits for background setup work; its failure becomes one CheckpointError naming what failed and the fix."""
    if setup is None:
        return
    try:
        setup.result()
    except Exception as exc:
        raise CheckpointError(f"{failed} ({_cause(exc)}): {fix}") from exc


def _save_state(model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {_MODEL_KEY: model_state, _OPTIM_KEY: optim_state, _EXTRA_KEY: json.dumps(extra, sort_keys=True)}


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    keep_local: int | None = None,
) -> Path:
    """Collective, synchronous: writes ckpt_root/step-NNNNNNNN/ and this node's completion marker.

    `extra` must be JSON-serialisable (step, data position, losses). With keep_local, the node then keeps
    only its newest keep_local complete steps. Training loops that save repeatedly want a Checkpointer.
    """
    with Checkpointer(ckpt_root, "sync", keep_local) as checkpointer:
        checkpointer.save(step, model, optimizer, extra)
    return ckpt_root / step_name(step)


def prune_local(ckpt_root: Path, keep_local: int) -> list[int]:
    """Delete all but the newest keep_local complete steps, sparing the one the syncer is uploading.

    Returns the steps deleted.
    """
    if keep_local < 1:
        raise CheckpointError(f"keep_local={keep_local}: keep at least 1 local checkpoint (--keep-local >= 1)")
    directory = sync_dir()
    try:
        leased = leased_step(directory, UPLOAD_LEASE) if directory is not None else None
    except StoreCheckpointError as exc:
        raise CheckpointError(str(exc)) from None
    doomed = [step for step in complete_steps(ckpt_root)[:-keep_local] if step != leased]
    for step in doomed:
        # Marker first: a step dir without a marker is ignored by syncers, a marker without its files is not.
        marker_path(ckpt_root, step).unlink()
        shutil.rmtree(ckpt_root / step_name(step))
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


def load_model_weights(step_dir: Path, model: nn.Module) -> None:
    """Loads only the model's weights in place (any world size, in a process group or alone): a warm start or an
    evaluation, where the saved optimizer state and position are not wanted."""
    _files_by_key(step_dir, _read_metadata(step_dir))
    state: dict[str, Any] = {_MODEL_KEY: get_model_state_dict(model)}
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(step_dir))
    except dcp.CheckpointException as exc:
        raise CheckpointError(
            f"{step_dir}: does not fit this model ({_cause(exc)}): pass the model options it was saved with"
        ) from exc
    set_model_state_dict(model, state[_MODEL_KEY])


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
