"""`watch`: the node's lease watchdog and preemption watcher.

A node that stops hearing from its orchestrator tears itself down; a node told it is about to be taken away
(a spot notice: infra.node.preemption_notice) stops its trainer with SIGTERM — the trainer saves at its next step
boundary within checkpoints.flush_deadline_s — then asks the syncer to flush, so the last save is committed before
the node goes.

The orchestrator renews a lease file on every node (infra.lifecycle.lease.LeaseKeeper). If the orchestrator dies —
SIGKILL, a lost machine, a network partition — renewals stop, and once the lease is older than its TTL the
watchdog ends every process of its node (`--on-expire kill-node`, the local and ssh providers) or powers the
machine off (`--on-expire shutdown`, cloud nodes launched to terminate on shutdown). This bounds how long a
cluster can outlive its run even when nothing else cleans up.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from infra.node.events import NodeEvent, emit, fail
from infra.node.preemption_notice import (
    AWS_IMDS,
    GCP_METADATA,
    NOTICE_FILE,
    MetadataError,
    Notice,
    aws_notice,
    gcp_notice,
    read_notice,
    write_notice,
)
from infra.node.processes import NODE_TAG, kill_processes, tagged_processes

TRAINER_MARK = "torch.distributed.run"


def lease_age_s(lease: Path, now: float) -> float | None:
    """Seconds since the last renewal, or None before the first one."""
    try:
        return now - float(lease.read_text().strip())
    except FileNotFoundError:
        return None
    except ValueError:
        # A renewal caught mid-write reads as garbage; the next poll sees the whole value.
        return 0.0


class NoticeWatch:
    """Polls one notice source; acts on the first notice: SIGTERM to the trainer, then the syncer's flush."""

    def __init__(self, source: str, url: str | None, workdir: Path, stop_sync: Path | None, node_tag: str | None):
        self.workdir, self.stop_sync, self.node_tag = workdir, stop_sync, node_tag
        self.notice: Notice | None = None
        self._rebalance_seen = False
        self._failures = 0
        self._check: Callable[[], Notice | None] = {
            "aws": lambda: self._aws(url or AWS_IMDS),
            "gcp": lambda: gcp_notice(url or GCP_METADATA),
            "file": lambda: read_notice(workdir / NOTICE_FILE),
        }[source]

    def _aws(self, url: str) -> Notice | None:
        notice, rebalance = aws_notice(url)
        if rebalance and not self._rebalance_seen:
            # Softer than a notice: the node may run for a long time yet; the orchestrator's log says so.
            self._rebalance_seen = True
            emit(NodeEvent.REBALANCE_RECOMMENDATION, source="aws")
        return notice

    def poll(self) -> None:
        if self.notice is not None:
            return
        try:
            notice = self._check()
        except (OSError, MetadataError, ValueError, KeyError) as exc:
            self._failures += 1
            emit(NodeEvent.NOTICE_CHECK_FAILED, error=str(exc), failures=self._failures)
            return
        if notice is not None:
            self.notice = notice
            self._act(notice)

    def _act(self, notice: Notice) -> None:
        emit(NodeEvent.PREEMPTION_NOTICE, reason=notice.reason, deadline=notice.deadline, source=notice.source)
        path = self.workdir / NOTICE_FILE
        if read_notice(path) is None:
            write_notice(path, notice)  # what the orchestrator of a local or ssh node reads
        trainers = [p for p in self._node_processes() if TRAINER_MARK in " ".join(_cmdline(p))]
        for trainer in trainers:
            trainer.send_signal(signal.SIGTERM)
        _gone, alive = psutil.wait_procs(trainers, timeout=max(0.0, notice.deadline - time.time()))
        emit(NodeEvent.TRAINER_STOPPED, trainers=len(trainers), still_running=len(alive))
        if self.stop_sync is not None:
            self.stop_sync.write_text("stop\n")  # after the trainer's last save: the syncer ships it, then exits

    def _node_processes(self) -> list[psutil.Process]:
        return tagged_processes(NODE_TAG, self.node_tag) if self.node_tag else []


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def power_off() -> None:
    """Power the machine off. Cloud nodes run this as their SSH user, which the images (Ubuntu on EC2 and GCE) give
    passwordless sudo, not as root."""
    argv = ["shutdown", "-h", "now"]
    subprocess.run(argv if os.geteuid() == 0 else ["sudo", "-n", *argv], check=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.node watch")
    parser.add_argument("--lease", required=True, type=Path, help="file holding the last renewal's unix time")
    parser.add_argument("--ttl", required=True, type=float, help="seconds without renewal before teardown")
    parser.add_argument("--on-expire", choices=("kill-node", "shutdown"), default="kill-node")
    parser.add_argument("--poll", type=float, default=1.0)
    parser.add_argument("--notice-source", choices=("none", "aws", "gcp", "file"), default="none",
                        help="where preemption notices come from: the cloud's metadata service or a notice file")
    parser.add_argument("--notice-url", help="metadata service base URL (default: the cloud's own)")
    parser.add_argument("--notice-poll", type=float, default=2.0, help="seconds between notice checks")
    parser.add_argument("--workdir", type=Path, help="the node's workdir (notice file); default: the lease's dir")
    parser.add_argument("--stop-sync-file", type=Path, help="written after the trainer stopped on a notice")
    args = parser.parse_args(argv)
    node_tag = os.environ.get(NODE_TAG)
    if (args.on_expire == "kill-node" or args.notice_source != "none") and not node_tag:
        return fail(f"watch: {NODE_TAG} is not set: start the watchdog through the node's runner, which tags it")
    notices = (NoticeWatch(args.notice_source, args.notice_url, args.workdir or args.lease.parent,
                           args.stop_sync_file, node_tag) if args.notice_source != "none" else None)
    next_notice_check = 0.0

    started = time.time()
    emit(NodeEvent.WATCHING, lease=str(args.lease), ttl_s=args.ttl)
    while True:
        now = time.time()
        # Before the first renewal the lease counts from the watchdog's own start.
        age = lease_age_s(args.lease, now)
        age = now - started if age is None else age
        if age > args.ttl:
            break
        if notices is not None and now >= next_notice_check:
            notices.poll()
            next_notice_check = now + args.notice_poll
        time.sleep(args.poll)

    emit(NodeEvent.LEASE_EXPIRED, age_s=round(age, 1), ttl_s=args.ttl, action=args.on_expire)
    failed = False
    if args.on_expire == "shutdown":
        try:
            power_off()
            return 0
        except (OSError, subprocess.CalledProcessError) as exc:
            # Still end what runs here: the machine bills on, but the sweeper (its heartbeat is gone) ends it.
            emit(NodeEvent.POWER_OFF_FAILED, error=str(exc))
            failed = True
            if not node_tag:
                return 1
    processes = tagged_processes(NODE_TAG, node_tag)
    kill_processes(processes)
    emit(NodeEvent.NODE_DOWN, killed=len(processes))
    return 1 if failed else 0
