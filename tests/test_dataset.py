"""Synthetic datasets (determinism, continuity, exact entropy) and their validation against real file:// stores."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from infra.dataset import (
    DatasetError,
    DatasetManifest,
    ShardInfo,
    load_manifest,
    synthesize,
    validate_dataset,
    write_manifest,
)
from infra.storage import ObjectStore, open_store

TOKENS = 200_000
SHARD_TOKENS = 50_000


def _store(path: Path) -> ObjectStore:
    return open_store(path.as_uri())


def _tokens(store: ObjectStore) -> np.ndarray:
    manifest = load_manifest(store)
    return np.concatenate([np.frombuffer(store.get_bytes(s.name), dtype="<u2") for s in manifest.shards])


@pytest.fixture
def dataset(tmp_path: Path) -> ObjectStore:
    store = _store(tmp_path / "data")
    synthesize(store, TOKENS, shard_tokens=SHARD_TOKENS, seed=7)
    return store


def test_same_seed_gives_the_same_dataset_and_another_seed_does_not(tmp_path: Path) -> None:
    first = synthesize(_store(tmp_path / "a"), TOKENS, shard_tokens=SHARD_TOKENS, seed=1)
    again = synthesize(_store(tmp_path / "b"), TOKENS, shard_tokens=SHARD_TOKENS, seed=1)
    other = synthesize(_store(tmp_path / "c"), TOKENS, shard_tokens=SHARD_TOKENS, seed=2)
    assert first == again
    assert [s.sha256 for s in first.shards] != [s.sha256 for s in other.shards]
    assert (tmp_path / "a" / "shard-00003.bin").read_bytes() == (tmp_path / "b" / "shard-00003.bin").read_bytes()


def test_stream_is_the_same_however_it_is_sharded(tmp_path: Path) -> None:
    whole = synthesize(_store(tmp_path / "whole"), TOKENS, shard_tokens=TOKENS, seed=3)
    cut = synthesize(_store(tmp_path / "cut"), TOKENS, shard_tokens=30_000, seed=3)
    shorter = synthesize(_store(tmp_path / "short"), 70_001, shard_tokens=SHARD_TOKENS, seed=3)
    assert len(whole.shards) == 1
    assert [s.tokens for s in cut.shards] == [30_000] * 6 + [20_000]
    assert [s.bytes for s in shorter.shards] == [100_000, 40_002]
    stream = _tokens(_store(tmp_path / "whole"))
    np.testing.assert_array_equal(_tokens(_store(tmp_path / "cut")), stream)
    np.testing.assert_array_equal(_tokens(_store(tmp_path / "short")), stream[:70_001])


def test_empirical_conditional_entropy_matches_loss_floor(dataset: ObjectStore) -> None:
    manifest = load_manifest(dataset)
    tokens = _tokens(dataset).astype(np.int64)
    vocab = manifest.vocab_size
    pairs = np.bincount(tokens[:-1] * vocab + tokens[1:], minlength=vocab * vocab).reshape(vocab, vocab)
    seen = pairs > 0
    conditional = pairs / pairs.sum(axis=1, keepdims=True)
    entropy = -(pairs[seen] * np.log(conditional[seen])).sum() / pairs.sum()
    assert manifest.loss_floor == pytest.approx(-sum(p * np.log(p) for p in (0.6, 0.2, 0.1, 0.1)), rel=1e-12)
    assert entropy == pytest.approx(manifest.loss_floor, rel=0.01)


def test_every_token_has_exactly_k_distinct_successors(tmp_path: Path) -> None:
    store = _store(tmp_path / "data")
    manifest = synthesize(store, TOKENS, shard_tokens=SHARD_TOKENS, vocab_size=128, branching=(0.5, 0.3, 0.2), seed=5)
    tokens = _tokens(store).astype(np.int64)
    successors = np.zeros((manifest.vocab_size, manifest.vocab_size), dtype=bool)
    successors[tokens[:-1], tokens[1:]] = True
    assert successors.sum(axis=1).tolist() == [3] * manifest.vocab_size


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"tokens": 0}, "tokens: must be at least 1"),
        ({"vocab_size": 1}, "vocab_size: must be in [2, 65536]"),
        ({"vocab_size": 65537}, "vocab_size: must be in [2, 65536]"),
        ({"shard_tokens": 0}, "shard_tokens: must be at least 1"),
        ({"branching": (0.5, 0.4)}, "branching: probabilities sum to"),
        ({"branching": (1.0, 0.0)}, "branching: needs at least one probability, all > 0"),
        ({"branching": (0.25,) * 4, "vocab_size": 4}, "branching: 4 successors per token needs vocab_size > 4"),
    ],
)
def test_bad_arguments_fail_with_one_line_naming_the_argument(
    tmp_path: Path, arguments: dict[str, object], message: str
) -> None:
    call: dict[str, object] = {"tokens": 1000} | arguments
    with pytest.raises(DatasetError) as caught:
        synthesize(_store(tmp_path / "data"), **call)  # type: ignore[arg-type]
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "data" / "manifest.json").exists()


def test_resynthesizing_smaller_removes_the_old_shards(dataset: ObjectStore) -> None:
    manifest = synthesize(dataset, 60_000, shard_tokens=SHARD_TOKENS, seed=7)
    assert sorted(info.key for info in dataset.list()) == ["manifest.json", "shard-00000.bin", "shard-00001.bin"]
    assert load_manifest(dataset) == manifest


def test_missing_manifest_says_how_to_create_one(tmp_path: Path) -> None:
    store = _store(tmp_path / "empty")
    with pytest.raises(DatasetError) as caught:
        validate_dataset(store)
    assert str(caught.value) == (
        f"{store.url}/manifest.json: no dataset manifest: "
        f"create one with `trainpipe dataset synth {store.url} --tokens N`"
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "manifest.json: not valid JSON (Expecting property name"),
        (
            b'{"format": "trainpipe-tokens-v1"}',
            "manifest.json: field 'vocab_size': Field required (and 5 more problems)",
        ),
    ],
)
def test_unreadable_manifest_names_the_url_and_the_field(dataset: ObjectStore, content: bytes, message: str) -> None:
    dataset.put_bytes("manifest.json", content)
    with pytest.raises(DatasetError) as caught:
        load_manifest(dataset)
    assert str(caught.value).startswith(f"{dataset.url}/{message}")


def test_shard_fields_are_checked_when_loading(dataset: ObjectStore) -> None:
    raw = json.loads(dataset.get_bytes("manifest.json"))
    raw["shards"][2]["sha256"] = "not-a-hash"
    dataset.put_bytes("manifest.json", json.dumps(raw).encode())
    with pytest.raises(DatasetError, match=r"field 'shards\.2\.sha256': String should match pattern"):
        load_manifest(dataset)


def test_good_dataset_validates_quietly(dataset: ObjectStore, capfd: pytest.CaptureFixture[str]) -> None:
    report = validate_dataset(dataset, expected_vocab=256)
    assert (report.ok, report.problems) == (True, [])
    assert report.summary() == (
        f"{dataset.url}: 4 shards, 200,000 tokens, vocab 256: OK (sizes, sha256 and token ids checked)"
    )
    captured = capfd.readouterr()
    assert (captured.out, captured.err) == ("", "")


def _rewrite_shard(store: ObjectStore, name: str, tokens: np.ndarray) -> None:
    """Replace a shard and give the manifest its true size and hash, so only the contents can be wrong."""
    data = tokens.astype("<u2").tobytes()
    store.put_bytes(name, data)
    manifest = load_manifest(store)
    true = ShardInfo(name=name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), tokens=len(tokens))
    shards = [true if s.name == name else s for s in manifest.shards]
    write_manifest(store, manifest.model_copy(update={"shards": shards}))


def test_damaged_shards_are_each_named_with_the_failing_check(dataset: ObjectStore, tmp_path: Path) -> None:
    manifest = load_manifest(dataset)
    flipped = bytearray(dataset.get_bytes("shard-00001.bin"))
    # Low bytes only (little-endian): the tokens change but stay in the vocab, so only the hash can tell.
    flipped[1000] ^= 0x01
    flipped[1002] ^= 0x01
    dataset.put_bytes("shard-00001.bin", bytes(flipped))
    dataset.delete("shard-00002.bin")
    _rewrite_shard(dataset, "shard-00003.bin", np.array([5, 256, 300, 7], dtype=np.uint16))
    dataset.put_bytes("shard-00009.bin", b"\x00\x01")
    flipped_sha = hashlib.sha256(flipped).hexdigest()

    report = validate_dataset(dataset)

    assert not report.ok
    assert report.problems == [
        f"shard-00002.bin: missing from {dataset.url}: re-create or re-upload the shard",
        f"shard-00009.bin: in {dataset.url} but not in the manifest: delete it or re-create the dataset",
        "manifest.json: total_tokens 200000 != sum of shard tokens 150004: re-create the dataset",
        f"shard-00001.bin: sha256 mismatch (manifest {manifest.shards[1].sha256[:12]}…, actual {flipped_sha[:12]}…): "
        "re-create or re-upload the shard",
        "shard-00003.bin: token id 300 out of vocab [0, 255] (vocab_size 256): "
        "re-create the shard, or the dataset with a larger vocab",
    ]
    assert report.summary().splitlines()[0].endswith(": 5 problems (sizes, sha256 and token ids checked)")


def test_shallow_validation_checks_sizes_but_not_contents(dataset: ObjectStore) -> None:
    flipped = bytearray(dataset.get_bytes("shard-00000.bin"))
    flipped[1] ^= 0xFF
    dataset.put_bytes("shard-00000.bin", bytes(flipped))
    dataset.put_bytes("shard-00001.bin", b"\x00" * 10)

    report = validate_dataset(dataset, deep=False)

    assert report.problems == [
        "shard-00001.bin: size mismatch (manifest 100000 bytes, actual 10): re-create or re-upload the shard"
    ]
    first_token = int.from_bytes(flipped[:2], "little")
    deep = validate_dataset(dataset).problems
    assert [line.split(" (")[0] for line in deep] == [
        "shard-00001.bin: size mismatch",
        "shard-00000.bin: sha256 mismatch",
        "shard-00001.bin: sha256 mismatch",
        f"shard-00000.bin: token id {first_token} out of vocab [0, 255]",
    ]


def test_inconsistent_manifest_and_vocab_mismatch_are_reported(dataset: ObjectStore) -> None:
    manifest = load_manifest(dataset)
    shards = list(manifest.shards)
    shards[0] = shards[0].model_copy(update={"bytes": 99_998})
    broken = manifest.model_copy(update={"shards": shards, "loss_floor": 7.0, "vocab_size": 512})
    write_manifest(dataset, DatasetManifest.model_validate(broken.model_dump()))

    problems = validate_dataset(dataset, expected_vocab=256).problems

    assert problems == [
        "shard-00000.bin: manifest says 99998 bytes but its tokens need 100000 (2 per token): re-create the dataset",
        "shard-00000.bin: size mismatch (manifest 99998 bytes, actual 100000): re-create or re-upload the shard",
        "manifest.json: loss_floor 7.0 is outside (0, ln 512 = 6.2383]: re-create the dataset",
        "dataset vocab_size 512 != model vocab_size 256: set training.model.vocab_size: 512 or use a matching dataset",
    ]
