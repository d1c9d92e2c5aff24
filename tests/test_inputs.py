"""Inputs besides the dataset: declared in the job, frozen at plan, staged whole and verified to every node through the
dataset's cache, named to the script by TRAINPIPE_INPUT_<NAME> and {input_<name>}; an undeclared one is an error."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, prefect_home, run_trainpipe
from jobs import COMMIT_TINY_CHECKPOINT, job_config, make_dataset, probe_project, write_config
from test_dataset_stage import failure_line, tree

from infra.checkpoints.store import CheckpointStore
from infra.dataset.snapshot import input_snapshot_key, save_snapshot, take_snapshot
from infra.dataset.spec import InputSpec
from infra.job.plan import PlanError, plan_job
from infra.job.spec import ConfigError, parse_job
from infra.node.events import NodeEvent, parse
from infra.node.protocol import StageRequest
from infra.storage import open_store

PROBE = COMMIT_TINY_CHECKPOINT + """
import hashlib, json, os, sys
base = os.environ["TRAINPIPE_INPUT_BASE"]
files = {}
for folder, _, names in os.walk(base):
    for name in names:
        path = os.path.join(folder, name)
        files[os.path.relpath(path, base)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
told = {"env": base, "argv": sys.argv[1:], "files": files}
out = os.path.join(os.environ["PROBE_OUT"], os.environ["TRAINPIPE_RUN_ID"] + "-" + os.environ["RANK"] + ".json")
with open(out, "w") as handle:
    json.dump(told, handle)
commit_tiny_checkpoint([1.0])
"""
BASE = {"config.json": b'{"n_layer": 1}', "weights/model.bin": os.urandom(300_000), "tokenizer.json": b"{}"}


def _base(root: Path) -> str:
    for name, data in BASE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "SHA256SUMS").write_text("".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in BASE.items()))
    return str(root)  # a plain path: the string form of an input


def _config(tmp_path: Path, command: list[str], inputs: dict) -> dict:
    config = job_config(tmp_path, make_dataset(tmp_path / "dataset", tokens=20_000, shard_tokens=10_000))
    config["training"] = {"command": command}
    config["inputs"] = inputs
    return config


def test_inputs_are_declared_and_their_placeholders_checked(tmp_path: Path) -> None:
    config = _config(tmp_path, ["t.py", "--model", "{input_base}"], {"base": "/models/base"})
    job = parse_job(config)
    assert job.inputs == {"base": InputSpec(url="file:///models/base")}
    assert parse_job({**config, "inputs": {"base": "gpt@production"}}).inputs == {"base": "gpt@production"}

    with pytest.raises(ConfigError, match=r"training\.command\[2\] '\{input_base\}': unknown placeholder "
                                          r"\{input_base\} \(an input placeholder names an entry of inputs:\)"):
        parse_job({**config, "inputs": {"tokenizer": "/models/tok"}})
    with pytest.raises(ConfigError, match=r"input name 'Base'"):
        parse_job({**config, "inputs": {"Base": "/models/base"}})


def test_a_missing_input_or_an_alias_fails_the_plan(workspace: Path, tmp_path: Path) -> None:
    config = _config(tmp_path, ["-m", "trainer.train"], {"base": str(tmp_path / "nothing")})
    with pytest.raises(PlanError, match=r"inputs\.base\.url file://.*/nothing: no objects under this prefix"):
        plan_job(parse_job(config), "run-1")
    with pytest.raises(PlanError, match=r"input gpt@production: the alias names no checkpoint"):
        plan_job(parse_job({**config, "inputs": {"base": "gpt@production"}}), "run-1")


def test_an_input_is_staged_verified_to_every_node_and_reused_from_the_cache(workspace: Path,
                                                                          tmp_path: Path) -> None:
    code, probes = probe_project(tmp_path, PROBE)
    (tmp_path / "base").mkdir()
    config = _config(tmp_path, ["probe.py", "--model", "{input_base}"], {"base": _base(tmp_path / "base")})
    config["training"].update(code=str(code), env={"PROBE_OUT": str(probes)})
    config["dataset"]["fanout"] = "on"  # the dataset and the input: each node fetches a share, the peers the rest
    env = {**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_HOME": prefect_home(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    path = write_config(tmp_path / "job.yaml", config)
    want = {name: hashlib.sha256(data).hexdigest() for name, data in BASE.items()}
    size = sum(len(data) for data in BASE.values()) + len((tmp_path / "base" / "SHA256SUMS").read_bytes())

    digests: list[str] = []
    for night in ("night-1", "night-2"):
        result = run_trainpipe("run", str(path), "--run-id", night, env=env)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        output = result.stdout + result.stderr
        assert "inputs.base: file://" in output and "3 files match the manifests" in output, output[-3000:]
        told = [json.loads((probes / f"{night}-{rank}.json").read_text()) for rank in (0, 1)]
        for rank, probe in enumerate(told):
            assert probe["env"].endswith(f"node-{rank}/inputs/base"), probe["env"]
            assert probe["argv"] == ["--model", probe["env"]]
            assert {k: v for k, v in probe["files"].items() if k != "SHA256SUMS"} == want, "verified on each node"
        summary = json.loads((workspace / "runs" / night / "summary.json").read_text())
        base = summary["inputs"]["base"]
        assert (base["files"], base["bytes"], base["held_to_manifest"]) == (4, size, 3)
        assert base["seconds"] > 0 and base["snapshot"].endswith(f"/{night}/_inputs/base/snapshot.json")
        digests.append(base["snapshot_digest"])
        committed = CheckpointStore(open_store(summary["checkpoint"].rpartition("/")[0])).manifest(
            summary["checkpoint_step"])
        assert committed.lineage is not None and committed.lineage.inputs["base"].snapshot_digest == digests[-1]
        if night == "night-1":
            assert base["fetched_bytes"] == size and base["mb_per_s"] > 0
            stage = summary["stage"]
            assert summary["dataset"]["fanout"] == {"on": True, "why": "dataset.fanout is on"}
            assert stage["fallback_files"] == 0 and all(n > 0 for n in stage["peer_bytes"]), stage
            assert sum(stage["store_bytes"]) == sum(stage["peer_bytes"]) == stage["bytes"], "the store read once"
            # Said from what the nodes reported, not from the setting.
            assert summary["fanout"] == "ran" and "  fanout: ran\n" in result.stdout, summary["fanout"]
        else:
            assert (base["fetched_bytes"], base["reused_bytes"]) == (0, size), "the second night reuses the cache"
            assert summary["fanout"] == "off: nothing to exchange: every node already held its files"
        assert f"input base: {size / 1e6:,.1f} MB" in result.stdout
    assert digests[0] == digests[1] and len(digests[0]) == 64, "the same bytes, the same snapshot digest"


def test_the_node_stages_inputs_alone_through_its_cache_and_refuses_changed_bytes(tmp_path: Path) -> None:
    """dataset.access remote: the stage command stages only the inputs; a second stage fetches nothing; an input
    changed since plan is one line naming it."""
    urls = {}
    for name, files in (("base", BASE), ("tok", {"vocab.json": b'{"a": 1}'})):
        store = open_store(f"file://{tmp_path}/src/{name}")
        for key, data in files.items():
            store.put_bytes(key, data)
        urls[name] = save_snapshot(open_store(f"file://{tmp_path}/ckpt/run-1"), take_snapshot(store, what=name),
                                   input_snapshot_key(name))
    workdir = tmp_path / "node"

    request = StageRequest(inputs=urls, inputs_dir=str(workdir / "inputs"), rank=0, nodes=1, workdir=str(workdir),
                           cache=str(tmp_path / "cache"), run="run-1")

    def stage_inputs() -> subprocess.CompletedProcess[str]:
        return subprocess.run(request.command_line(sys.executable), cwd=REPO, env=request.environment(os.environ),
                              capture_output=True, text=True, timeout=300)

    def events(result: subprocess.CompletedProcess[str]) -> dict[str, dict]:
        assert result.returncode == 0, result.stderr[-3000:]
        kinds = [e.kind for e in map(parse, result.stdout.splitlines()) if e]
        assert NodeEvent.STAGED not in kinds, "no dataset was asked for"
        return {e["name"]: e for e in map(parse, result.stdout.splitlines()) if e and e.kind is NodeEvent.INPUT_STAGED}

    first = events(stage_inputs())
    assert tree(workdir / "inputs" / "base") == BASE and (first["base"]["bytes"], first["tok"]["files"]) == (
        sum(map(len, BASE.values())), 1)
    again = events(stage_inputs())
    assert {n: (e["bytes"], e["skipped_files"]) for n, e in again.items()} == {"base": (0, 3), "tok": (0, 1)}

    open_store(f"file://{tmp_path}/src/base").put_bytes("config.json", b'{"n_layer": 2}')
    assert failure_line(stage_inputs()).startswith("inputs.base changed since run-1's snapshot: file://")
