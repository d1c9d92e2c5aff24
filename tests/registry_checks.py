"""Committed checkpoints to point aliases at, and the race of two promoters, for any store URL."""

from __future__ import annotations

import os
import threading
from itertools import pairwise
from pathlib import Path
from typing import Any, cast

from infra.checkpoints.lineage import Lineage
from infra.checkpoints.steps import step_name
from infra.checkpoints.store import CheckpointStore
from infra.registry import AliasConflict, AliasMove, Registry
from infra.storage import ObjectInfo, ObjectStore, open_store


def commit_step(root_url: str, run_id: str, step: int, scratch: Path, lineage: Lineage | None = None) -> str:
    """A one-node, one-file committed checkpoint at <root_url>/<run_id>/step-N; returns its step URL."""
    checkpoints = CheckpointStore(open_store(f"{root_url}/{run_id}"))
    local = scratch / f"{run_id}-{step}"
    local.mkdir(parents=True)
    (local / "weights.bin").write_bytes(os.urandom(256))
    checkpoints.upload_node_part(local, step, 0, ["weights.bin"], "a1")
    assert checkpoints.try_commit(step, 1, 1, "cfg", "a1", lineage=lineage) is not None
    return f"{checkpoints.store.url}/{step_name(step)}"


class _ClaimAtOnce:
    """A racer's store whose first claim, or create-only move where the store honours those (no claims then), waits
    until every racer is about to write its own: the race at its worst, every time (without the claims protocol or
    the create-only write, every racer would then write the move)."""

    def __init__(self, store: ObjectStore, barrier: threading.Barrier) -> None:
        self._store = store
        self._barrier = barrier
        self._waited = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _all_at_once(self) -> None:
        if not self._waited:
            self._waited = True
            self._barrier.wait(timeout=30)

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        if "/claims/" in key:
            self._all_at_once()
        return self._store.put_bytes(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if "/history/" in key:
            self._all_at_once()
        return self._store.put_if_absent(key, data)


def race_promoters(root_url: str, targets: list[str], model: str = "m", alias: str = "production"
                   ) -> tuple[list[AliasMove], list[AliasConflict]]:
    """Every target promoted at once from its own thread (and Registry), all having read the same position."""
    expected = (move.target if (move := Registry(root_url).resolve(model, alias)) else None)
    claiming = threading.Barrier(len(targets))
    won: list[AliasMove] = []
    refused: list[AliasConflict] = []
    failed: list[BaseException] = []

    def promote(target: str) -> None:
        registry = Registry(root_url)
        registry.store = cast(ObjectStore, _ClaimAtOnce(registry.store, claiming))
        try:
            won.append(registry.promote(model, alias, target, metrics={"eval_loss": 1.0}, reason="race",
                                        who=f"racer-{target[-3:]}", expected_previous=expected))
        except AliasConflict as exc:
            refused.append(exc)
        except BaseException as exc:  # the test says what else went wrong
            failed.append(exc)

    threads = [threading.Thread(target=promote, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a promoter hung"
    assert not failed, failed
    return won, refused


def check_race(root_url: str, scratch: Path, racers: int = 2) -> None:
    """Racers promote at once from one position: exactly one wins, the others are refused naming the winner, and the
    history holds exactly one move per position, each from where the previous one left the alias."""
    first = commit_step(root_url, "run-0", 1, scratch)
    Registry(root_url).promote("m", "production", first, metrics={}, reason="first", who="t")
    targets = [commit_step(root_url, f"run-{i + 1}", 1, scratch) for i in range(racers)]
    won, refused = race_promoters(root_url, targets)
    assert len(won) == 1 and len(refused) == racers - 1, (won, refused)
    assert all("production" in str(exc) and won[0].target in str(exc) for exc in refused), refused
    registry = Registry(root_url)
    history = registry.history("m", "production")
    assert [move.seq for move in history] == [1, 2]
    assert [move.target for move in history] == [first, won[0].target]
    assert history[1].previous == first
    assert registry.resolve("m", "production") == won[0]
    leftovers = [info.key for info in registry.store.list("_registry/") if "/claims/" in info.key]
    assert leftovers == []


def check_rounds(root_url: str, scratch: Path, rounds: int, racers: int = 2) -> list[tuple[int, int]]:
    """rounds races in a row on one alias, each from where the last left it: every round has exactly one winner and
    the history has no gap (each move leaves from the one before). Returns (won, refused) per round."""
    first = commit_step(root_url, "run-0", 1, scratch)
    Registry(root_url).promote("m", "production", first, metrics={}, reason="first", who="t")
    outcomes: list[tuple[int, int]] = []
    for round_number in range(1, rounds + 1):
        targets = [commit_step(root_url, f"run-{round_number}-{i}", 1, scratch) for i in range(racers)]
        won, refused = race_promoters(root_url, targets)
        outcomes.append((len(won), len(refused)))
        assert len(won) == 1 and len(refused) == racers - 1, (round_number, won, refused)
    history = Registry(root_url).history("m", "production")
    assert [move.seq for move in history] == list(range(1, rounds + 2))
    assert all(move.previous == before.target for before, move in pairwise(history))
    assert not [info.key for info in Registry(root_url).store.list("_registry/") if "/claims/" in info.key]
    return outcomes
