"""Whether a committed checkpoint, restored, would load in its framework (`trainpipe ckpt verify --deep`): on the
orchestrator only. Reading a DCP index needs torch, which the node agent's environment never has: this is not in
infra.checkpoints, which the agent imports."""

from __future__ import annotations

import json
from pathlib import Path

from infra.checkpoints.formats import CHECKPOINT_SUFFIXES, DCP_METADATA, HF_STATE, file_is_whole


def check_loadable(path: Path) -> dict[str, int | str]:
    """Open a restored checkpoint the way its framework would, without running the script: DCP's index read and every
    file it names present and long enough, trainer_state.json parsed, every torch/safetensors file whole.

    Returns what was found (format, files, tensors, elements, global_step); ValueError names what cannot load."""
    files = [path] if path.is_file() else [p for p in sorted(path.rglob("*")) if p.is_file()]
    report: dict[str, int | str] = {"files": len(files)}
    for file in files:
        if file.suffix in (*CHECKPOINT_SUFFIXES, ".pth") and not file_is_whole(file):
            raise ValueError(f"{file}: cut short or not a checkpoint file: restore an older step")
    if path.is_dir() and (path / DCP_METADATA).is_file():
        report.update(format="dcp", **_dcp_report(path))
    if path.is_dir() and (path / HF_STATE).is_file():
        try:
            report.update(format="hf", global_step=int(json.loads((path / HF_STATE).read_text())["global_step"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path / HF_STATE}: unreadable ({exc}): restore an older step") from None
    return report


def _dcp_report(folder: Path) -> dict[str, int]:
    # Imported here: only a DCP checkpoint needs torch to be read, and an orchestrator without torch still verifies
    # the other formats.
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    except ImportError as exc:
        raise ValueError(f"{folder / DCP_METADATA}: reading a DCP checkpoint needs torch ({exc}): run this where "
                         "torch is installed") from None

    try:
        metadata = dcp.FileSystemReader(folder).read_metadata()
    except Exception as exc:
        raise ValueError(f"{folder / DCP_METADATA}: unreadable ({type(exc).__name__}: {exc}): restore an older "
                         "step") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        actual = (folder / name).stat().st_size if (folder / name).is_file() else -1
        if actual < size:
            raise ValueError(f"{folder / name}: {'missing' if actual < 0 else 'truncated'} (DCP's index needs "
                             f"{size} bytes): restore an older step")
    tensors = [entry for entry in metadata.state_dict_metadata.values() if isinstance(entry, TensorStorageMetadata)]
    return {"tensors": len(tensors), "elements": sum(entry.size.numel() for entry in tensors)}
