"""`torchrun`: torch.distributed.run of the training environment's Python (a TorchrunRequest's options and script),
plus one event line when every rank of this node has exited 0.

torchrun's agent then waits in an exit barrier (300 s) for the other nodes' agents, so its own exit says nothing
until every node is done: a node whose rank hangs at exit (a stuck process-group teardown, a dataloader worker)
would keep every node busy. The event lets the orchestrator give the others a bounded grace instead
(training.exit_grace_s).

This process imports no torch: it runs the launcher (infra/workload/launcher.py) in the training environment
(infra/node/trainenv.py), which runs torchrun there; signals the runner sends this process are handed to it, and its
stdin is this process's lifeline (infra/node/exec.py). The command's name stays on this process's command line: that
is how a node's watcher finds the trainer (infra.node.protocol.runs_command).
"""

from __future__ import annotations

import json
from pathlib import Path

from infra import workload
from infra.node.events import NodeEvent, event_line
from infra.node.exec import run_program
from infra.node.protocol import AllreduceBenchRequest, NodeRequest, TorchrunRequest, as_request
from infra.node.trainenv import install_script
from infra.workload.launcher import LINE_ENV

# A script of the training environment (it imports torch): read as a file, never imported here.
BENCH_SOURCE = Path(workload.__file__).with_name("allreduce_bench.py")
BENCH_ENV = "TRAINPIPE_ALLREDUCE_BENCH"  # the bench's parameters, plain JSON (infra/workload/allreduce_bench.py)


def bench_parameters(worker: AllreduceBenchRequest) -> str:
    """What the bench script reads: it runs where neither pydantic nor trainpipe can be imported."""
    return json.dumps({**worker.model_dump(mode="json"), "event": NodeEvent.ALLREDUCE.value})


def main(request: NodeRequest) -> int:
    torchrun = as_request(request, TorchrunRequest)
    argv = torchrun.torchrun_argv()
    extra = {LINE_ENV: event_line(NodeEvent.RANKS_EXITED)}
    names = torchrun.env_names
    if torchrun.worker is not None:
        argv += ["--", install_script(torchrun.training_env, "allreduce_bench", BENCH_SOURCE.read_bytes())]
        extra[BENCH_ENV] = bench_parameters(torchrun.worker)
        names = (*names, BENCH_ENV)
    return run_program(torchrun.training_env, "torchrun", argv, command="torchrun", cwd=str(Path.cwd()),
                       env_names=names, extra=extra, stop_grace_s=torchrun.stop_grace_s)
