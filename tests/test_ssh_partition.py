"""A network partition during training on SSH nodes: the orchestrator's connection to one node (a worker, or the head
whose metrics file it reads every round) stops answering (its packets are dropped; nothing closes it), and the run
notices within the keepalive bound and recovers as from a lost node, instead of waiting on a connection TCP would take
a quarter of an hour to give up.

Real parts: two OpenSSH sshd "hosts" (tests/sshd.py), the retrain flow with real torchrun training, and the partition
itself: an nftables rule that drops every packet to and from one sshd's port on loopback (scripts/system-packages.txt
has nftables). Only the timeouts are shortened (keepalive every 1 s, connection attempts of 1 s) so the test takes
seconds, not minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cannot_run_here
from jobs import job_config, make_dataset
from said import listening
from sshd import SshServer, ssh_servers
from test_ssh_provider import cluster_processes, host_config

import infra.compute.access.ssh.connection
import infra.compute.providers.ssh.provider as ssh_provider
from infra.checkpoints.store import CheckpointStore
from infra.compute.access.ssh.connection import close_connections
from infra.job.plan import cluster_name_for
from infra.job.spec import parse_job
from infra.storage import open_store

KEEPALIVE_S = 1.0
# Long enough (~20 s idle) that the partition, made at the first commit, is mostly found while training goes on.
STEPS = 600
KEEPALIVE_BOUND_S = KEEPALIVE_S * (infra.compute.access.ssh.connection.KEEPALIVE_MISSES + 1)
# Generous on a loaded machine, and still far below what the bounds tell apart: the default keepalive (15 s × 4 = 60 s)
# or a connection left to TCP's retransmissions (minutes).
SLACK = 3


def require_nft() -> None:
    problem = None
    if shutil.which("nft") is None:
        problem = "nft is missing: install nftables (scripts/install-system-packages)"
    elif os.geteuid() != 0:
        problem = "dropping packets with nftables needs root"
    if problem is not None:
        cannot_run_here(problem)


@contextlib.contextmanager
def packets_dropped(port: int) -> Iterator[None]:
    """Every TCP packet to or from port on this machine dropped: a partition, not a closed connection."""
    table = f"trainpipe_partition_{port}"
    for command in (f"add table inet {table}",
                    f"add chain inet {table} input {{ type filter hook input priority -10 ; }}",
                    f"add rule inet {table} input tcp dport {port} drop",
                    f"add rule inet {table} input tcp sport {port} drop"):
        subprocess.run(["nft", *command.split()], check=True)
    try:
        yield
    finally:
        subprocess.run(["nft", "delete", "table", "inet", table], check=True)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[SshServer]]]:
    with ssh_servers(tmp_path_factory.mktemp("sshd"), 2) as found:
        yield found
    close_connections()


# The head (node 0) too: the orchestrator reads its metrics file every round, and that read failing on the dead
# connection is the preemption watch's to judge, not the run's end.
@pytest.mark.parametrize("dropped_node", [1, 0], ids=["worker", "head"])
def test_a_node_whose_packets_are_dropped_mid_training_is_recovered_not_waited_on(
        prefect_server: None, workspace: Path, tmp_path: Path, servers: tuple[Path, list[SshServer]],
        monkeypatch: pytest.MonkeyPatch, dropped_node: int) -> None:
    from flows.retrain import retrain

    require_nft()
    monkeypatch.setattr(infra.compute.access.ssh.connection, "KEEPALIVE_S", KEEPALIVE_S)
    monkeypatch.setattr(infra.compute.access.ssh.connection, "TCP_TIMEOUT_S", 0.5)
    monkeypatch.setattr(ssh_provider, "TEARDOWN_CONNECT_S", 2.0)
    monkeypatch.setattr(ssh_provider, "LAUNCH_CONNECT_S", 2.0)
    close_connections()  # connections opened before the patch would keep the 15 s keepalive
    key, found = servers
    workdirs = [tmp_path / f"nvme-{index}" for index in range(2)]
    for directory in workdirs:
        directory.mkdir()
    run_id = f"partition-{dropped_node}"
    config = job_config(tmp_path, make_dataset(tmp_path / "dataset", tokens=200_000), steps=STEPS, ckpt_every=50)
    config["cluster"] = {"provider": "ssh", "nodes": 2, "procs_per_node": 1, "ssh": {
        "hosts": [host_config(server, k, workdir) for server, k, workdir in zip(found, [key, key], workdirs,
                                                                                 strict=True)]}}
    config["recovery"] = {"confirm_s": 0, "max_recoveries": 1}
    job = parse_job(config)
    checkpoints = CheckpointStore(open_store(f"{job.checkpoints.url}/{run_id}"))
    record = workspace / "ssh-clusters" / f"{cluster_name_for(run_id)}.json"
    times: dict[str, float] = {}
    failures: list[BaseException] = []

    def partition() -> None:
        try:
            deadline = time.monotonic() + 300
            while checkpoints.latest() is None:
                assert time.monotonic() < deadline, "no commit within 300 s"
                time.sleep(0.2)
            times["committed"] = float(checkpoints.latest().step)
            with packets_dropped(found[dropped_node].port):
                times["dropped"] = time.time()
                # Until the recovery's teardown has met the unreachable host (it stays on record as such).
                while "teardown_unreachable" not in (record.read_text() if record.exists() else ""):
                    assert time.monotonic() < deadline, "the run never tore the partitioned node down"
                    time.sleep(0.05)
                times["restored"] = time.time()
        except BaseException as exc:
            failures.append(exc)

    partitioner = threading.Thread(target=partition, name="partition", daemon=True)
    partitioner.start()
    with listening("infra.compute.access.ssh") as said:
        summary = retrain(job, run_id)
    partitioner.join(timeout=60)
    assert not failures, failures

    lost = [r.created for r in said.records
            if "keepalives" in r.getMessage() and f":{found[dropped_node].port}:" in r.getMessage()]
    assert lost, "the dead connection was never noticed"
    noticed_s = lost[0] - times["dropped"]
    [recovery] = summary["recoveries"]
    detected_s = recovery["detected_at"] - times["dropped"]
    shown = {k: recovery.get(k) for k in ("node", "reason", "step_reached", "resumed_from_step")} | {"steps": STEPS}
    print(f"\npartition: connection closed {noticed_s:.1f}s after the drop (keepalive bound {KEEPALIVE_BOUND_S:g}s), "
          f"node declared lost after {detected_s:.1f}s; recovery: {json.dumps(shown)}")
    assert noticed_s <= KEEPALIVE_BOUND_S * SLACK
    assert summary["status"] == "completed", summary.get("error")
    assert recovery["node"] == f"{cluster_name_for(run_id)}-node-{dropped_node}"
    assert recovery["reason"] == "vanished without notice"
    # Its host does not answer: it cannot be replaced on its own host, and the whole cluster is relaunched.
    assert recovery["path"] == "relaunched-cluster" and recovery["node"] in recovery["fallback"], recovery
    assert recovery["resumed_from_step"] is not None and recovery["resumed_from_step"] >= times["committed"]
    # Then it is confirmed gone (it does not answer a new connection for TEARDOWN_CONNECT_S, asked by the watch every
    # 2 s, after its notice could not be read either): a lost node, not a run hung on a dead connection.
    assert detected_s < (KEEPALIVE_BOUND_S + 2 + 2 + 2) * SLACK, f"the node was declared lost {detected_s:.0f}s late"
    assert summary["steps"] == STEPS and summary["nodes_left"] == 0
    assert not cluster_processes(workdirs), "node processes outlived the run"
    for directory in workdirs:  # the hosts' dataset cache is kept across runs, by design; nothing of the cluster
        assert [p.name for p in directory.iterdir()] in ([], ["dataset-cache"]), "cluster dir or reservation left"
    close_connections()
