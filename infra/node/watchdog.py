"""`watch`: the node's lease watchdog and preemption watcher.

A node that stops hearing from its orchestrator tears itself down; a node told it is about to be taken away
(a spot notice: infra.node.preemption_notice) stops its trainer with SIGTERM — the trainer saves at its next step
boundary within checkpoints.flush_deadline_s — then asks the syncer to flush, so the last save is committed before
the node goes.

The orchestrator renews a lease file on every node (infra.lifecycle.lease.LeaseKeeper). If the orchestrator dies —
SIGKILL, a lost machine, a network partition — renewals stop, and once the lease is older than its TTL the
watchdog ends every process of its node (on_expire kill-node, the local and ssh providers) or powers the
machine off (on_expire shutdown, cloud nodes launched to terminate on shutdown). This bounds how long a
cluster can outlive its run even when nothing else cleans up. Where the node is a scheduler's allocation that judges
the lease itself (on_expire allocation: a Slurm holder, which knows when its controller was too silent for the
renewals to get through), this watchdog leaves the lease to it.
"""

from __future__ import annotations

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
    AZURE_IMDS,
    GCP_METADATA,
    NOTICE_FILE,
    MetadataError,
    Notice,
    aws_notice,
    azure_notice,
    gcp_notice,
    read_notice,
    write_notice,
)
from infra.node.processes import NODE_TAG, kill_processes, tagged_processes
from infra.node.protocol import NodeCommand, NodeRequest, WatchRequest, as_request, runs_command
from infra.node.trainenv import remove_node_containers

# The lease file in a node's workdir: the orchestrator renews it (infra.lifecycle.lease), this watchdog reads its age,
# and a Slurm allocation's holder ends the job when it goes stale.
LEASE_FILE = "lease"


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
            # An Azure node's name (its NODE_TAG) is its VM's name, which the events name.
            "azure": lambda: azure_notice(node_tag or "", url or AZURE_IMDS),
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
        trainers = [p for p in self._node_processes() if runs_command(_cmdline(p), NodeCommand.TORCHRUN)]
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


def main(request: NodeRequest) -> int:
    watch = as_request(request, WatchRequest)
    lease = Path(watch.lease)
    node_tag = os.environ.get(NODE_TAG)
    if (watch.on_expire == "kill-node" or watch.notice_source != "none") and not node_tag:
        return fail(f"watch: {NODE_TAG} is not set: start the watchdog through the node's runner, which tags it")
    workdir = Path(watch.workdir) if watch.workdir is not None else lease.parent
    stop_sync = Path(watch.stop_sync_file) if watch.stop_sync_file is not None else None
    notices = (NoticeWatch(watch.notice_source, watch.notice_url, workdir, stop_sync, node_tag)
               if watch.notice_source != "none" else None)
    next_notice_check = 0.0

    started = time.time()
    emit(NodeEvent.WATCHING, lease=str(lease), ttl_s=watch.ttl_s)
    while True:
        now = time.time()
        # Before the first renewal the lease counts from the watchdog's own start.
        age = lease_age_s(lease, now)
        age = now - started if age is None else age
        if age > watch.ttl_s and watch.on_expire != "allocation":
            break
        if notices is not None and now >= next_notice_check:
            notices.poll()
            next_notice_check = now + watch.notice_poll_s
        time.sleep(watch.poll_s)

    emit(NodeEvent.LEASE_EXPIRED, age_s=round(age, 1), ttl_s=watch.ttl_s, action=watch.on_expire)
    failed = False
    if watch.on_expire == "shutdown":
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
    # A training container outlives its killed engine client until its launcher sees the lifeline go: not waited for.
    containers = remove_node_containers(workdir)
    emit(NodeEvent.NODE_DOWN, killed=len(processes), containers=containers)
    return 1 if failed else 0
