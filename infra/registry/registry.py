"""The model registry in the checkpoint store itself: aliases (`<model>@<alias>`) with an append-only history, and
the resolution of any checkpoint reference to a committed step (resolve_checkpoint): an alias resolves through the
registry, and a move checks its target through that resolution, so both live here.

Layout under the store root that holds the runs (job.checkpoints.url):
    _registry/<model>/<alias>/history/00000007.json   move 7 of the alias (an AliasMove): the alias's position is
                                                      its newest move; moves are never rewritten or deleted
    _registry/<model>/<alias>/claims/00000007/<id>    a promoter's claim on move 7, while it decides
    _registry/<model>/<alias>/current.json            the newest move again, for outside readers (a hint, like a
                                                      run's `latest`; trainpipe reads the history)

Compare-and-swap without conditional writes: the test servers (rclone serve s3, gcp-storage-emulator) ignore
If-None-Match / If-Match / ifGenerationMatch, so the protocol needs only what every store gives: atomic puts and a
listing that shows every put completed before it (S3, GCS and file:// are strongly consistent). A promoter that read
move N-1 writes a claim on move N under its own unique key, then lists the claims on N. It writes move N only when
its claim is the only live one and move N does not exist yet; otherwise it withdraws its claim and retries with
backoff, and once move N exists (someone else won) it raises AliasConflict. Two promoters can never both win: the
later claim's listing sees the earlier one (it was written first and is not withdrawn by a winner until move N
exists). A claim left by a promoter that died is ignored once it is CLAIM_TTL_S older (by the store's clock) than a
newer claim; a winner writes its move within CLAIM_TTL_S / 2 of its claim, or gives up.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
import uuid
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from typing import Any

from infra.checkpoints.steps import PATTERN as STEP_PATTERN
from infra.checkpoints.store import CheckpointStore
from infra.registry.refs import (
    AliasConflict,
    CheckpointTarget,
    RegistryError,
    check_name,
    parse_model_ref,
    registry_root_of,
    step_url,
)
from infra.storage import ObjectNotFound, as_url, open_store

log = logging.getLogger(__name__)

REGISTRY_DIR = "_registry"
RECENT_MOVES = 10  # retention keeps what an alias pointed at in its last this many moves (so rollback can land)
CLAIM_TTL_S = 600.0
CONTENTION_DEADLINE_S = 30.0
_STEP_URL = re.compile(rf"^(?P<run>.+)/{STEP_PATTERN}/?$")
_HISTORY_KEY = re.compile(rf"^{REGISTRY_DIR}/(?P<model>[^/]+)/(?P<alias>[^/]+)/history/(?P<seq>\d+)\.json$")


class _Any:
    def __repr__(self) -> str:
        return "ANY"


ANY: Any = _Any()  # promote's expected_previous when the caller read nothing: the position promote reads itself


@dataclass(frozen=True)
class AliasMove:
    """One entry of an alias's append-only history."""

    model: str
    alias: str
    target: str | None  # the step URL it points at from this move on; None: it names nothing
    previous: str | None
    metrics: dict[str, float]
    reason: str
    who: str
    at: str  # ISO UTC
    run_id: str | None
    seq: int = 0  # its number in the alias's history, from 1
    rollback_of: int | None = None  # the move a rollback undid

    @property
    def ref(self) -> str:
        return f"{self.model}@{self.alias}"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class Registry:
    """Aliases of models whose checkpoints live under root_url (job.checkpoints.url)."""

    def __init__(self, root_url: str) -> None:
        self.root_url = root_url
        self.store = open_store(root_url)
        self.url = self.store.url_for(REGISTRY_DIR)

    # ---- reading ------------------------------------------------------------------------------------------

    def _base(self, model: str, alias: str) -> str:
        return f"{REGISTRY_DIR}/{check_name('model', model)}/{check_name('alias', alias)}"

    def _move_key(self, model: str, alias: str, seq: int) -> str:
        return f"{self._base(model, alias)}/history/{seq:08d}.json"

    def _read(self, key: str) -> AliasMove | None:
        try:
            raw = self.store.get_bytes(key)
        except ObjectNotFound:
            return None
        try:
            record = json.loads(raw)
            # Keys a newer trainpipe added are left out, so an older one still reads the history.
            return AliasMove(**{f.name: record[f.name] for f in fields(AliasMove) if f.name in record})
        except (ValueError, TypeError) as exc:
            raise RegistryError(f"{self.store.url_for(key)}: corrupt alias move ({exc}): restore it from a copy; "
                                "moves are never rewritten, so nothing else is at stake") from None

    def _seqs(self, model: str, alias: str) -> list[int]:
        return sorted(int(m["seq"]) for info in self.store.list(f"{self._base(model, alias)}/history/")
                      if (m := _HISTORY_KEY.match(info.key)))

    def _head(self, model: str, alias: str) -> AliasMove | None:
        seqs = self._seqs(model, alias)
        return self._read(self._move_key(model, alias, seqs[-1])) if seqs else None

    def resolve(self, model: str, alias: str) -> AliasMove | None:
        """The alias's current position; None when it names nothing (never promoted, or rolled back to nothing)."""
        head = self._head(model, alias)
        return head if head is not None and head.target is not None else None

    def history(self, model: str, alias: str) -> list[AliasMove]:
        """Every move of the alias, oldest first."""
        moves = [self._read(self._move_key(model, alias, seq)) for seq in self._seqs(model, alias)]
        return [move for move in moves if move is not None]

    def _aliases(self) -> dict[str, dict[str, list[int]]]:
        found: dict[str, dict[str, list[int]]] = {}
        for info in self.store.list(f"{REGISTRY_DIR}/"):
            match = _HISTORY_KEY.match(info.key)
            if match:
                found.setdefault(match["model"], {}).setdefault(match["alias"], []).append(int(match["seq"]))
        return found

    def models(self) -> dict[str, dict[str, AliasMove]]:
        """model → alias → its newest move (whose target is None when the alias names nothing now)."""
        result: dict[str, dict[str, AliasMove]] = {}
        for model, aliases in sorted(self._aliases().items()):
            for alias, seqs in sorted(aliases.items()):
                move = self._read(self._move_key(model, alias, max(seqs)))
                if move is not None:
                    result.setdefault(model, {})[alias] = move
        return result

    def protected(self, run_url: str, recent_moves: int = RECENT_MOVES) -> set[int]:
        """Steps of run_url an alias points at now or pointed at in its last recent_moves moves (the targets of
        those moves and where each moved from): retention must never delete them."""
        prefix = f"{run_url.rstrip('/')}/step-"
        steps: set[int] = set()
        for model, aliases in self._aliases().items():
            for alias, seqs in aliases.items():
                for seq in sorted(seqs)[-max(recent_moves, 1):]:
                    move = self._read(self._move_key(model, alias, seq))
                    for url in (move.target, move.previous) if move else ():
                        if url and url.startswith(prefix) and url[len(prefix):].isdigit():
                            steps.add(int(url[len(prefix):]))
        return steps

    # ---- moving -------------------------------------------------------------------------------------------

    def promote(self, model: str, alias: str, target_url: str, *, metrics: dict[str, float], reason: str, who: str,
                run_id: str | None = None, expected_previous: str | Any | None = ANY) -> AliasMove:
        """Point model@alias at a committed checkpoint (a step URL, a run's root or another model@alias).

        Compare-and-swap: AliasConflict when the alias is not at expected_previous (a step URL, or None for "names
        nothing"), or moves while this call decides; ANY expects the position this call reads first."""
        target = resolve_checkpoint(target_url, self.root_url)
        self._refuse_if_unkept(target)
        head = self._head(model, alias)
        self._expect(model, alias, head, expected_previous)
        return self._append(model, alias, head, target=target.url, metrics=metrics, reason=reason, who=who,
                            run_id=run_id)

    def _refuse_if_unkept(self, target: CheckpointTarget) -> None:
        """A run's retention spares only what the registry at the run's parent protects (registry_root_of; its
        syncer's registry): an alias here pointing at a run anywhere else would not stop that retention deleting it."""
        its_root = registry_root_of(target.run_url)
        if its_root != self.store.url:
            raise RegistryError(f"{target.url}: outside the registry root {self.store.url} (its run's retention keeps "
                                f"only what the registry at {its_root} protects, so it could delete it): promote it "
                                f"there (--root {its_root}), or copy its run under {self.store.url} and promote the "
                                "copy")

    def rollback(self, model: str, alias: str, who: str) -> AliasMove:
        """Move the alias back to where it was before its last move (a new move: history is never rewritten)."""
        head = self._head(model, alias)
        if head is None:
            raise RegistryError(f"{model}@{alias}: never moved, nothing to roll back: check the name (trainpipe "
                                "model ls)")
        if head.previous is not None:
            resolve_checkpoint(head.previous, self.root_url)  # still committed: never point at what is gone
        return self._append(model, alias, head, target=head.previous, metrics={}, who=who, run_id=None,
                            reason=f"rollback of move {head.seq} ({head.reason})", rollback_of=head.seq)

    def _expect(self, model: str, alias: str, head: AliasMove | None, expected: str | Any | None) -> None:
        current = head.target if head else None
        if expected is not ANY and (expected.rstrip("/") if expected else None) != current:
            moved = f"by {head.who} at {head.at}" if head else "never moved"
            raise AliasConflict(f"{model}@{alias}: points at {current} ({moved}), not at {expected} as expected: a "
                                "concurrent move won; read it again (trainpipe model show) and retry")

    def _append(self, model: str, alias: str, head: AliasMove | None, **fields: Any) -> AliasMove:
        """Write the move after head as move head.seq + 1, or raise AliasConflict when another move takes it."""
        seq = (head.seq if head else 0) + 1
        move = AliasMove(model=model, alias=alias, previous=head.target if head else None, at=_now(), seq=seq,
                         **fields)
        claims = f"{self._base(model, alias)}/claims/{seq:08d}/"
        mine = f"{claims}{uuid.uuid4().hex}"
        deadline = time.monotonic() + CONTENTION_DEADLINE_S
        backoff = 0.05
        while True:
            self._refuse_if_taken(move)
            started = time.monotonic()
            self.store.put_bytes(mine, json.dumps({"who": move.who, "at": move.at}).encode())
            rivals = self._rival_claims(claims, mine)
            self._refuse_if_taken(move, withdraw=mine)
            if not rivals and time.monotonic() - started < CLAIM_TTL_S / 2:
                self.store.put_bytes(self._move_key(model, alias, seq), json.dumps(asdict(move), indent=1).encode())
                self.store.put_bytes(f"{self._base(model, alias)}/current.json",
                                     json.dumps(asdict(move), indent=1).encode())
                self.store.delete(mine)  # move N exists now: a later claim on N sees it and loses
                log.info("%s: move %d to %s (%s)", move.ref, seq, move.target, move.reason)
                return move
            self.store.delete(mine)
            if time.monotonic() > deadline:
                raise AliasConflict(f"{move.ref}: another promotion holds move {seq} ({', '.join(rivals)}) and did "
                                    f"not finish within {CONTENTION_DEADLINE_S:.0f} s: retry; if that promotion "
                                    f"died, its claim lapses {CLAIM_TTL_S:.0f} s after it was written")
            log.warning("%s: move %d contended by %d other claim(s): retrying in %.2f s", move.ref, seq,
                        len(rivals), backoff)
            time.sleep(random.uniform(0.0, backoff))
            backoff = min(backoff * 2, 1.0)

    def _rival_claims(self, claims: str, mine: str) -> list[str]:
        listed = list(self.store.list(claims))
        own = next((info for info in listed if info.key == mine), None)
        if own is None:
            raise RegistryError(f"{self.store.url_for(mine)}: a claim just written is not listed: the store does not "
                                "list what was written before (not strongly consistent); the registry needs one that "
                                "does (S3, GCS, file://)")
        lapsed = (own.mtime - CLAIM_TTL_S) if own.mtime is not None else None
        rivals = [self.store.url_for(info.key) for info in listed if info.key != mine
                  and (lapsed is None or info.mtime is None or info.mtime >= lapsed)]
        return rivals

    def _refuse_if_taken(self, move: AliasMove, withdraw: str | None = None) -> None:
        winner = self._read(self._move_key(move.model, move.alias, move.seq))
        if winner is None:
            return
        if withdraw is not None:
            self.store.delete(withdraw)
        raise AliasConflict(f"{move.ref}: moved to {winner.target} by {winner.who} at {winner.at} ({winner.reason}) "
                            f"while this move to {move.target} was deciding: nothing was written; read it again "
                            "(trainpipe model show) and retry")


def resolve_checkpoint(ref: str, root_url: str) -> CheckpointTarget:
    """The committed checkpoint ref names: a step URL, a run's root (its newest commit), or "<model>@<alias>" in the
    registry under root_url. RegistryError naming the ref and the fix when it names nothing committed."""
    model_ref = parse_model_ref(ref)
    if model_ref is not None:
        move = Registry(root_url).resolve(*model_ref)
        if move is None or move.target is None:
            raise RegistryError(f"{ref}: the alias names no checkpoint in {Registry(root_url).url}: promote one first "
                                f"(trainpipe model promote {ref} CKPT) or check the name (trainpipe model ls)")
        return resolve_checkpoint(move.target, root_url)
    url = as_url(ref.strip()).rstrip("/")
    found = _STEP_URL.match(url)
    run_url, step = (found["run"], int(found["step"])) if found else (url, None)
    checkpoints = CheckpointStore(open_store(run_url))
    committed = checkpoints.committed()
    if step is None:
        if not committed:
            raise RegistryError(f"{ref}: no committed checkpoint under it: give a run's checkpoint root or a step URL "
                                "as `trainpipe run` prints it, or <model>@<alias>")
        step = committed[0].step
    elif step not in {manifest.step for manifest in committed}:
        raise RegistryError(f"{ref}: step {step} is not committed (or is damaged): pick a committed step "
                            f"(trainpipe ckpt ls {run_url})")
    return CheckpointTarget(run_url=checkpoints.store.url, step=step, url=step_url(checkpoints.store.url, step))
