"""`chaos`: take this node away on purpose, the way a cloud reclaims a spot instance (local and ssh providers).

Started by the orchestrator beside the trainer when the job's `chaos:` section preempts this node in this
attempt. It waits for the trigger file (the orchestrator writes it at the configured step or time), then, with
a notice, raises the node's notice flag (what infra.node watch polls, as it would poll a cloud's metadata) and
waits out the notice; finally it kills every process of the node without warning and deletes the node's
directory: the machine is gone, with whatever the node had not shipped.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from infra.node.events import NodeEvent, emit, fail
from infra.node.preemption_notice import NOTICE_FILE, Notice, write_notice
from infra.node.processes import NODE_TAG, hard_kill, tagged_processes
from infra.node.protocol import ChaosRequest, NodeRequest, as_request


def main(request: NodeRequest) -> int:
    chaos = as_request(request, ChaosRequest)
    trigger, workdir = Path(chaos.trigger), Path(chaos.workdir)
    node_tag = os.environ.get(NODE_TAG)
    if not node_tag:
        return fail(f"chaos: {NODE_TAG} is not set: start it through the node's runner, which tags it")

    emit(NodeEvent.CHAOS_ARMED, trigger=str(trigger), notice_s=chaos.notice_s)
    while not trigger.exists():
        time.sleep(chaos.poll_s)
    if chaos.notice_s > 0:
        notice = Notice("chaos: spot notice", time.time() + chaos.notice_s, "chaos")
        write_notice(workdir / NOTICE_FILE, notice)
        emit(NodeEvent.NOTICE_RAISED, deadline=notice.deadline)
        time.sleep(chaos.notice_s)
    processes = tagged_processes(NODE_TAG, node_tag)
    emit(NodeEvent.NODE_RECLAIMED, killed=len(processes), notice_s=chaos.notice_s)
    hard_kill(processes)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0
