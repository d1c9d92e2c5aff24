"""Three nights of retraining with the bundled trainer on 2 local nodes, for real (Prefect flow, torchrun, syncers,
a file:// store holding the checkpoints and the model registry).

Night 1 trains from scratch and, as the model's first run, is promoted to production. Night 2 warm-starts from
production on a dataset with more data, is evaluated and promoted: its first logged loss is night 1's final, not a
cold start's. Night 3 (lr × 100) is evaluated and kept out: production still points at night 2. Then `model
rollback` moves production back to night 1 and `model lineage` prints night 1 → night 2 with datasets and code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import run_trainpipe
from jobs import GPT_DEFAULTS, job_config, make_dataset

from infra.job.parent import load_parent
from infra.job.spec import parse_job
from infra.registry import Registry
from infra.storage import open_store

MODEL = ("--vocab-size", "256", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32")
STEPS = 80


def night(tmp_path: Path, dataset_url: str, lr: float, init_from: str | None) -> dict:
    config = job_config(tmp_path, dataset_url, steps=STEPS, ckpt_every=40, lr=lr)
    config["name"] = "nightly"
    config["training"]["init_from"] = init_from
    config["evaluate"] = {"command": ["-m", "trainer.evaluate", "--checkpoint", "{checkpoint}",
                                      "--seed", str(GPT_DEFAULTS["seed"]), *MODEL], "timeout_s": 300}
    config["promote"] = {"model": "gpt", "alias": "production", "metric": "eval_loss", "mode": "min"}
    return config


def test_three_nights_warm_start_evaluate_promote_reject_rollback_lineage(prefect_server: None, workspace: Path,
                                                                           tmp_path: Path) -> None:
    from flows.retrain import retrain

    small = make_dataset(tmp_path / "data-1", tokens=200_000)
    more = make_dataset(tmp_path / "data-2", tokens=400_000)
    lr = GPT_DEFAULTS["lr"]

    states = {}
    for name, dataset, rate, init_from in (("night-1", small, lr, None), ("night-2", more, lr, "gpt@production"),
                                           ("night-3", more, lr * 100, "gpt@production")):
        state = retrain(parse_job(night(tmp_path, dataset, rate, init_from)), name, return_state=True)
        assert state.is_completed(), state
        states[name] = (state, state.result())
    (state1, one), (state2, two), (state3, three) = states.values()
    root = one["checkpoint"].rsplit("/", 2)[0]

    # Night 1: the model's first run is promoted, and says so.
    assert state1.name == "Promoted" and "first run of gpt@production" in state1.message
    assert one["promotion"]["promoted"] and one["init_from"] is None
    # Night 2: warm start from night 1's promoted checkpoint; its first loss continues night 1's, far below a cold
    # start's (night 1's first loss, ln 256 ≈ 5.5 for an untrained model).
    assert two["init_from"] == one["checkpoint"] and two["start_step"] == 1
    # (the trainer's own final loss: the mean of its last 10 steps; the summary's averages its last logged points)
    final = one["metrics"]["final_loss"]
    assert abs(two["initial_loss"] - final) < 0.05 * final, (two["initial_loss"], final)
    assert two["initial_loss"] < 0.5 * one["initial_loss"]
    assert two["dataset"]["bytes"] > one["dataset"]["bytes"]
    assert state2.name == "Promoted" and two["promotion"]["champion"] == one["checkpoint"]
    assert two["eval"]["metrics"]["eval_loss"] < one["eval"]["metrics"]["eval_loss"]
    # Night 3: evaluated, worse, not promoted; the run still Completed, saying it kept the champion.
    assert state3.name == "Kept champion" and not three["promotion"]["promoted"], state3.message
    assert three["eval"]["metrics"]["eval_loss"] > two["eval"]["metrics"]["eval_loss"]
    assert three["promotion"]["champion"] == two["checkpoint"]
    registry = Registry(root)
    assert registry.resolve("gpt", "production").target == two["checkpoint"]
    # Each warm start kept the parent its plan resolved with the run: a rerun of night 3 starts from night 2's
    # checkpoint, not from wherever production points by then.
    parents = {name: load_parent(open_store(f"{root}/{name}")) for name in states}
    assert parents["night-1"] is None
    assert [(p.url, p.init_from) for p in (parents["night-2"], parents["night-3"]) if p is not None] == [
        (one["checkpoint"], "gpt@production"), (two["checkpoint"], "gpt@production")]
    for summary in (one, two, three):
        assert summary["phases"].keys() >= {"evaluate", "promote"} and summary["nodes_left"] == 0
        assert summary["promotion"]["decided_after_training_s"] > 0

    env = {**os.environ, "TRAINPIPE_HOME": str(workspace)}
    lineage = run_trainpipe("model", "lineage", "gpt@production", "--root", root, "--json", env=env)
    assert lineage.returncode == 0, lineage.stderr
    chain = json.loads(lineage.stdout)
    assert [link["url"] for link in chain] == [one["checkpoint"], two["checkpoint"]]
    assert [link["lineage"]["dataset"]["url"] for link in chain] == [small, more]
    assert chain[1]["lineage"]["parent"] == one["checkpoint"] and chain[0]["lineage"]["parent"] is None
    assert all(link["lineage"]["config_hash"] and "code_sha256" in link["lineage"] for link in chain)

    rollback = run_trainpipe("model", "rollback", "gpt@production", "--root", root, env=env)
    assert rollback.returncode == 0, rollback.stderr
    assert registry.resolve("gpt", "production").target == one["checkpoint"]
    print(f"figures: night 1 first loss {one['initial_loss']:.4f} (cold start), final {final:.4f}; "
          f"night 2 first loss {two['initial_loss']:.4f}; last step → decision "
          f"{[s['promotion']['decided_after_training_s'] for s in (one, two, three)]} s")
