"""The retraining gates without a cluster: bad input at plan (init_from, evaluate, promote), the evaluate file's
checks, and the promotion decision against a champion in a real registry (file:// store)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from jobs import job_config, make_dataset
from test_spec import base, error_for

from infra.checkpoints.store import CheckpointStore
from infra.job.plan import PlanError, keep_with_run, plan_job
from infra.job.spec import JobSpec, PromoteSpec, parse_job
from infra.registry import Registry
from infra.storage import open_store
from tasks.evaluate import Evaluation, EvaluationFailed, parse_metrics
from tasks.promote import PromotionError, decide


@pytest.mark.parametrize(("section", "expected"), [
    ({"promote": {"model": "gpt"}}, "promote needs metrics to compare: add an evaluate:"),
    ({"evaluate": {"command": ["-m", "e", "{checkpont}"]}}, "unknown placeholder {checkpont}"),
    ({"training": {"command": ["t.py", "{init}"]}}, "unknown placeholder {init}"),
    ({"evaluate": {"command": ["e.py"]}, "promote": {"model": "gpt", "mode": "lower"}}, "promote.mode"),
    ({"evaluate": {"command": ["e.py"]}, "promote": {"model": "a/b"}}, "promote.model"),
])
def test_bad_gate_sections_fail_with_one_line(section: dict, expected: str) -> None:
    config = {**base(), **section}
    assert expected in error_for(config)


def test_every_new_field_has_its_help_in_the_ui_form() -> None:
    schema = JobSpec.model_json_schema()
    defs = schema["$defs"]
    assert defs["TrainingSpec"]["properties"]["init_from"]["description"]
    for name in ("EvaluateSpec", "PromoteSpec"):
        assert all(field.get("description") for field in defs[name]["properties"].values()), name
    assert schema["properties"]["evaluate"]["description"] and schema["properties"]["promote"]["description"]


def test_init_from_that_names_nothing_committed_fails_plan(tmp_path: Path, workspace: Path) -> None:
    dataset = make_dataset(tmp_path / "data", tokens=20_000, shard_tokens=10_000)
    for init_from, expected in (("gpt@production", "gpt@production: the alias names no checkpoint"),
                                (str(tmp_path / "store" / "ckpt" / "no-run"), "no committed checkpoint under it"),
                                (f"file://{tmp_path}/store/ckpt/no-run/step-00000040", "step 40 is not committed")):
        config = job_config(tmp_path, dataset)
        config["training"]["init_from"] = init_from
        with pytest.raises(PlanError) as caught:
            plan_job(parse_job(config), "r1")
        assert str(caught.value).startswith("training.init_from: ") and expected in str(caught.value)
        assert "\n" not in str(caught.value)


def _alias_on_first(tmp_path: Path, naming: Callable[[dict[str, Any]], None]) -> tuple[JobSpec, Registry, str, str]:
    """A job whose config naming() points at gpt@production, two committed steps (night-1's, night-2's) and the
    alias on the first: the job, the registry, the two steps' URLs."""
    config = job_config(tmp_path, make_dataset(tmp_path / "data", tokens=20_000, shard_tokens=10_000))
    naming(config)
    job = parse_job(config)
    first, later = _committed(job.checkpoints.url, "night-1", 10), _committed(job.checkpoints.url, "night-2", 20)
    registry = Registry(job.checkpoints.url)
    registry.promote("gpt", "production", first, metrics={}, reason="first", who="t")
    return job, registry, first, later


def test_a_run_keeps_the_parent_its_first_attempt_resolved(tmp_path: Path, workspace: Path) -> None:
    """The alias moves and the first parent is deleted between attempts: a rerun of the run id starts from (and its
    lineage names) what the first attempt resolved, and once it has a commit of its own needs that parent no more."""
    from flows.retrain import lineage_of
    from infra.compute.providers import Cluster
    from infra.job.summary import RunSummary

    job, registry, first, later = _alias_on_first(tmp_path, lambda config: config["training"].update(
        init_from="gpt@production"))
    root = job.checkpoints.url

    plan = plan_job(job, "r1")
    assert plan.init_from is not None and plan.init_from.url == first and not plan.parent_fixed
    keep_with_run(plan)  # what the flow's plan task does at the first attempt
    registry.promote("gpt", "production", later, metrics={}, reason="moved", who="t")

    again = plan_job(job, "r1")  # killed before any commit: the warm start restores the same parent
    assert again.parent_fixed and again.init_from == plan.init_from
    assert f"warm start: {first} (gpt@production at the run's first attempt)" in again.render()

    open_store(f"{root}/night-1").delete_prefix("")
    with pytest.raises(PlanError, match=f"began from {first} .*no longer committed"):
        plan_job(job, "r1")  # a warm start that cannot have its parent fails at plan, naming it
    _committed(root, "r1", 5)
    resumed = plan_job(job, "r1")  # a resume from its own commit does not need the deleted parent
    assert resumed.resume_step == 5 and resumed.init_from == plan.init_from
    lineage = lineage_of(resumed, Cluster("c", "local", "r1", (), 0.0),
                         RunSummary(run_id="r1", job=job.name, provider="local", nodes=2, started_at=0.0), "1-a")
    assert lineage["parent"] == first

    changed = job.model_copy(update={"training": job.training.model_copy(update={"init_from": later})})
    with pytest.raises(PlanError, match=f"training.init_from is '{later}' but run r1 began from {first}"):
        plan_job(changed, "r1")


@pytest.mark.parametrize(("text", "expected"), [
    (None, "evaluate wrote no /n/eval.json"), ("{", "not JSON"), ("[1]", "not a JSON object"),
    ('{"eval_loss": "low"}', "metric 'eval_loss' is 'low'"), ('{"eval_loss": NaN}', "not a finite number"),
])
def test_an_unusable_eval_file_fails_the_gate(text: str | None, expected: str) -> None:
    with pytest.raises(EvaluationFailed, match=expected):
        parse_metrics(text, "/n/eval.json")
    assert parse_metrics('{"eval_loss": 1, "acc": 0.5}', "/n/eval.json") == {"eval_loss": 1.0, "acc": 0.5}


def _committed(root: str, run: str, step: int) -> str:
    """A committed step (one small file), as a run's syncer would have left it."""
    store = CheckpointStore(open_store(f"{root}/{run}"))
    store.upload_node_part(Path(__file__).parent, step, 0, ["jobs.py"])
    assert store.try_commit(step, 1, 1, "cfg") is not None
    return f"{root}/{run}/step-{step:08d}"


def test_the_gate_promotes_the_first_run_then_only_a_better_metric(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/ckpt"
    spec = PromoteSpec(model="gpt", metric="eval_loss", mode="min", min_delta=0.01)
    first = _committed(root, "night-1", 10)
    registry = Registry(root)
    verdict = decide(spec, Evaluation(first, 10, {"eval_loss": 2.0}, [], 1.0), None, root)
    assert verdict.promoted and "first run of gpt@production" in verdict.reason
    registry.promote("gpt", "production", first, metrics={"eval_loss": 2.0}, reason=verdict.reason, who="t")
    CheckpointStore(open_store(f"{root}/night-1")).record_eval(10, {"eval_loss": 2.0}, command="e")

    champion = registry.resolve("gpt", "production")
    close = decide(spec, Evaluation(first, 20, {"eval_loss": 1.995}, [], 1.0), champion, root)
    assert not close.promoted and "does not beat the champion's 2 by more than 0.01" in close.reason
    better = decide(spec, Evaluation(first, 20, {"eval_loss": 1.5}, [], 1.0), champion, root)
    assert better.promoted and better.champion == first and better.champion_value == 2.0
    maxed = decide(spec.model_copy(update={"mode": "max"}), Evaluation(first, 20, {"eval_loss": 1.5}, [], 1.0),
                   champion, root)
    assert not maxed.promoted
    with pytest.raises(PromotionError, match=r"promote.metric 'eval_loss': the evaluate file holds only acc, f1"):
        decide(spec, Evaluation(first, 20, {"acc": 0.9, "f1": 0.8}, [], 1.0), champion, root)


def test_an_input_named_by_an_alias_stays_what_the_first_attempt_resolved(tmp_path: Path, workspace: Path) -> None:
    """The alias moves between attempts (tonight's promotion, say): a rerun of the run id stages the input its first
    attempt resolved and froze, a new run the one the alias names now, and a rerun whose job names another alias is
    refused in one line."""
    job, registry, first, later = _alias_on_first(tmp_path, lambda config: config.update(
        inputs={"base": "gpt@production"}))

    plan = plan_job(job, "r1")
    assert plan.inputs["base"].url.startswith(f"{first}/") and not plan.inputs["base"].frozen
    keep_with_run(plan)  # what the flow's plan task does at the first attempt
    registry.promote("gpt", "production", later, metrics={}, reason="moved", who="t")

    again = plan_job(job, "r1")
    assert again.inputs["base"].frozen and again.inputs["base"].url == plan.inputs["base"].url
    assert plan_job(job, "r2").inputs["base"].url.startswith(f"{later}/")  # a new run: where the alias is now
    staging = job.model_copy(update={"inputs": {"base": "gpt@staging"}})
    with pytest.raises(PlanError, match=r"^inputs\.base is gpt@staging but run r1 resolved its input from "
                                        r"gpt@production at its first attempt: restore it, or start a new run"):
        plan_job(staging, "r1")


def test_a_model_alias_input_is_the_prefix_of_the_checkpoint_it_points_at(tmp_path: Path) -> None:
    from infra.job.plan import resolve_input_url

    root = f"file://{tmp_path}/ckpt"
    step = _committed(root, "night-1", 10)
    Registry(root).promote("gpt", "production", step, metrics={}, reason="test", who="t")
    prefix = resolve_input_url("gpt@production", root)
    assert prefix.startswith(f"{step}/") and "jobs.py" in [key.rsplit("/", 1)[-1]
                                                           for key in (o.key for o in open_store(prefix).list())]
