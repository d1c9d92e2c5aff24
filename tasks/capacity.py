"""Capacity: a global Prefect concurrency limit on nodes, held from provision to teardown, so that runs of every
deployment together (two schedules, a UI run, a submit) never hold more nodes than the user allows.

Without the limit (`trainpipe serve --max-nodes` creates it) runs are not limited. The slots are leased, so a run
whose process dies frees them when the lease expires, without anyone releasing them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prefect.concurrency.sync import concurrency

NODE_LIMIT = "trainpipe-nodes"
LEASE_S = 120.0  # renewed while the run lives; what a dead run's nodes cost other runs at most


@contextmanager
def nodes_held(nodes: int) -> Iterator[None]:
    with concurrency(NODE_LIMIT, occupy=nodes, lease_duration=LEASE_S):
        yield
