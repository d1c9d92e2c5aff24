"""A prefix that carries its own manifest of files is held to it at plan, so damage is one line at `trainpipe plan`
rather than a failure on a paid cluster.

The manifests recognised (anywhere in the snapshot; the files they name are relative to the manifest's folder):
    manifest.json                  trainpipe's token format (trainpipe-tokens-v1): every shard's bytes and sha256
    *.safetensors.index.json       Hugging Face sharded weights: every shard its weight_map names; each shard's size
                                   follows from its own header (8 bytes of length, a JSON table of tensor offsets)
    index.json                     MosaicML MDS: every shard's stored file (zip_data, else raw_data), its bytes and
                                   hashes
    SHA256SUMS                     `sha256sum` output: every file's sha256
A manifest that cannot be read (not JSON, not UTF-8, a bad line) is itself the error. A manifest.json or index.json
of another tool (valid JSON, another shape) is not ours to judge and is passed over.

What is checked, and why: presence and size always (the snapshot has them: free). Content checksums where they are
cheap: free when the snapshot already holds the same algorithm (file:// snapshots are sha256, computed at plan; S3
and GCS keep md5), otherwise by reading the object at plan, only when it is at most READ_LIMIT and the reads of one
plan stay within READ_BUDGET (a 24 GB base model is not read twice at plan: staging verifies every byte against the
snapshot's checksum, and the size check already catches a truncated or missing shard).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from infra.dataset.checksums import object_checksum
from infra.dataset.manifest import DATASET_FORMAT, MANIFEST_KEY, DatasetError, load_manifest
from infra.dataset.snapshot import DATASET, DatasetSnapshot, SnapshotFile
from infra.storage.base import ObjectStore

READ_LIMIT = 64 << 20  # bytes: an object larger than this is not read at plan for its checksum
READ_BUDGET = 1 << 30  # bytes read at plan for checksums, per prefix
_MANIFEST_LIMIT = 64 << 20  # a manifest larger than this is not one
_SAFETENSORS_HEADER_LIMIT = 100 << 20  # what the safetensors format itself allows
_SHOWN = 3


@dataclass(frozen=True)
class Expected:
    """One file a manifest names: where, how large (None: not said), with which checksums (algorithm -> hex)."""

    key: str
    manifest: str
    size: int | None = None
    checksums: dict[str, str] = field(default_factory=dict)


def _unreadable(url: str, reason: str) -> DatasetError:
    return DatasetError(f"{url}: unreadable manifest ({reason}): fix or re-create it, or leave it out with "
                        "include/exclude")


def _json(data: bytes, url: str) -> Any:
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        raise _unreadable(url, f"not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except UnicodeDecodeError:
        raise _unreadable(url, "not UTF-8") from None


def _within(folder: str, name: str) -> str:
    return str(PurePosixPath(folder) / name) if folder else name


def _tokens(store: ObjectStore, folder: str, key: str, data: bytes) -> Iterator[Expected]:
    parsed = _json(data, store.url_for(key))
    if not isinstance(parsed, dict) or parsed.get("format") != DATASET_FORMAT:
        return  # another tool's manifest.json
    manifest = load_manifest(store.child(folder) if folder else store)  # its field errors, one line each
    for shard in manifest.shards:
        yield Expected(_within(folder, shard.name), key, shard.bytes, {"sha256": shard.sha256})


def _safetensors_size(store: ObjectStore, key: str, size: int) -> int | None:
    """The size a safetensors file's own header implies (None: too short to hold one: the size check says so)."""
    if size < 8:
        return None
    (length,) = struct.unpack("<Q", store.get_range(key, 0, 8))
    if length > _SAFETENSORS_HEADER_LIMIT or 8 + length > size:
        raise DatasetError(f"{store.url_for(key)}: not a safetensors file (header of {length} bytes in a {size}-byte "
                           "file): re-upload it")
    header = _json(store.get_range(key, 8, length), store.url_for(key))
    ends = [tensor["data_offsets"][1] for name, tensor in header.items()
            if name != "__metadata__" and isinstance(tensor, dict) and "data_offsets" in tensor]
    return 8 + length + max(ends, default=0)


def _safetensors(store: ObjectStore, folder: str, key: str, data: bytes,
                 sizes: dict[str, int]) -> Iterator[Expected]:
    parsed = _json(data, store.url_for(key))
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise _unreadable(store.url_for(key), "no weight_map of tensor -> file")
    for name in sorted(set(weight_map.values())):
        shard = _within(folder, name)
        yield Expected(shard, key, _safetensors_size(store, shard, sizes[shard]) if shard in sizes else None)


def _mds(store: ObjectStore, folder: str, key: str, data: bytes) -> Iterator[Expected]:
    parsed = _json(data, store.url_for(key))
    shards = parsed.get("shards") if isinstance(parsed, dict) else None
    if not isinstance(shards, list) or not all(isinstance(s, dict) and ("raw_data" in s or "zip_data" in s)
                                               for s in shards):
        return  # some other index.json
    for shard in shards:
        stored = shard.get("zip_data") or shard.get("raw_data")  # a compressed shard is stored zipped only
        if not isinstance(stored, dict) or "basename" not in stored:
            raise _unreadable(store.url_for(key), "a shard without raw_data.basename or zip_data.basename")
        hashes = {alg: digest for alg, digest in (stored.get("hashes") or {}).items()
                  if alg in hashlib.algorithms_guaranteed and isinstance(digest, str)}
        yield Expected(_within(folder, stored["basename"]), key, stored.get("bytes"), hashes)


def _sha256sums(store: ObjectStore, folder: str, key: str, data: bytes) -> Iterator[Expected]:
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise _unreadable(store.url_for(key), "not UTF-8") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        digest, _, name = line.partition(" ")
        name = name.lstrip(" ").removeprefix("*")
        if len(digest) != 64 or not name or any(c not in "0123456789abcdefABCDEF" for c in digest):
            raise _unreadable(store.url_for(key), f"line {number} is not '<sha256>  <file>'")
        yield Expected(_within(folder, name.removeprefix("./")), key, None, {"sha256": digest.lower()})


def _parser(name: str) -> Callable[..., Iterator[Expected]] | None:
    if name == MANIFEST_KEY:
        return _tokens
    if name.endswith(".safetensors.index.json"):
        return _safetensors
    if name == "index.json":
        return _mds
    if name == "SHA256SUMS":
        return _sha256sums
    return None


def declared(store: ObjectStore, snapshot: DatasetSnapshot) -> list[Expected]:
    """Every file the snapshot's manifests name; DatasetError for a manifest that cannot be read."""
    sizes = {f.key: f.size for f in snapshot.files}
    found: list[Expected] = []
    for file in snapshot.files:
        path = PurePosixPath(file.key)
        parse = _parser(path.name)
        if parse is None:
            continue
        if file.size > _MANIFEST_LIMIT:
            raise _unreadable(snapshot.file_url(file), f"{file.size} bytes: too large for a manifest")
        folder = "" if str(path.parent) == "." else str(path.parent)
        extra = (sizes,) if parse is _safetensors else ()
        found.extend(parse(store, folder, file.key, store.get_bytes(file.key), *extra))
    return found


class _Reader:
    """Reads objects for their checksums within the plan's budget."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.left = READ_BUDGET

    def checksum(self, file: SnapshotFile, algorithm: str) -> str | None:
        if file.size > READ_LIMIT or file.size > self.left:
            return None
        self.left -= file.size
        return object_checksum(self.store, file.key, file.size, algorithm).partition(":")[2]


def _short(digest: str) -> str:
    return f"{digest[:12]}…"


def _problem(expected: Expected, file: SnapshotFile | None, reader: _Reader) -> str | None:
    if file is None:
        return "missing (not under the prefix, or left out by include/exclude)"
    if expected.size is not None and file.size != expected.size:
        return f"{file.size} bytes but {expected.manifest} says {expected.size}"
    held, _, digest = file.checksum.partition(":")
    for algorithm, want in expected.checksums.items():
        actual = digest if algorithm == held else reader.checksum(file, algorithm)
        if actual is not None and actual != want.lower():
            return f"{algorithm} {_short(actual)} but {expected.manifest} says {_short(want)}"
    return None


def check_held(store: ObjectStore, snapshot: DatasetSnapshot, what: str = DATASET) -> int:
    """Hold the snapshot to every manifest it carries; returns how many files were held to one, and raises
    DatasetError naming the first files that differ from what their manifest says."""
    expected = declared(store, snapshot)
    files = {f.key: f for f in snapshot.files}
    reader = _Reader(store)
    problems = [f"{snapshot.url}/{e.key}: {problem}" for e in expected
                if (problem := _problem(e, files.get(e.key), reader)) is not None]
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise DatasetError(f"{what} does not match its own manifest: {'; '.join(problems[:_SHOWN])}{more}: re-upload "
                           "the files, or re-create the manifest")
    return len(expected)

