"""The model registry in the checkpoint store itself: aliases (`<model>@<alias>`) with an append-only history, and
the resolution of any checkpoint reference to a committed step (resolve_checkpoint): an alias resolves through the
registry, and a move checks its target through that resolution, so both live here.

Layout under the store root that holds the runs (job.checkpoints.url):
    _registry/<model>/<alias>/history/00000007.json   move 7 of the alias (an AliasMove): the alias's position is
                                                      its newest move; moves are never rewritten or deleted
    _registry/<model>/<alias>/claims/00000007/<id>    a promoter's claim on move 7, while it decides
    _registry/<model>/<alias>/current.json            the newest move again, for outside readers (a hint, like a
                                                      run's `latest`; trainpipe reads the history)

Compare-and-swap: move N is written create-only (ObjectStore.put_if_absent: S3 If-None-Match, GCS
ifGenerationMatch=0, an exclusive create on file://), so of two promoters that read move N-1 exactly one writes move
N, however long either was suspended between its decision and its write; the other is refused by the store and
raises AliasConflict naming the winner.

Some servers accept the precondition and overwrite anyway (rclone serve s3, gcp-storage-emulator: test servers);
honours_create_only finds that out once per store by writing a probe twice, and there the claim protocol stands in,
needing only atomic puts and a listing that shows every put completed before it. A promoter that read move N-1
writes a claim on move N under its own unique key, then lists the claims on N. It writes move N only when its claim
is the only live one and move N does not exist yet, then reads move N back and loses if it is not its own; otherwise
it withdraws its claim and retries with backoff, and once move N exists (someone else won) it raises AliasConflict.
A claim is withdrawn however the attempt ends (a store error, Ctrl-C). A claim left by a promoter that died is
ignored once it is CLAIM_TTL_S older (by the store's clock) than a newer claim; a winner writes its move within
CLAIM_TTL_S / 2 of its claim, or gives up. What no claim can prevent there: a promoter suspended between that check
and its write for longer than CLAIM_TTL_S / 2 writes over a rival's move.

After a move is written, its target is checked again (retention may have deleted it meanwhile: it reads the
protected steps again once a manifest is gone, see infra.checkpoints.commit); a move to a deleted target is undone
by a new move.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from functools import partial
from typing import Any, TypeVar

from infra.checkpoints.protected import ProtectedSteps
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
from infra.storage.retry import call_with_retries

log = logging.getLogger(__name__)
_T = TypeVar("_T")

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

    def protected(self, run_url: str, recent_moves: int = RECENT_MOVES) -> ProtectedSteps:
        """Steps of run_url an alias points at now or pointed at in its last recent_moves moves (the targets of
        those moves and where each moved from): retention must never delete them. Retention reads them again
        (ProtectedSteps.reread) before a step's files go."""
        return ProtectedSteps(self._protected(run_url, recent_moves), lambda: self._protected(run_url, recent_moves))

    def _protected(self, run_url: str, recent_moves: int) -> set[int]:
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
        move = self._append(model, alias, head, target=target.url, metrics=metrics, reason=reason, who=who,
                            run_id=run_id)
        self._undo_if_gone(move)
        return move

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
        move = self._append(model, alias, head, target=head.previous, metrics={}, who=who, run_id=None,
                            reason=f"rollback of move {head.seq} ({head.reason})", rollback_of=head.seq)
        self._undo_if_gone(move)
        return move

    def _undo_if_gone(self, move: AliasMove) -> None:
        """After a move is written, its target must still be committed: a retention that read the protected steps
        before the move and deleted the target after the check that preceded the move (apply_retention reads them
        again only once the manifest is gone) would leave the alias naming nothing. Then the move is undone, by a
        new move back to where it came from, and RegistryError says so."""
        if move.target is None:
            return
        try:
            resolve_checkpoint(move.target, self.root_url)
            return
        except RegistryError as gone:
            reason = f"undo of move {move.seq}: its target {move.target} was deleted as it was written ({gone})"
        try:
            self._append(move.model, move.alias, move, target=move.previous, metrics={}, who=move.who,
                         run_id=move.run_id, reason=reason, rollback_of=move.seq)
        except AliasConflict as moved:
            raise RegistryError(f"{move.ref}: {move.target} was deleted (by retention) as move {move.seq} pointed "
                                f"the alias at it, and the alias moved again before that move could be undone "
                                f"({moved}): check it (trainpipe model show {move.ref})") from None
        raise RegistryError(f"{move.ref}: {move.target} was deleted (by retention) as move {move.seq} pointed the "
                            f"alias at it: the alias is back at {move.previous or 'nothing'} (move {move.seq + 1}); "
                            "promote a checkpoint that is still committed (trainpipe ckpt ls)")

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
        if self.store.honours_create_only(REGISTRY_DIR):
            self._create_move(move)
        else:
            self._claim_and_write(move)
        current = f"{self._base(model, alias)}/current.json"
        self._retried(lambda: self.store.put_bytes(current, _encoded(move)), f"writing {self.store.url_for(current)}")
        log.info("%s: move %d to %s (%s)", move.ref, seq, move.target, move.reason)
        return move

    def _create_move(self, move: AliasMove) -> None:
        """Move N written create-only: the store refuses it once any move N exists, however long this took."""
        key = self._move_key(move.model, move.alias, move.seq)
        if self._retried(lambda: self.store.put_if_absent(key, _encoded(move)), f"writing {self.store.url_for(key)}"):
            return
        winner = self._read(key)
        if winner != move:  # equal: a retried put whose first try had landed, so it is this move
            raise self._lost(move, winner)

    def _claim_and_write(self, move: AliasMove) -> None:
        """Move N written under a claim, for a store that ignores create-only puts: see the module's docstring."""
        claims = f"{self._base(move.model, move.alias)}/claims/{move.seq:08d}/"
        key = self._move_key(move.model, move.alias, move.seq)
        deadline = time.monotonic() + CONTENTION_DEADLINE_S
        backoff = 0.05
        while True:
            self._refuse_if_taken(move)
            with self._claim(claims, move) as (mine, started):
                rivals = self._rival_claims(claims, mine)
                self._refuse_if_taken(move)
                if not rivals and time.monotonic() - started < CLAIM_TTL_S / 2:
                    self._retried(partial(self.store.put_bytes, key, _encoded(move)),
                                  f"writing {self.store.url_for(key)}")
                    self._refuse_if_overwritten(move)
                    return  # move N exists now: a later claim on N sees it and loses, whether this claim is there
            if time.monotonic() > deadline:
                raise AliasConflict(f"{move.ref}: another promotion holds move {move.seq} ({', '.join(rivals)}) and "
                                    f"did not finish within {CONTENTION_DEADLINE_S:.0f} s: retry; if that promotion "
                                    f"died, its claim lapses {CLAIM_TTL_S:.0f} s after it was written")
            log.warning("%s: move %d contended by %d other claim(s): retrying in %.2f s", move.ref, move.seq,
                        len(rivals), backoff)
            time.sleep(random.uniform(0.0, backoff))
            backoff = min(backoff * 2, 1.0)

    @contextmanager
    def _claim(self, claims: str, move: AliasMove) -> Iterator[tuple[str, float]]:
        """A claim on move N under a key of its own, held for the block and removed when it ends, however it ends
        (a store error, Ctrl-C, a cancelled flow): a claim left behind would refuse every promotion of the alias for
        CLAIM_TTL_S. Yields its key and when it was written (monotonic)."""
        mine = f"{claims}{uuid.uuid4().hex}"
        try:
            started = time.monotonic()
            claim = json.dumps({"who": move.who, "at": move.at}).encode()
            self._retried(lambda: self.store.put_bytes(mine, claim), f"claiming {self.store.url_for(mine)}")
            yield mine, started
        except BaseException:
            self._withdraw_while_failing(mine)
            raise
        self._retried(lambda: self.store.delete(mine), f"withdrawing {self.store.url_for(mine)}")

    def _withdraw_while_failing(self, claim: str) -> None:
        """Remove a claim while another failure is on its way out: that one is what the caller must see, so a
        failure to remove the claim too is logged, not raised in its place."""
        try:
            self._retried(lambda: self.store.delete(claim), f"withdrawing {self.store.url_for(claim)}")
        except Exception as exc:
            log.warning("%s: could not withdraw this claim (%s): it lapses %.0f s after it was written",
                        self.store.url_for(claim), exc, CLAIM_TTL_S)

    @staticmethod
    def _retried(call: Callable[[], _T], what: str) -> _T:
        """A registry write, retried with backoff while it fails transiently (a server's 500 under a burst of
        claims): each is idempotent (a claim or move under a key of its own, a delete), and a create-only put that
        landed before its reply was lost is recognised by the caller."""
        return call_with_retries(call, what)

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

    def _refuse_if_taken(self, move: AliasMove) -> None:
        winner = self._read(self._move_key(move.model, move.alias, move.seq))
        if winner is not None:
            raise self._lost(move, winner)

    def _refuse_if_overwritten(self, move: AliasMove) -> None:
        """On a store that ignores create-only puts, a rival that outlived its claim may write move N over this one:
        read it back, and lose if it is not this move any more."""
        written = self._read(self._move_key(move.model, move.alias, move.seq))
        if written != move:
            raise self._lost(move, written)

    def _lost(self, move: AliasMove, winner: AliasMove | None) -> AliasConflict:
        if winner is None:
            return AliasConflict(f"{move.ref}: move {move.seq} vanished while this move to {move.target} was being "
                                 "written (moves are never deleted: check who edits the registry by hand); read it "
                                 "again (trainpipe model show) and retry")
        return AliasConflict(f"{move.ref}: moved to {winner.target} by {winner.who} at {winner.at} ({winner.reason}) "
                             f"while this move to {move.target} was deciding: this move was not recorded; read it "
                             "again (trainpipe model show) and retry")


def _encoded(move: AliasMove) -> bytes:
    return json.dumps(asdict(move), indent=1).encode()


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
