"""The `trainpipe` command line for real: the installed console script in subprocesses, or the Typer app in
process where a second interpreter would only add seconds (Great Expectations and torch imports).

Nothing is mocked: clusters are real local node directories, datasets and checkpoints real files in a file://
store, checkpoints real torch.distributed.checkpoint output. No Prefect, no torchrun.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest
from conftest import run_trainpipe
from jobs import job_config, make_dataset, write_config
from typer.testing import CliRunner, Result

from infra.checkpoints.steps import step_name
from infra.checkpoints.store import CheckpointStore
from infra.storage import open_store
from trainpipe.cli import app


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The installed console script in its own process; TRAINPIPE_HOME comes from the `workspace` fixture."""
    return run_trainpipe(*args, timeout=timeout)


def invoke(*args: str) -> Result:
    """The same commands in this process (stdout and stderr kept apart)."""
    return CliRunner().invoke(app, list(args))


def error_line(stderr: str) -> str:
    """The one non-blank stderr line a user error must produce."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one stderr line, got: {stderr!r}"
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def flip_bytes(path: Path, offset: int, count: int = 4) -> None:
    """Corrupt a file in place, keeping its size (only a checksum can tell)."""
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def dataset_url(tmp_path: Path) -> str:
    return make_dataset(tmp_path / "dataset", tokens=200_000, shard_tokens=100_000)


# ---- clusters: up, status, sweep, down ------------------------------------------------------------------------


def test_up_status_sweep_down(workspace: Path, tmp_path: Path, dataset_url: str) -> None:
    run_id = f"cli-{uuid.uuid4().hex[:8]}"  # unique: `down` kills any process on this machine tagged with the name
    cluster = f"tp-{run_id}"
    config = write_config(tmp_path / "job.yaml", job_config(tmp_path, dataset_url))

    up = run_cli("up", str(config), "--run-id", run_id)
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"cluster {cluster} (local) is up:" in up.stdout
    base = workspace / "clusters" / cluster
    for rank in (0, 1):
        assert f"{cluster}-node-{rank}  rank {rank}  127.0.0.1" in up.stdout
        for sub in ("data", "ckpt", "logs"):
            assert (base / f"node-{rank}" / sub).is_dir()

    # The `up` process has exited, so its cluster has no live owner any more.
    status = run_cli("status")
    assert status.returncode == 0, status.stderr
    assert "1 clusters" in status.stdout
    line = next(line for line in status.stdout.splitlines() if cluster in line)
    assert f"run {run_id}" in line and "2 nodes" in line and "0 processes" in line and "ORPHANED" in line

    before = sorted(str(p.relative_to(workspace)) for p in workspace.rglob("*"))
    dry = invoke("sweep", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert f"would tear down {cluster} (local, run {run_id}, 0 processes)" in dry.stdout
    assert "1 clusters would be swept" in dry.stdout
    assert sorted(str(p.relative_to(workspace)) for p in workspace.rglob("*")) == before, "--dry-run changed things"
    assert "ORPHANED" in invoke("status").stdout

    down = run_cli("down", cluster)
    assert down.returncode == 0, down.stdout + down.stderr
    assert down.stdout.strip() == f"{cluster}: torn down on local"
    assert not base.exists()
    again = invoke("down", cluster)
    assert again.exit_code == 0, again.output
    assert again.stdout.strip() == f"{cluster}: nothing was running"

    after = invoke("status")
    assert after.exit_code == 0, after.output
    assert after.stdout.splitlines()[0] == "0 clusters"
    assert cluster not in after.stdout


# ---- datasets: synth and validate -----------------------------------------------------------------------------


def test_dataset_synth_and_validate(workspace: Path, tmp_path: Path) -> None:
    root = tmp_path / "tokens"
    url = f"file://{root}"
    synth = run_cli("dataset", "synth", url, "--tokens", "300000", "--shard-tokens", "100000")
    assert synth.returncode == 0, synth.stdout + synth.stderr
    assert f"{url}: 3 shards, 300,000 tokens, vocab 256, loss floor 1.0889 nats" in synth.stdout
    assert sorted(p.name for p in root.iterdir()) == [
        "manifest.json", "shard-00000.bin", "shard-00001.bin", "shard-00002.bin"]

    ok = invoke("dataset", "validate", url)
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.splitlines()[0].startswith(f"{url}: 3 shards, 300,000 tokens, vocab 256: OK")

    vocab = invoke("dataset", "validate", url, "--vocab-size", "512")
    assert vocab.exit_code == 1, vocab.output
    assert "dataset vocab_size 256 != model vocab_size 512" in vocab.stdout

    flip_bytes(root / "shard-00001.bin", offset=1000)
    bad = invoke("dataset", "validate", url)
    assert bad.exit_code == 1, bad.output
    assert "shard-00001.bin: sha256 mismatch" in bad.stdout
    assert "shard-00000.bin" not in bad.stdout and "shard-00002.bin" not in bad.stdout

    # No manifest: one line naming it, exit 2, before anything heavy is imported.
    (tmp_path / "empty").mkdir()
    missing = run_cli("dataset", "validate", f"file://{tmp_path}/empty")
    assert missing.returncode == 2, missing.stdout + missing.stderr
    line = error_line(missing.stderr)
    assert f"file://{tmp_path}/empty/manifest.json" in line and "no dataset manifest" in line


# ---- plan -----------------------------------------------------------------------------------------------------


def test_plan_prints_the_plan_and_launches_nothing(workspace: Path, tmp_path: Path, dataset_url: str) -> None:
    config = write_config(tmp_path / "job.yaml", job_config(tmp_path, dataset_url, expectations=True))
    result = invoke("plan", str(config), "--run-id", "plan-run")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "run plan-run on local: 2 nodes × 1 processes (cluster tp-plan-run)" in out
    assert f"dataset: {dataset_url} — 3 files, 0.4 MB (tokens 2, json 1); every node holds 0.4 MB" in out
    assert f"snapshot: file://{tmp_path}/store/ckpt/plan-run/_dataset/snapshot.json (taken now)" in out
    assert "expectations: 1 on 2 tabular files (every row; 200,000 rows, 0.4 of 0.4 MB read in" in out
    assert f"checkpoints: file://{tmp_path}/store/ckpt/plan-run — start at step 0" in out
    assert ("disk per node (largest): dataset 0.4 MB + inputs 0.0 MB + local checkpoints 0.0 MB (checkpoints."
            "keep_local 2 × 0.0 MB) + peer replicas 0.0 MB (2 × a node's part 0.0 MB) + share dir 0.0 MB (links to "
            "the above, unlinked after each exchange) = 0.4 MB") not in out, "no checkpoint size is known"
    assert "; checkpoints not counted: no size known: set checkpoints.size_bytes" in out
    assert "hang detection: no new step and no new checkpoint for 1800s" in out and "reports neither" in out
    assert not (workspace / "clusters").exists() or not any((workspace / "clusters").iterdir()), "plan launched"


def test_plan_refuses_a_job_the_nodes_disks_cannot_hold_naming_each_term(workspace: Path, tmp_path: Path,
                                                                         dataset_url: str) -> None:
    config = job_config(tmp_path, dataset_url)
    config["checkpoints"]["keep_local"] = 3
    config["checkpoints"]["size_bytes"] = 10**9
    fits = invoke("plan", str(write_config(tmp_path / "fits.yaml", config)), "--run-id", "fits")
    assert fits.exit_code == 0, fits.output
    assert ("disk per node (largest): dataset 0.4 MB + inputs 0.0 MB + local checkpoints 3.00 GB (checkpoints."
            "keep_local 3 × 1.00 GB) + peer replicas 1.00 GB (2 × a node's part 500.0 MB) + share dir 0.0 MB (links "
            "to the above, unlinked after each exchange) = 4.00 GB") in fits.stdout

    config["checkpoints"]["size_bytes"] = 10**17  # 100 PB: no disk here holds it
    refused = invoke("plan", str(write_config(tmp_path / "huge.yaml", config)), "--run-id", "huge")
    assert refused.exit_code == 2, refused.output
    line = refused.output.strip().splitlines()[-1]
    assert "dataset, local checkpoints and peer replicas: the 2 local nodes would hold" in line, line
    for term in ("dataset 0.4 MB", "inputs 0.0 MB", "local checkpoints 300,000,000.00 GB (checkpoints.keep_local 3",
                 "peer replicas 100,000,000.00 GB", "share dir 0.0 MB"):
        assert term in line, (term, line)


def test_plan_bad_config_is_one_line_exit_2(workspace: Path, tmp_path: Path, dataset_url: str) -> None:
    config = job_config(tmp_path, dataset_url)
    config["cluster"]["nodes"] = 0
    result = run_cli("plan", str(write_config(tmp_path / "bad.yaml", config)))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cluster.nodes" in error_line(result.stderr)
    assert result.stdout == ""
    assert not (workspace / "clusters").exists()

    # ssh hosts whose cluster address is public: the peer servers would listen on the internet.
    key = tmp_path / "id_ed25519"
    key.write_text("a key\n")
    host = {"user": "ubuntu", "key_file": str(key), "workdir": "/nvme", "host_key": "SHA256:" + "a" * 43}
    config["cluster"] = {"provider": "ssh", "nodes": 2, "ssh": {"hosts": [{**host, "host": "10.0.0.1"},
                                                                          {**host, "host": "198.51.100.7"}]}}
    public = invoke("plan", str(write_config(tmp_path / "public.yaml", config)))
    assert public.exit_code == 2, public.output
    assert "cluster.ssh.hosts[1] (198.51.100.7): cluster address 198.51.100.7 is public" in error_line(public.stderr)
    assert "allow_public_cluster_address: true" in error_line(public.stderr) and public.stdout == ""


# ---- checkpoints: ls and verify -------------------------------------------------------------------------------


def save_dcp_step(local_root: Path, step: int) -> Path:
    """A real single-process DCP checkpoint of a tiny model, laid out as trainer.checkpoint writes it."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    state = {
        "model": model.state_dict(),
        "optim": {"state.0.step": torch.tensor(float(step))},
        "extra": json.dumps({"step": step}, sort_keys=True),
    }
    step_dir = local_root / step_name(step)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=step_dir)
    return step_dir


@pytest.fixture
def checkpoint_url(tmp_path: Path) -> str:
    """A run's checkpoint root with committed steps 10 and 20, and an uncommitted (half-uploaded) step 30."""
    url = f"file://{tmp_path}/store/run-1"
    checkpoints = CheckpointStore(open_store(url))
    for step in (10, 20):
        step_dir = save_dcp_step(tmp_path / "node-0", step)
        files = sorted(p.name for p in step_dir.iterdir() if p.is_file())
        checkpoints.upload_node_part(step_dir, step, 0, files)
        assert checkpoints.try_commit(step, nodes=1, world_size=1, config_hash="cli-test") is not None
    step_dir = save_dcp_step(tmp_path / "node-0", 30)
    checkpoints.upload_node_part(step_dir, 30, 0, sorted(p.name for p in step_dir.iterdir()))
    assert checkpoints.try_commit(30, nodes=2, world_size=2, config_hash="cli-test") is None, "node 1 is missing"
    return url


def test_ckpt_ls_and_verify(workspace: Path, tmp_path: Path, checkpoint_url: str) -> None:
    listing = invoke("ckpt", "ls", checkpoint_url)
    assert listing.exit_code == 0, listing.output
    lines = listing.stdout.splitlines()
    assert len(lines) == 3, listing.stdout
    assert lines[0].split()[:3] == ["step", "10", "committed"] and "latest" not in lines[0]
    assert lines[1].split()[:5] == ["step", "20", "committed", "2", "files"] and lines[1].endswith("<- latest")
    assert lines[2].split()[:3] == ["step", "30", "uncommitted"] and "latest" not in lines[2]

    verify = invoke("ckpt", "verify", checkpoint_url)
    assert verify.exit_code == 0, verify.output
    report = json.loads(verify.stdout)
    assert report["step"] == 20 and report["files"] == 2 and report["name"] == step_name(20)
    assert report["loaded"]["format"] == "dcp" and report["loaded"]["files"] == 2
    # The model's parameters and the optimizer's one step counter: every tensor DCP's index names.
    assert report["loaded"]["elements"] == 8 * 16 + 16 + 16 * 4 + 4 + 1
    older = invoke("ckpt", "verify", checkpoint_url, "10")
    assert older.exit_code == 0, older.output
    assert json.loads(older.stdout)["step"] == 10

    damaged = tmp_path / "store" / "run-1" / step_name(20) / "files" / "__0_0.distcp"
    flip_bytes(damaged, offset=damaged.stat().st_size // 2)
    result = run_cli("ckpt", "verify", checkpoint_url)
    assert result.returncode == 2, result.stdout + result.stderr
    line = error_line(result.stderr)
    assert f"file://{damaged}" in line and "crc64nvme differs from the manifest" in line
    assert result.stdout == ""


def test_ckpt_verify_without_checkpoints_is_one_line_exit_2(workspace: Path, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store/never-trained"
    result = invoke("ckpt", "verify", url)
    assert result.exit_code == 2, result.output
    assert error_line(result.stderr) == f"error: {url}: no committed checkpoint: train first or check the URL"


def test_a_command_that_outlives_its_timeout_fails_the_test_with_what_it_printed(tmp_path: Path) -> None:
    # A stand-in script that prints, then hangs: the helper must fail (not hang the test, not lose the output).
    hanging = tmp_path / "hang.py"
    hanging.write_text("import sys, time\nprint('started, now stuck', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)still ran after 2 s:.*started, now stuck"):
        run_trainpipe(str(hanging), timeout=2, program=sys.executable)
