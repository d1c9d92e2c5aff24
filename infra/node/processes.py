"""Find processes by the tags they carry in their environment, and end them politely, then firmly."""

from __future__ import annotations

import logging
import os
import signal

import psutil

log = logging.getLogger(__name__)

# What every process a provider starts on a node carries in its environment: the cluster (its directory or workdir,
# so two workspaces that reuse a run id never touch each other's processes) and the node's name. The node agent's
# watchdog and chaos injector find the node's processes by them; teardown and the sweeper find the cluster's.
CLUSTER_TAG = "TRAINPIPE_CLUSTER"
NODE_TAG = "TRAINPIPE_NODE"


def tagged_processes(tag: str, value: str) -> list[psutil.Process]:
    """Every other process on this machine whose environment has tag=value (no pid files to go stale)."""
    me = os.getpid()
    found = []
    for process in psutil.process_iter():
        try:
            if process.pid != me and process.environ().get(tag) == value:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_processes(processes: list[psutil.Process], grace_s: float = 5.0) -> None:
    for process in processes:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        log.warning("pid %s ignored SIGTERM for %.0fs: killing it", process.pid, grace_s)
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=grace_s)


def hard_kill(processes: list[psutil.Process]) -> None:
    """SIGKILL, no warning: what a machine taken away does to everything on it.

    No waiting: SIGKILL cannot be refused, and a killed child of another process stays a zombie until that
    parent reaps it, which waiting here would mistake for a process still running."""
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
