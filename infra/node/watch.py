"""`watch`: the node's lease watchdog. A node that stops hearing from its orchestrator tears itself down.

The orchestrator renews a lease file on every node (infra.lease.LeaseKeeper). If the orchestrator dies —
SIGKILL, a lost machine, a network partition — renewals stop, and once the lease is older than its TTL the
watchdog ends every process of its node (`--on-expire kill-node`, the local and ssh providers) or powers the
machine off (`--on-expire shutdown`, cloud nodes launched to terminate on shutdown). This bounds how long a
cluster can outlive its run even when nothing else cleans up.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

from infra.node.events import emit, fail
from infra.processes import kill_processes, tagged_processes
from infra.providers.local import NODE_TAG


def lease_age_s(lease: Path, now: float) -> float | None:
    """Seconds since the last renewal, or None before the first one."""
    try:
        return now - float(lease.read_text().strip())
    except FileNotFoundError:
        return None
    except ValueError:
        # A renewal caught mid-write reads as garbage; the next poll sees the whole value.
        return 0.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.node watch")
    parser.add_argument("--lease", required=True, type=Path, help="file holding the last renewal's unix time")
    parser.add_argument("--ttl", required=True, type=float, help="seconds without renewal before teardown")
    parser.add_argument("--on-expire", choices=("kill-node", "shutdown"), default="kill-node")
    parser.add_argument("--poll", type=float, default=1.0)
    args = parser.parse_args(argv)
    node_tag = os.environ.get(NODE_TAG)
    if args.on_expire == "kill-node" and not node_tag:
        return fail(f"watch: {NODE_TAG} is not set: start the watchdog through the node's runner, which tags it")

    started = time.time()
    emit("watching", lease=str(args.lease), ttl_s=args.ttl)
    while True:
        now = time.time()
        # Before the first renewal the lease counts from the watchdog's own start.
        age = lease_age_s(args.lease, now)
        age = now - started if age is None else age
        if age > args.ttl:
            break
        time.sleep(args.poll)

    emit("lease-expired", age_s=round(age, 1), ttl_s=args.ttl, action=args.on_expire)
    if args.on_expire == "shutdown":
        subprocess.run(["shutdown", "-h", "now"], check=True)
        return 0
    processes = tagged_processes(NODE_TAG, node_tag)
    kill_processes(processes)
    emit("node-down", killed=len(processes))
    return 0
