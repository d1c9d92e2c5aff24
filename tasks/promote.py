"""Promote: move MODEL@ALIAS to the evaluated checkpoint only when its metric beats the champion's.

The champion is the checkpoint the alias points at now; its metric is its eval record in the store (what its own
evaluation wrote), else the metrics its promotion recorded. The first run of a model is promoted and says so. The
move is the registry's compare-and-swap from the position read here: a rival run that moved the alias meanwhile
wins, and this run is refused (AliasConflict), nothing torn. Either way an event says what was decided
(`trainpipe.model.promoted` / `trainpipe.model.rejected`, the model, alias and checkpoint as its resource), so an
automation can deploy on it.
"""

from __future__ import annotations

import getpass
from dataclasses import asdict, dataclass
from typing import Any

from prefect import get_run_logger, task
from prefect.events import emit_event

from infra.checkpoints.store import CheckpointStore
from infra.job.spec import PromoteSpec
from infra.registry import AliasMove, Registry, RegistryError, resolve_checkpoint
from infra.storage import open_store
from tasks.evaluate import Evaluation
from tasks.policy import NO_RETRIES

PROMOTED_EVENT = "trainpipe.model.promoted"
REJECTED_EVENT = "trainpipe.model.rejected"


class PromotionError(RuntimeError):
    """The gate could not decide (a metric the evaluation does not hold) or the alias could not be moved."""


@dataclass(frozen=True)
class Decision:
    promoted: bool
    model: str
    alias: str
    checkpoint: str  # the evaluated step URL
    metric: str
    value: float
    champion: str | None  # the step URL the alias pointed at when the gate read it
    champion_value: float | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def beats(value: float, champion: float, mode: str, min_delta: float) -> bool:
    return value < champion - min_delta if mode == "min" else value > champion + min_delta


def champion_metric(move: AliasMove, metric: str, root_url: str) -> float | None:
    """The metric recorded for the checkpoint the alias points at: its eval record, else its promotion's."""
    assert move.target is not None
    target = resolve_checkpoint(move.target, root_url)
    record = CheckpointStore(open_store(target.run_url)).eval(target.step)
    recorded = record.metrics if record is not None else move.metrics
    return recorded.get(metric)


def decide(spec: PromoteSpec, evaluation: Evaluation, champion: AliasMove | None, root_url: str) -> Decision:
    if spec.metric not in evaluation.metrics:
        raise PromotionError(f"promote.metric {spec.metric!r}: the evaluate file holds only "
                             f"{', '.join(sorted(evaluation.metrics))}: set promote.metric to one of them or write "
                             f"{spec.metric} from the evaluate command")
    value = evaluation.metrics[spec.metric]
    ref = f"{spec.model}@{spec.alias}"

    def decision(promoted: bool, reason: str, at: str | None = None, best: float | None = None) -> Decision:
        return Decision(promoted, spec.model, spec.alias, evaluation.checkpoint, spec.metric, value, at, best, reason)

    if champion is None or champion.target is None:
        return decision(True, f"first run of {ref}: promoted with {spec.metric} {value:.6g}")
    best = champion_metric(champion, spec.metric, root_url)
    if best is None:
        return decision(True, f"the champion {champion.target} has no recorded {spec.metric}: promoted with "
                        f"{value:.6g}", champion.target)
    delta = f" by more than {spec.min_delta:g}" if spec.min_delta else ""
    if beats(value, best, spec.mode, spec.min_delta):
        return decision(True, f"{spec.metric} {value:.6g} beats the champion's {best:.6g}{delta} ({spec.mode}): "
                        "promoted", champion.target, best)
    return decision(False, f"{spec.metric} {value:.6g} does not beat the champion's {best:.6g}{delta} ({spec.mode}): "
                    f"kept {champion.target}", champion.target, best)


@task(name="promote", **NO_RETRIES)
def promote_checkpoint(spec: PromoteSpec, evaluation: Evaluation, root_url: str, run_id: str) -> Decision:
    """root_url: job.checkpoints.url, where the registry lives. Not retried: a compare-and-swap that lost must not
    be tried again over the winner."""
    logger = get_run_logger()
    registry = Registry(root_url)
    champion = registry.resolve(spec.model, spec.alias)
    verdict = decide(spec, evaluation, champion, root_url)
    if verdict.promoted:
        try:
            registry.promote(spec.model, spec.alias, evaluation.checkpoint, metrics=evaluation.metrics,
                             reason=verdict.reason, who=f"{getpass.getuser()} (run {run_id})", run_id=run_id,
                             expected_previous=champion.target if champion is not None else None)
        except RegistryError as exc:
            raise PromotionError(f"promote {spec.model}@{spec.alias}: {exc}") from None
    logger.info("promote: %s", verdict.reason)
    emit_event(
        event=PROMOTED_EVENT if verdict.promoted else REJECTED_EVENT,
        resource={"prefect.resource.id": f"trainpipe.model.{spec.model}.{spec.alias}",
                  "prefect.resource.name": f"{spec.model}@{spec.alias}",
                  "trainpipe.model": spec.model, "trainpipe.alias": spec.alias,
                  "trainpipe.checkpoint": evaluation.checkpoint},
        payload=verdict.to_dict())
    return verdict
