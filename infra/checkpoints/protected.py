"""The steps of a run that retention must not delete (a model alias points at them, or did recently), as read at one
moment, with the way to read them again: retention asks again once a step's manifest is gone and before its files
go, so a promotion that landed meanwhile keeps its step."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable


class ProtectedSteps(frozenset[int]):
    """The steps as read when made; reread() reads them again now (the registry's answer at that moment)."""

    reread: Callable[[], Collection[int]]

    def __new__(cls, steps: Iterable[int], reread: Callable[[], Collection[int]]) -> ProtectedSteps:
        made = super().__new__(cls, steps)
        made.reread = reread
        return made
