"""`trainpipe cp` between local paths, s3:// (rclone), gs:// (emulator) and az:// (Azurite), through the Typer app."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from statistics import median

import pytest
from conftest import TRAINPIPE
from store_checks import engine_files, tree, write_tree
from test_storage_file import ODD_KEYS
from typer.testing import CliRunner

from bench.transfer import ONE_OBJECT_NOTE, ONE_OBJECT_RUNS
from trainpipe.cli import app

FINAL_LINE = re.compile(r"^copied (\d+) files(?: \((\d+) already there and valid\))?, ([\d,]+) bytes in [\d.]+ s: "
                        r"[\d.]+ MB/s$")
PART = 1 << 20


def cp(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["cp", *args, "--part-size-mb", "5"])
    return result.exit_code, result.stdout, result.stderr


def test_recursive_copy_through_s3_and_gcs(s3_url: str, gs_url: str, tmp_path: Path) -> None:
    sizes = engine_files(5 << 20)
    write_tree(tmp_path / "src", sizes)
    total = sum(sizes.values())
    for src, dst in [(str(tmp_path / "src"), f"{s3_url}/up/"), (f"{s3_url}/up", f"{gs_url}/across"),
                     (f"{gs_url}/across/", f"file://{tmp_path}/back"), (f"{s3_url}/up", str(tmp_path / "from-s3"))]:
        code, out, err = cp(src, dst, "--recursive")
        assert code == 0, err
        match = FINAL_LINE.match(out.strip().splitlines()[-1])
        assert match and int(match[1]) == len(sizes) and int(match[3].replace(",", "")) == total, out
    # Exactly the source tree, file for file: nothing of trainpipe's own lands in the copies.
    assert tree(tmp_path / "back") == tree(tmp_path / "src") == tree(tmp_path / "from-s3")
    # Again: everything is already there and valid, so nothing moves, and the line says so.
    for src, dst in [(f"{gs_url}/across", str(tmp_path / "back")), (f"{s3_url}/up/", str(tmp_path / "from-s3"))]:
        code, out, _ = cp(src, dst, "-r")
        match = FINAL_LINE.match(out.strip())
        assert code == 0 and match and int(match[2]) == len(sizes) and match[3] == "0", out
    assert tree(tmp_path / "from-s3") == tree(tmp_path / "src")


def test_recursive_copy_to_azure_and_back_is_exact(az_url: str, tmp_path: Path) -> None:
    """Awkward keys (spaces, non-ASCII, '+', '='), an empty file and one of several blocks: up to az:// and back,
    exactly; a second copy down moves nothing."""
    sizes = {**{key: 100 + len(key) for key in ODD_KEYS}, "empty.bin": 0, "big/blocks+tail.bin": 2 * (5 << 20) + 1234}
    write_tree(tmp_path / "src", sizes)
    for src, dst in [(str(tmp_path / "src"), f"{az_url}/up/"), (f"{az_url}/up", str(tmp_path / "back"))]:
        code, out, err = cp(src, dst, "--recursive")
        assert code == 0, err
        match = FINAL_LINE.match(out.strip().splitlines()[-1])
        assert match and int(match[1]) == len(sizes) and int(match[3].replace(",", "")) == sum(sizes.values()), out
    assert tree(tmp_path / "back") == tree(tmp_path / "src")
    code, out, _ = cp(f"{az_url}/up/", str(tmp_path / "back"), "-r")
    match = FINAL_LINE.match(out.strip())
    assert code == 0 and match and int(match[2]) == len(sizes) and match[3] == "0", out


def test_python_engine_and_an_empty_prefix(s3_url: str, tmp_path: Path) -> None:
    write_tree(tmp_path / "src", {"a b/ü+.bin": 6 << 20, "empty": 0})
    assert cp(str(tmp_path / "src"), f"{s3_url}/py", "-r", "--engine", "python")[0] == 0
    assert cp(f"{s3_url}/py", str(tmp_path / "back"), "-r", "--engine", "python")[0] == 0
    assert tree(tmp_path / "back") == tree(tmp_path / "src")
    # A prefix that holds nothing copies as nothing: an empty directory.
    code, out, _ = cp(f"{s3_url}/nothing-here", str(tmp_path / "none"), "-r")
    assert code == 0 and FINAL_LINE.match(out.strip()) and out.startswith("copied 0 files, 0 bytes"), out
    assert tree(tmp_path / "none") == {}


def test_single_files_by_name_and_into_directories(s3_url: str, tmp_path: Path) -> None:
    (tmp_path / "one.bin").write_bytes(b"x" * 12345)
    assert cp(str(tmp_path / "one.bin"), f"{s3_url}/renamed.bin")[0] == 0
    assert cp(str(tmp_path / "one.bin"), f"{s3_url}/dir/")[0] == 0
    (tmp_path / "out").mkdir()
    assert cp(f"{s3_url}/dir/one.bin", str(tmp_path / "out"))[0] == 0
    assert cp(f"{s3_url}/renamed.bin", str(tmp_path / "out" / "copy.bin"))[0] == 0
    assert (tmp_path / "out" / "one.bin").read_bytes() == (tmp_path / "out" / "copy.bin").read_bytes() == b"x" * 12345
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["copy.bin", "one.bin"]


def test_bad_input_is_one_line_and_exit_2(s3_url: str, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"1")
    cases = {
        ("ftp://host/x", str(tmp_path)): "unknown scheme 'ftp://'",
        (f"{s3_url}/missing.bin", str(tmp_path)): f"{s3_url}/missing.bin: no such object",
        (str(tmp_path / "nope"), f"{s3_url}/x"): "no such local file",
        (str(tmp_path / "f"), "s3://no-such-bucket-here/f"): "bucket 'no-such-bucket-here' does not exist",
    }
    cp(str(tmp_path / "f"), f"{s3_url}/prefix/f")
    cases[(f"{s3_url}/prefix", str(tmp_path))] = "is a prefix, not an object: add --recursive"
    for (src, dst), expected in cases.items():
        code, _, err = cp(src, dst)
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, (src, err)
    code, _, err = cp(str(tmp_path / "f"), f"{s3_url}/x", "--engine", "rust")
    assert code == 2 and err.strip() == "error: --engine 'rust': use native or python", err


def test_wrong_credentials_are_one_line(s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "f").write_bytes(b"1" * 1000)
    assert cp(str(tmp_path / "f"), f"{s3_url}/f")[0] == 0
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not/the/right/secret/key/0123456789abcdef")
    for src, dst in [(str(tmp_path / "f"), f"{s3_url}/g"), (f"{s3_url}/f", str(tmp_path / "back"))]:
        code, _, err = cp(src, dst)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert re.search(r"access denied \((SignatureDoesNotMatch|403)\): check the credentials", err), err


def _kind(note: str) -> str:
    return "crc" if "CRC64NVME" in note else "one object" if note == ONE_OBJECT_NOTE else "tree"


def test_bench_transfer_smoke(tmp_path: Path) -> None:
    """The benchmark end to end at a tiny size: both engines and s5cmd on S3, both engines and transfer_manager on
    GCS (where the emulator's missing XML multipart is said in the row), the python engine and AzCopy on Azurite."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "transfer", "--size-gb", "0.02", "--repeats", "1", "--gcs-size-gb",
                                      "0.005", "--azure-size-gb", "0.005", "--clients", "trainpipe,s5cmd", "--json",
                                      str(out), "--workdir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = {(r["store"], r["direction"], r["client"], r["engine"], _kind(r["note"])): r
            for r in json.loads(out.read_text())["rows"]}
    trainpipe = {("trainpipe", "native"), ("trainpipe", "python")}
    trainpipe_and_s5cmd = (("trainpipe", "native"), ("s5cmd", ""))
    assert set(rows) == {("s3", d, c, e, kind) for d in ("download", "upload")
                         for c, e in {*trainpipe, ("s5cmd", "")} for kind in ("tree", "one object")} | {
        ("s3", "download", "local cp", "", "tree"), ("s3", "download", "trainpipe", "native", "crc"),
        ("s3", "download", "s5cmd", "", "crc")} | {
        ("gcs", d, c, e, "tree") for d in ("download", "upload") for c, e in {*trainpipe, ("transfer_manager", "")}} | {
        ("azure", d, c, e, "tree") for d in ("download", "upload")
        for c, e in (("trainpipe", "python"), ("azcopy", ""))}
    for key, row in rows.items():
        runs = ONE_OBJECT_RUNS if key[-1] == "one object" else 1
        assert len(row["mb_per_s"]) == runs and min(row["mb_per_s"]) > 0 and not row["note"].startswith("failed"), row
        if key[-1] != "one object":  # a 1 MiB copy's CPU is below the clock tick that counts it
            assert row["client_cpu_s_per_gb"] > 0, row
            assert row["server_cpu_s_per_gb"] >= 0 and (row["server_cpu_s_per_gb"] == 0 or row["client"] != "local cp")
    # A 5 MB copy can cost the server less than one clock tick (seen on the GCS emulator in CI): each store's server
    # is counted over all its rows.
    for store in ("s3", "gcs", "azure"):
        assert sum(r["server_cpu_s_per_gb"] for k, r in rows.items() if k[0] == store and k[-1] != "one object") > 0
    assert rows[("s3", "download", "s5cmd", "", "tree")]["vs_s5cmd"] == 1.0
    # The native engine on CRC-keeping objects is compared with s5cmd on those same objects.
    crc_row, crc_peer = (rows[("s3", "download", client, engine, "crc")] for client, engine in trainpipe_and_s5cmd)
    # Ratios are of the unrounded medians (the rows' `median` is rounded to 0.1 MB/s, coarse at a tiny copy's speed).
    assert crc_row["vs_s5cmd"] == pytest.approx(median(crc_row["mb_per_s"]) / median(crc_peer["mb_per_s"]), abs=0.002)
    # A small copy is compared with s5cmd's small copy, and its ceiling is the best small copy, not the tree's.
    for direction in ("download", "upload"):
        small, small_peer = (rows[("s3", direction, client, engine, "one object")]
                             for client, engine in trainpipe_and_s5cmd)
        assert small["vs_s5cmd"] == pytest.approx(median(small["mb_per_s"]) / median(small_peer["mb_per_s"]),
                                                  abs=0.002)
        small_copies = [row for key, row in rows.items() if key[1] == direction and key[-1] == "one object"]
        assert max(row["of_ceiling"] for row in small_copies) == 1.0, small_copies
    assert "no XML multipart" in rows[("gcs", "upload", "trainpipe", "native", "tree")]["note"]
    for direction in ("download", "upload"):  # Azure's row against AzCopy's, side by side
        azure, azcopy = (rows[("azure", direction, client, engine, "tree")]
                         for client, engine in (("trainpipe", "python"), ("azcopy", "")))
        # (one run each: the median is that run, unrounded in mb_per_s)
        assert azure["vs_azcopy"] == pytest.approx(azure["mb_per_s"][0] / azcopy["mb_per_s"][0], abs=0.002)
    assert "trainpipe" in result.output and "engine" in result.output and "of ceil" in result.output


def test_the_installed_cp_starts_on_the_storage_imports_alone(s3_url: str, tmp_path: Path) -> None:
    """`trainpipe cp` is timed start to exit against s5cmd: it must not pay for the whole CLI's imports."""
    write_tree(tmp_path / "src", {"a.bin": 1000})
    # Nor for botocore's (its import and S3 client were ~0.3 s), typer's (pydantic) or rich's (no terminal here):
    # listing, HEAD and the bytes both ways go through the CRT. Nor for the standard library's slower imports that
    # only rare paths need (each ~5-15 ms of CPU: S3's dates other than its own form, a region from ~/.aws/config);
    # tempfile only where a file lands under another name.
    heavy = ('pandas', 'trainpipe.cli', 'prefect', 'botocore', 'boto3', 'typer', 'pydantic', 'rich', 'email.utils',
             'configparser', 'uuid', 'tempfile')
    probe = ("import sys, runpy; sys.argv = ['trainpipe', *sys.argv[1:]]\n"
             "try:\n    runpy.run_module('trainpipe.entry', run_name='__main__')\n"
             f"finally:\n    print(sorted(m for m in {heavy!r} if m in sys.modules))")
    copies = (["-r", str(tmp_path / "src"), f"{s3_url}/cp-probe"], ["-r", f"{s3_url}/cp-probe", str(tmp_path / "back")],
              [f"{s3_url}/cp-probe/a.bin", str(tmp_path / "one.bin")])
    for args, loaded in zip(copies, ("[]", "[]", "['tempfile']"), strict=True):
        result = subprocess.run([sys.executable, "-c", probe, "cp", *args],
                                capture_output=True, text=True, env=dict(os.environ), timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().splitlines()[-1] == loaded, (args, result.stdout)
    assert (tmp_path / "back" / "a.bin").read_bytes() == (tmp_path / "one.bin").read_bytes() == (
        tmp_path / "src" / "a.bin").read_bytes()
    bad = subprocess.run([TRAINPIPE, "cp", str(tmp_path / "missing"), f"{s3_url}/x"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no such local file" in bad.stderr
