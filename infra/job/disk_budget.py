"""A node's disk budget: what one node of the job will hold on its scratch disk, term by term, so plan can refuse a
job that cannot fit and say which term to shrink.

The terms: its share of the dataset (or the whole, replicated) and every input, staged; the checkpoint a warm start
restores (training.init_from, a whole one on every node); the script's local checkpoints (checkpoints.keep_local of
them, each counted whole: a restore puts the whole committed checkpoint on every node); the peer replicas of its ring
buddy's part (infra/node/replica.py keeps REPLICAS_KEPT) and the links of its own part it serves for them, past what
keep_local keeps; and the fan-out share dir, links to files counted above, unlinked after each exchange
(infra/node/unshare.py), so it adds nothing.

A checkpoint's size is the run's own latest commit when it resumes, else the init_from checkpoint's, else
checkpoints.size_bytes (the user's estimate); none of them known, the checkpoint terms are left out and the budget
says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.node.replica import REPLICAS_KEPT


@dataclass(frozen=True)
class Term:
    name: str  # what the bytes are, as the user configures it
    bytes: int
    how: str = ""  # how the bytes were counted ("2 × 1.20 GB"), when not plain


@dataclass(frozen=True)
class CheckpointSize:
    bytes: int | None  # one whole checkpoint; None: not known
    source: str  # where the figure comes from ("init_from's manifest", "checkpoints.size_bytes", ...)


@dataclass(frozen=True)
class DiskBudget:
    """One node's terms (its rank's dataset share; every other term is the same on every node)."""

    rank: int
    terms: tuple[Term, ...]
    checkpoint: CheckpointSize

    @property
    def total(self) -> int:
        return sum(term.bytes for term in self.terms)

    @property
    def held(self) -> str:
        """What the node holds, by the terms that are not empty: "dataset", "dataset and inputs", ..."""
        names = [term.name for term in self.terms if term.bytes]
        return " and ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} and {names[-1]}"

    def render(self) -> str:
        """One line: every term, then the total."""
        parts = [f"{term.name} {size(term.bytes)}" + (f" ({term.how})" if term.how else "") for term in self.terms]
        unknown = "" if self.checkpoint.bytes is not None else f"; checkpoints not counted: {self.checkpoint.source}"
        return f"{' + '.join(parts)} = {size(self.total)}{unknown}"


def size(count: int) -> str:
    return f"{count / 1e9:,.2f} GB" if count >= 1e9 else f"{count / 1e6:,.1f} MB"


def node_budget(rank: int, dataset_bytes: int, inputs_bytes: int, checkpoint: CheckpointSize, *, nodes: int,
                keep_local: int, warm_start: bool, peer_replica: bool) -> DiskBudget:
    """The budget of node `rank`: dataset_bytes its share of the dataset as staged (0: read from the store)."""
    terms = [Term("dataset", dataset_bytes), Term("inputs", inputs_bytes)]
    whole = checkpoint.bytes
    if whole is not None:
        if warm_start:
            terms.append(Term("warm start (training.init_from)", whole))
        terms.append(Term("local checkpoints", keep_local * whole,
                          f"checkpoints.keep_local {keep_local} × {size(whole)}"))
        if peer_replica:
            part = -(-whole // nodes)  # a node's part, rounded up
            # Its own parts it serves stay linked for REPLICAS_KEPT steps: beyond keep_local they hold deleted saves.
            held = REPLICAS_KEPT + max(0, REPLICAS_KEPT - keep_local)
            terms.append(Term("peer replicas", held * part, f"{held} × a node's part {size(part)}"))
    terms.append(Term("share dir", 0, "links to the above, unlinked after each exchange"))
    return DiskBudget(rank, tuple(terms), checkpoint)
