"""Which checkpoints are complete, by each framework's own signal: real files, real open file descriptors."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from infra.checkpoints.formats import (
    Detector,
    file_is_whole,
    files_open_for_writing,
    own_required,
    part_files,
    part_settled,
    rank_of,
    required_files,
    step_from_name,
)


def names(found: list) -> list[tuple[str, str, str, int | None]]:
    return [(f.name, f.kind, f.format, f.step) for f in found]


def torch_file(path: Path, value: int = 1) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"value": torch.tensor([value])}, path)
    return path


def test_each_format_by_its_own_signal(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-100").mkdir(parents=True)
    (ckpt / "step-100" / "__0_0.distcp").write_bytes(b"x")
    (ckpt / "step-100" / ".metadata").write_bytes(b"__0_0.distcp")
    (ckpt / "step-200").mkdir()
    (ckpt / "step-200" / "__0_0.distcp").write_bytes(b"x")  # no .metadata yet: a save under way
    (ckpt / "checkpoint-500").mkdir()
    torch_file(ckpt / "checkpoint-500" / "optimizer.pt")  # no trainer_state.json yet
    (ckpt / "checkpoint-400").mkdir()
    (ckpt / "checkpoint-400" / "trainer_state.json").write_text("{}")
    torch_file(ckpt / "lightning" / "epoch=1-step=300.ckpt")
    (ckpt / "lightning" / "last.ckpt").symlink_to("epoch=1-step=300.ckpt")
    torch_file(ckpt / "snapshot.pt")
    (ckpt / "mine").mkdir()
    (ckpt / "mine" / "weights.bin").write_bytes(b"w")
    (ckpt / "mine.complete").write_text("{}")
    (ckpt / ".writer-warmup").mkdir()
    (ckpt / ".writer-warmup" / ".metadata").write_bytes(b"")  # hidden scratch: never a checkpoint

    found = Detector(ckpt, "auto").scan()
    assert sorted(names(found)) == [
        ("checkpoint-400", "dir", "hf", 400),
        ("lightning/epoch=1-step=300.ckpt", "file", "lightning", 300),
        ("mine", "dir", "marker", None),
        ("snapshot.pt", "file", "file", None),
        ("step-100", "dir", "dcp", 100),
    ]
    assert names(Detector(ckpt, "hf").scan()) == [("checkpoint-400", "dir", "hf", 400)]
    assert [f.name for f in Detector(ckpt, "torchtitan").scan()] == ["step-100"]
    assert [f.name for f in Detector(ckpt, "marker").scan()] == ["mine"]
    # Only what the format names: a lightning job's checkpoint dir has no in-place "file" checkpoints.
    assert [f.name for f in Detector(ckpt, "lightning").scan()] == ["lightning/epoch=1-step=300.ckpt"]
    with pytest.raises(ValueError, match="use one of auto"):
        Detector(ckpt, "keras")


def test_a_file_open_for_writing_or_cut_short_is_not_a_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    snapshot = torch_file(ckpt / "snapshot.pt")
    whole = snapshot.read_bytes()

    with open(snapshot, "r+b"):
        assert files_open_for_writing(ckpt) == {snapshot.resolve()}
        assert Detector(ckpt, "file").scan() == []
    assert files_open_for_writing(ckpt) == set()
    [found] = Detector(ckpt, "file").scan()

    snapshot.write_bytes(whole[: len(whole) // 2])  # a writer killed mid-save leaves a closed, truncated file
    assert not file_is_whole(snapshot)
    assert Detector(ckpt, "file").scan() == []
    snapshot.write_bytes(whole)
    [again] = Detector(ckpt, "file").scan()
    assert again.name == found.name and again.version > found.version  # a rewrite is a new version of one name

    with open(ckpt / "snapshot.pt", "rb"):  # reading is not writing
        assert len(Detector(ckpt, "file").scan()) == 1


def test_a_folder_with_a_file_still_being_written_is_not_complete(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    folder = ckpt / "checkpoint-10"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    with open(folder / "scheduler.pt", "wb"):
        assert Detector(ckpt, "hf").scan() == []
    assert [f.name for f in Detector(ckpt, "hf").scan()] == ["checkpoint-10"]


def test_safetensors_and_zip_wholeness(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    good = tmp_path / "model.safetensors"
    good.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    assert file_is_whole(good)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-3])
    assert not file_is_whole(cut)
    archive = tmp_path / "a.pth"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("data.pkl", b"x" * 1000)
    assert file_is_whole(archive)
    archive.write_bytes(archive.read_bytes()[:-30])
    assert not file_is_whole(archive)
    (tmp_path / "legacy.pt").write_bytes(b"\x80\x02legacy pickle")
    assert file_is_whole(tmp_path / "legacy.pt")  # an unknown container: closed is all that can be known


def test_steps_come_from_names(tmp_path: Path) -> None:
    assert step_from_name("checkpoint-500") == 500
    assert step_from_name("checkpoint/step-00000100") == 100
    assert step_from_name("epoch=3-step=1200.ckpt") == 1200
    assert step_from_name("model_1000.pt") == 1000
    assert step_from_name("snapshot.pt") is None and step_from_name("last.ckpt") is None


def test_required_files_and_parts(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt" / "step-7"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"\x80\x04junk__0_0.distcp\x94more__3_0.distcp\x94__3_1.distcp")
    torch_file(folder / "rng_state_0.pth")
    assert required_files(folder, world_size=4) == ["__0_0.distcp", "__3_0.distcp", "__3_1.distcp",
                                                   "rng_state_0.pth", "rng_state_1.pth", "rng_state_2.pth",
                                                   "rng_state_3.pth"]
    assert required_files(folder, world_size=1) == ["__0_0.distcp", "__3_0.distcp", "__3_1.distcp"]
    assert rank_of("__3_1.distcp") == 3 and rank_of("rng_state_12.pth") == 12 and rank_of("model.pt") is None
    assert own_required(required_files(folder, 4), range(2, 4)) == ["__3_0.distcp", "__3_1.distcp",
                                                                    "rng_state_2.pth", "rng_state_3.pth"]
    (folder / "sub").mkdir()
    (folder / "sub" / "x").write_text("x")
    (folder / "y.tmp").write_text("partial")
    assert part_files(folder) == [".metadata", "rng_state_0.pth", "sub/x"]


def test_a_node_part_settles_when_its_own_files_are_there_and_closed(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    folder = ckpt / "checkpoint-20"
    folder.mkdir(parents=True)
    assert not part_settled(ckpt, "checkpoint-20", "hf", ["rng_state_1.pth"])
    torch_file(folder / "rng_state_1.pth")
    with open(folder / "rng_state_1.pth", "ab"):
        assert not part_settled(ckpt, "checkpoint-20", "hf", ["rng_state_1.pth"])
    assert part_settled(ckpt, "checkpoint-20", "hf", ["rng_state_1.pth"])
    marked = ckpt / "step-3"
    marked.mkdir()
    (marked / "part").write_text("p")
    assert not part_settled(ckpt, "step-3", "marker", [])  # marker format: this node's own marker first
    (ckpt / "step-3.complete").write_text("{}")
    assert part_settled(ckpt, "step-3", "marker", [])
    os.remove(ckpt / "step-3.complete")


def test_a_folder_deleted_while_its_files_are_listed_lists_what_was_left(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The script's own retention deletes a checkpoint folder while the syncer lists it (an HF save_total_limit
    rotation): the listing ends with what was still there, it does not raise (a kill -9 test's syncer died of it)."""
    import shutil

    root = tmp_path / "checkpoint-7"
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(b"a")
    (root / "sub" / "b.bin").write_bytes(b"b")
    scandir = os.scandir

    def deleted_before_sub_is_read(path: object = ".") -> object:
        if Path(str(path)) == root / "sub":
            shutil.rmtree(root)  # forced here, between the walk's steps
        return scandir(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", deleted_before_sub_is_read)
    assert part_files(root) in (["a.bin"], [])


def test_an_hf_folder_cut_short_by_the_trainers_rotation_is_not_complete(tmp_path: Path) -> None:
    """A Trainer killed while its rotation (save_total_limit) deleted an old folder file by file leaves that folder
    with a valid trainer_state.json and its weights gone: it must never be shipped as a checkpoint."""
    ckpt = tmp_path / "ckpt"
    for step in (20, 22, 24):
        folder = ckpt / f"checkpoint-{step}"
        for name in ("model.safetensors", "config.json", "optimizer.pt", "rng_state.pth"):
            torch_file(folder / name, step)
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    assert [f.name for f in Detector(ckpt, "hf").scan()] == ["checkpoint-20", "checkpoint-22", "checkpoint-24"]
    (ckpt / "checkpoint-20" / "model.safetensors").unlink()  # the rotation, cut short by the kill
    (ckpt / "checkpoint-22" / "optimizer.pt").unlink()
    assert [f.name for f in Detector(ckpt, "hf").scan()] == ["checkpoint-24"]
    assert [f.name for f in Detector(ckpt, "auto").scan()] == ["checkpoint-24"]
