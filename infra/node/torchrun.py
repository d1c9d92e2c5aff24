"""`torchrun`: torch.distributed.run as it is (a TorchrunRequest's options and script), plus one event line when every
rank of this node has exited 0.

torchrun's agent then waits in an exit barrier (300 s) for the other nodes' agents, so its own exit says nothing
until every node is done: a node whose rank hangs at exit (a stuck process-group teardown, a dataloader worker)
would keep every node busy. The event lets the orchestrator give the others a bounded grace instead
(training.exit_grace_s). torchrun runs in this process (runpy), so a signal the runner sends it is torchrun's own to
handle, as for a plain torchrun; the command's name stays on the command line: that is how a node's watcher finds it
(infra.node.protocol.runs_command).
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from typing import Any

from infra.node.events import NodeEvent, emit
from infra.node.protocol import REQUEST_ENV, NodeRequest, TorchrunRequest, as_request

log = logging.getLogger(__name__)

TORCHRUN_MODULE = "torch.distributed.run"


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


def _plain_logging() -> None:
    """torchrun's output as when it runs by itself: the node agent's log handler (INFO, for its own commands) goes."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)


def main(request: NodeRequest) -> int:
    torchrun = as_request(request, TorchrunRequest)
    if torchrun.worker is not None:
        # Every rank runs the worker's node command, which reads its request where this one's was.
        os.environ[REQUEST_ENV] = torchrun.worker.model_dump_json()
    _plain_logging()
    _announce_exit_barrier()
    sys.argv = [TORCHRUN_MODULE, *torchrun.torchrun_argv()]
    try:
        runpy.run_module(TORCHRUN_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as exited:
        return _exit_status(exited.code)
    return 0


def _exit_status(code: object) -> int:
    """A SystemExit's code as the process's exit status (torchrun exits with a message on some errors)."""
    if code is None or isinstance(code, int):
        return int(code or 0)
    print(code, file=sys.stderr)
    return 1
