"""`python -m infra.node.launch torch.distributed.run ARGS...`: torchrun as it is, plus one event line when every rank
of this node has exited 0.

torchrun's agent then waits in an exit barrier (300 s) for the other nodes' agents, so its own exit says nothing
until every node is done: a node whose rank hangs at exit (a stuck process-group teardown, a dataloader worker)
would keep every node busy. The event lets the orchestrator give the others a bounded grace instead
(training.exit_grace_s). The launcher's module stays on the command line: that is how a node's watcher finds it.
"""

from __future__ import annotations

import logging
import runpy
import sys
from typing import Any

from infra.node.events import NodeEvent, emit

log = logging.getLogger(__name__)


def _announce_exit_barrier() -> None:
    """The agent enters its exit barrier only once its worker group succeeded: say so first."""
    try:
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    except ImportError:
        return  # not torchrun's agent: nothing to announce, the process's exit says it all
    barrier = getattr(SimpleElasticAgent, "_exit_barrier", None)
    if barrier is None:
        # A torch without it: the run still ends, only without the early grace.
        log.warning("torchrun's agent has no _exit_barrier: a rank that hangs at exit costs training.timeout_s")
        return

    def announcing(self: Any) -> Any:
        emit(NodeEvent.RANKS_EXITED)
        return barrier(self)

    SimpleElasticAgent._exit_barrier = announcing  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m infra.node.launch torch.distributed.run ARGS...")
    _announce_exit_barrier()
    sys.argv = list(argv)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
