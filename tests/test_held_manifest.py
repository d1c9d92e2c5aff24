"""A dataset or input that carries its own manifest is held to it at plan: trainpipe's token manifest.json, a
safetensors index, an MDS index.json and a SHA256SUMS file. Every damage is one line naming the file, exit 2 at
`trainpipe plan`, before a cluster is paid for."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from conftest import run_trainpipe
from jobs import job_config, make_dataset, write_config

from infra.dataset.held import check_held
from infra.dataset.manifest import DatasetError
from infra.dataset.planning import plan_prefix
from infra.dataset.snapshot import take_snapshot
from infra.dataset.spec import DatasetSpec
from infra.storage import open_store


def _plan(url: str, tmp_path: Path) -> int:
    """Plan the prefix as a dataset; how many files its manifests named."""
    return plan_prefix(DatasetSpec(url=url), "replicate", 2, f"file://{tmp_path}/ckpt/run-1", "run-1").held


def _error(url: str, tmp_path: Path) -> str:
    with pytest.raises(DatasetError) as raised:
        _plan(url, tmp_path)
    message = str(raised.value)
    assert "\n" not in message
    return message


def _flip(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _tokens(root: Path) -> str:
    return make_dataset(root, tokens=30_000, shard_tokens=10_000)


# -- trainpipe's token manifest.json ---------------------------------------------------------------------------------

def _damage(root: Path, how: str) -> str:
    shard = root / "shard-00001.bin"
    if how == "byte flipped":
        _flip(shard)
    elif how == "deleted":
        shard.unlink()
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif how == "manifest unreadable":
        (root / "manifest.json").write_text('{"format": "trainpipe-tokens-v1", "shards": [')
        return "manifest.json"
    return "shard-00001.bin"


@pytest.mark.parametrize("how", ["byte flipped", "deleted", "truncated", "manifest unreadable"])
def test_a_damaged_token_dataset_fails_its_plan_naming_the_file(tmp_path: Path, how: str) -> None:
    url = _tokens(tmp_path / "data")
    assert _plan(url, tmp_path) == 3, "every shard is held to the manifest"
    named = _damage(tmp_path / "data", how)

    message = _error(url, tmp_path / "again")

    assert f"{url}/{named}" in message, message
    assert "shard-00000.bin" not in message and "shard-00002.bin" not in message


def test_trainpipe_plan_exits_2_naming_the_flipped_shard(workspace: Path, tmp_path: Path) -> None:
    url = _tokens(tmp_path / "data")
    _damage(tmp_path / "data", "byte flipped")
    config = write_config(tmp_path / "job.yaml", job_config(tmp_path, url))

    result = run_trainpipe("plan", str(config), env={**os.environ, "TRAINPIPE_HOME": str(workspace)})

    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{url}/shard-00001.bin: sha256" in result.stderr and "manifest.json says" in result.stderr, result.stderr


def test_a_byte_flip_is_caught_on_s3_where_the_snapshot_holds_md5(s3_url: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _tokens(tmp_path / "data")
    _damage(tmp_path / "data", "byte flipped")
    store = open_store(f"{s3_url}/tokens")
    for path in sorted((tmp_path / "data").iterdir()):
        store.put_file(path, path.name)
    snapshot = take_snapshot(store)
    assert {f.checksum.partition(":")[0] for f in snapshot.files} == {"md5"}

    with pytest.raises(DatasetError, match=r"tokens/shard-00001\.bin: sha256 [0-9a-f]{12}… but manifest\.json says"):
        check_held(store, snapshot)
    reads: list[tuple] = []
    original = store.get_range
    monkeypatch.setattr(store, "get_range", lambda *a: reads.append(a) or original(*a))
    with pytest.raises(DatasetError, match=r"shard-00001\.bin"):
        check_held(store, snapshot)
    assert reads == [], "planning again in one process (the CLI, then the flow) reads no shard twice"


def test_another_tools_manifest_json_is_not_judged(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    (root / "manifest.json").write_text(json.dumps({"files": ["a.bin"], "version": 3}))
    (root / "a.bin").write_bytes(b"x" * 10)
    assert _plan(f"file://{root}", tmp_path) == 0


# -- safetensors, MDS, SHA256SUMS ------------------------------------------------------------------------------------

def _safetensors_model(root: Path) -> str:
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    weight_map = {}
    for index, names in enumerate((("wte", "wpe"), ("head",))):
        shard = f"model-{index + 1:05d}-of-00002.safetensors"
        save_file({name: torch.ones(64, 8) * index for name in names}, str(root / shard))
        weight_map.update(dict.fromkeys(names, shard))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 6144},
                                                                   "weight_map": weight_map}))
    (root / "config.json").write_text("{}")
    return f"file://{root}"


@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_a_safetensors_shard_its_index_names_must_be_whole(tmp_path: Path, how: str) -> None:
    url = _safetensors_model(tmp_path / "base")
    assert _plan(url, tmp_path) == 2
    shard = tmp_path / "base" / "model-00002-of-00002.safetensors"
    if how == "deleted":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:-4])

    message = _error(url, tmp_path / "again")

    assert f"{url}/model-00002-of-00002.safetensors" in message, message
    assert ("missing" if how == "deleted" else "its safetensors header says") in message


def test_a_single_safetensors_file_is_held_to_its_own_header(tmp_path: Path) -> None:
    url = _safetensors_model(tmp_path / "base")
    (tmp_path / "base" / "model.safetensors.index.json").unlink()  # as save_pretrained writes a small model
    assert _plan(url, tmp_path) == 2
    shard = tmp_path / "base" / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert f"{url}/model-00001-of-00002.safetensors: " in _error(url, tmp_path / "again")
    shard.write_bytes(b"abc")
    assert "not a safetensors file" in _error(url, tmp_path / "tiny")


def _mds(root: Path, zipped: bool = False) -> str:
    """Two MDS shards and their index.json; zipped: stored compressed only (the raw file is what a reader unpacks)."""
    root.mkdir(parents=True)
    shards = []
    for index in range(2):
        data = bytes([index]) * 500 + b"sample" * 10
        stored = {"basename": f"shard.{index:05d}.mds" + ".zstd" * zipped, "bytes": len(data),
                  "hashes": {"sha1": hashlib.sha1(data).hexdigest()}}
        (root / stored["basename"]).write_bytes(data)
        raw = {"basename": f"shard.{index:05d}.mds", "bytes": 4 * len(data), "hashes": {}}
        shards.append({"column_encodings": ["bytes"], "column_names": ["x"], "format": "mds", "samples": 10,
                       "raw_data": raw if zipped else stored, "zip_data": stored if zipped else None,
                       "compression": "zstd" if zipped else None, "version": 2})
    (root / "index.json").write_text(json.dumps({"version": 2, "shards": shards}))
    return f"file://{root}"


@pytest.mark.parametrize("how", ["byte flipped", "deleted", "truncated"])
def test_an_mds_shard_is_held_to_its_index(tmp_path: Path, how: str) -> None:
    url = _mds(tmp_path / "mds")
    assert _plan(url, tmp_path) == 2
    shard = tmp_path / "mds" / "shard.00001.mds"
    if how == "byte flipped":
        _flip(shard)
    elif how == "deleted":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:-1])

    message = _error(url, tmp_path / "again")

    assert f"{url}/shard.00001.mds" in message and "shard.00000.mds" not in message, message


def test_a_compressed_mds_shard_is_held_to_its_zip_data(tmp_path: Path) -> None:
    url = _mds(tmp_path / "mds", zipped=True)
    assert _plan(url, tmp_path) == 2, "the raw shards are not stored: the zipped ones are held"
    _flip(tmp_path / "mds" / "shard.00000.mds.zstd")
    assert f"{url}/shard.00000.mds.zstd: sha1" in _error(url, tmp_path / "again")


def test_sha256sums_holds_every_file_it_lists(tmp_path: Path) -> None:
    root = tmp_path / "tok"
    (root / "sub").mkdir(parents=True)
    files = {"tokenizer.json": b'{"model": "bpe"}', "sub/merges.txt": b"a b\n"}
    for name, data in files.items():
        (root / name).write_bytes(data)
    (root / "SHA256SUMS").write_text("".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in files.items()))
    url = f"file://{root}"
    assert _plan(url, tmp_path) == 2

    (root / "sub" / "merges.txt").write_bytes(b"a c\n")
    assert f"{url}/sub/merges.txt: sha256" in _error(url, tmp_path / "flipped")

    (root / "SHA256SUMS").write_text("not a checksum line\n")
    message = _error(url, tmp_path / "garbled")
    assert f"{url}/SHA256SUMS: unreadable manifest (line 1" in message, message
