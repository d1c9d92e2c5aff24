"""A run whose dataset, checkpoints and model registry all live in Azure Blob Storage (Azurite): the dataset staged
from az:// onto 2 local nodes, the checkpoints synced to it, the run evaluated and promoted (its first, so the alias
is written create-only into the az:// registry), and `trainpipe ckpt verify` passing on the committed checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from jobs import GPT_DEFAULTS, job_config, make_dataset
from test_cli import invoke

from infra.job.spec import parse_job
from infra.registry import Registry
from infra.storage import open_store
from infra.storage.transfer import upload

MODEL = ("--vocab-size", "256", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32")


def test_a_run_on_azure_blob_stages_commits_promotes_and_verifies(prefect_server: None, workspace: Path,
                                                                  tmp_path: Path, az_url: str) -> None:
    from flows.retrain import retrain

    local = Path(make_dataset(tmp_path / "data", tokens=200_000).removeprefix("file://"))
    dataset_url = f"{az_url}/datasets/tokens"
    rels = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    upload(local, rels, open_store(dataset_url))
    config = job_config(tmp_path, dataset_url, steps=20, ckpt_every=10)
    config["checkpoints"]["url"] = f"{az_url}/ckpt"
    config["evaluate"] = {"command": ["-m", "trainer.evaluate", "--checkpoint", "{checkpoint}",
                                      "--seed", str(GPT_DEFAULTS["seed"]), *MODEL], "timeout_s": 300}
    config["promote"] = {"model": "gpt", "alias": "production", "metric": "eval_loss", "mode": "min"}

    state = retrain(parse_job(config), "az-run", return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    assert summary["status"] == "completed", summary.get("error")
    checkpoint = summary["checkpoint"]
    assert checkpoint.startswith(f"{az_url}/ckpt/az-run/")
    assert summary["stage"]["bytes"] == sum((local / rel).stat().st_size for rel in rels)
    assert summary["promotion"]["promoted"] and summary["nodes_left"] == 0
    assert Registry(f"{az_url}/ckpt").resolve("gpt", "production").target == checkpoint

    verify = invoke("ckpt", "verify", checkpoint.rsplit("/", 1)[0])
    assert verify.exit_code == 0, verify.output
    report = json.loads(verify.stdout)
    assert report["step"] == 20 and report["loaded"]["format"] == "dcp"
