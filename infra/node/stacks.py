"""`stacks`: a hung node's training ranks print their Python stacks, then end.

Each rank runs with PYTHONFAULTHANDLER=1 (the workload environment sets it): faulthandler answers SIGABRT with every
thread's stack on the rank's stderr, from its signal handler, so a rank blocked in a collective or a C call prints
too. A rank stopped by SIGSTOP (a debugger, a chaos drill) is continued so that it can. The abort must not write a
core of a GPU process's memory, so the rank's core limit is set to 0 first. The ranks are torchrun's workers of this
node: its tagged processes that have torchrun's LOCAL_RANK, in a container or not (the host sees a container's
processes with their environment).
"""

from __future__ import annotations

import os
import signal
import time

import psutil

from infra.node.events import NodeEvent, emit, fail
from infra.node.processes import NODE_TAG, tagged_processes
from infra.node.protocol import NodeRequest, StacksRequest, as_request

POLL_S = 0.1
WORKER_VARIABLE = "LOCAL_RANK"  # torchrun sets it in each worker it starts, and in nothing else


def ranks_of(node_tag: str) -> list[tuple[psutil.Process, str]]:
    """This node's torchrun workers, with their global RANK."""
    found = []
    for process in tagged_processes(NODE_TAG, node_tag):
        try:
            environ = process.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if WORKER_VARIABLE in environ:
            found.append((process, environ.get("RANK", "?")))
    return found


def abort_with_stacks(process: psutil.Process) -> bool:
    """SIGABRT without a core dump; False when the process is gone already."""
    try:
        _, hard = process.rlimit(psutil.RLIMIT_CORE)
        process.rlimit(psutil.RLIMIT_CORE, (0, hard))
        process.send_signal(signal.SIGABRT)
        process.send_signal(signal.SIGCONT)  # a stopped rank handles the abort only once it runs
    except psutil.NoSuchProcess:
        return False
    return True


def main(request: NodeRequest) -> int:
    stacks = as_request(request, StacksRequest)
    node_tag = os.environ.get(NODE_TAG)
    if not node_tag:
        return fail(f"stacks: {NODE_TAG} is not set: start it through the node's runner, which tags it")
    ranks = [(process, rank) for process, rank in ranks_of(node_tag) if abort_with_stacks(process)]
    alive = [process for process, _ in ranks]
    deadline = time.monotonic() + stacks.grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(POLL_S)
        alive = [process for process in alive if running(process)]
    emit(NodeEvent.STACKS_DUMPED, ranks=sorted(rank for _, rank in ranks), exited=len(ranks) - len(alive))
    return 0


def running(process: psutil.Process) -> bool:
    """Not ended: a rank that ended is a zombie until torchrun (its parent, not this command) reaps it."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
