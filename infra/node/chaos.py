"""`chaos`: take this node away on purpose, the way a cloud reclaims a spot instance (local and ssh providers).

Started by the orchestrator beside the trainer when the job's `chaos:` section preempts this node in this
attempt. It waits for the trigger file (the orchestrator writes it at the configured step or time), then, with
a notice, raises the node's notice flag (what infra.node watch polls, as it would poll a cloud's metadata) and
waits out the notice; finally it kills every process of the node without warning and deletes the node's
directory: the machine is gone, with whatever the node had not shipped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from infra.node.events import NodeEvent, emit, fail
from infra.node.preemption_notice import NOTICE_FILE, Notice, write_notice
from infra.node.processes import NODE_TAG, hard_kill, tagged_processes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.node chaos")
    parser.add_argument("--trigger", required=True, type=Path, help="file whose appearance starts the preemption")
    parser.add_argument("--workdir", required=True, type=Path, help="the node's directory, deleted at the end")
    parser.add_argument("--notice-s", type=float, default=0.0, help="notice before the node goes (0: none)")
    parser.add_argument("--poll", type=float, default=0.2)
    args = parser.parse_args(argv)
    node_tag = os.environ.get(NODE_TAG)
    if not node_tag:
        return fail(f"chaos: {NODE_TAG} is not set: start it through the node's runner, which tags it")

    emit(NodeEvent.CHAOS_ARMED, trigger=str(args.trigger), notice_s=args.notice_s)
    while not args.trigger.exists():
        time.sleep(args.poll)
    if args.notice_s > 0:
        notice = Notice("chaos: spot notice", time.time() + args.notice_s, "chaos")
        write_notice(args.workdir / NOTICE_FILE, notice)
        emit(NodeEvent.NOTICE_RAISED, deadline=notice.deadline)
        time.sleep(args.notice_s)
    processes = tagged_processes(NODE_TAG, node_tag)
    emit(NodeEvent.NODE_RECLAIMED, killed=len(processes), notice_s=args.notice_s)
    hard_kill(processes)
    shutil.rmtree(args.workdir, ignore_errors=True)
    return 0
