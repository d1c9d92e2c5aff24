"""Cancelling a run: one token (infra.cancel) ends every wait, and `trainpipe run` turns Ctrl-C and SIGTERM into it.

- The token: host waits in parallel (an SSH port that never answers), remote commands and their threads end at the
  next poll; teardown, shielded, is not cancelled.
- On a cloud (EC2 as moto_server; nothing answers at the instances' addresses): SIGTERM while the nodes boot ends
  `trainpipe run` within 30 s with no instance left.
- On local nodes after the first commit: Ctrl-C (SIGINT to the whole process group, as a terminal sends it; the
  temporary Prefect server must survive it) and SIGTERM then a second Ctrl-C (skip the flush) end the run as
  `cancelled` within checkpoints.flush_deadline_s + 15 s, naming the latest commit and the --run-id that resumes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from aws_server import Ec2Server, moto_ec2
from cloud_env import aws_env, aws_left, register_image, wait_for
from conftest import without_prefect_api
from jobs import job_config, make_dataset, write_config
from runs import Run

from infra.cancel import CANCEL, Cancelled
from infra.checkpoints.steps import step_name
from infra.checkpoints.store import CheckpointStore
from infra.compute.access.remote import LocalRunner
from infra.compute.access.ssh.connection import wait_for_ssh
from infra.compute.providers.hosts import in_parallel
from infra.compute.providers.local import CLUSTER_TAG
from infra.job.plan import cluster_name_for
from infra.node.processes import tagged_processes
from infra.storage import open_store

FLUSH_DEADLINE_S = 10.0
EXIT_BOUND_S = FLUSH_DEADLINE_S + 15.0  # what the README promises for Ctrl-C and SIGTERM
BOOT_CANCEL_BOUND_S = 30.0


@pytest.fixture(autouse=True)
def uncancelled() -> Iterator[None]:
    CANCEL.reset()
    yield
    CANCEL.reset()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the token --------------------------------------------------------------------------------------------------------


def test_a_cancel_ends_every_hosts_ssh_wait_and_their_threads() -> None:
    port = free_port()  # nothing listens: every attempt is refused, and retried for up to 900 s
    outcome: list[BaseException | None] = []

    def boot_waits() -> None:
        try:
            in_parallel(["127.0.0.1", "127.0.0.2"], lambda host: wait_for_ssh(host, port, timeout=900))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    waiting = threading.Thread(target=boot_waits)
    waiting.start()
    # Both hosts' waits have begun (their first attempt is refused at once; a cancel before it is the easy case).
    wait_for(lambda: len([t for t in threading.enumerate() if t.name.startswith("ssh-host")]) == 2, 10,
             "both hosts' waits starting")
    cancelled_at = time.monotonic()
    CANCEL.cancel("test")
    waiting.join(10)
    assert not waiting.is_alive(), "in_parallel still waited 10 s after the cancel"
    assert isinstance(outcome[0], Cancelled), outcome
    wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("ssh-host")], 10,
             "the host threads ending")
    assert time.monotonic() - cancelled_at < 10


def test_a_cancel_stops_a_remote_command_but_not_a_teardown(tmp_path: Path) -> None:
    runner = LocalRunner("node-0", tmp_path, {})
    threading.Timer(0.5, CANCEL.cancel, args=("test",)).start()
    started = time.monotonic()
    with pytest.raises(Cancelled):
        runner.run(["sleep", "60"], timeout=1800)  # a pip install's timeout
    assert time.monotonic() - started < 10
    # Teardown runs shielded: its commands and waits keep their own deadlines after the cancel.
    with CANCEL.shield():
        CANCEL.check()
        CANCEL.wait(0.05)
        assert runner.run(["true"], timeout=30).returncode == 0
        assert in_parallel([1, 2], lambda n: n * 2) == [(1, 2, None), (2, 4, None)]


def test_a_cancel_ends_the_setup_wait_and_its_command(workspace: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The setup (a pip install, say) is waited for up to training.timeout_s: a cancel ends that wait at once and the
    setup with it, as it ends every other node command."""
    import tasks.workload
    from infra.compute.providers.local import LocalProvider
    from infra.job.spec import parse_job
    from tasks.train import TrainLaunch

    monkeypatch.setattr(tasks.workload, "get_run_logger", lambda: logging.getLogger("test.cancel"))
    config = job_config(tmp_path, "file:///unused", timeout_s=1800)
    config["cluster"]["nodes"] = 1
    config["training"]["setup"] = [f"touch {tmp_path / 'setup-began'}", "sleep 600"]
    job = parse_job(config)
    provider = LocalProvider()
    cluster = provider.launch("tp-cancel-setup", job.cluster, "cancel-setup")
    try:
        node = cluster.nodes[0]
        launch = TrainLaunch("file:///unused/ckpt", "file:///unused", 0, "hash")
        threading.Thread(target=_cancel_once_there, args=(tmp_path / "setup-began",), daemon=True).start()
        started = time.monotonic()
        with pytest.raises(Cancelled):
            tasks.workload.prepare_node.fn(job, cluster, node, None, None, launch)
        assert time.monotonic() - started < 60, "the setup was waited for past the cancel"
        assert not tagged_processes(CLUSTER_TAG, str(Path(node.workdir).parent)), "the setup outlived the cancel"
    finally:
        provider.terminate(cluster.name)


def _cancel_once_there(path: Path) -> None:
    wait_for(path.exists, 60, "the setup to begin")
    CANCEL.cancel("test")


# -- trainpipe run ----------------------------------------------------------------------------------------------------


def summary_of(workspace: Path, run_id: str) -> dict:
    return json.loads((workspace / "runs" / run_id / "summary.json").read_text())


@pytest.fixture(scope="module")
def dataset_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(tmp_path_factory.mktemp("cancel-dataset"), tokens=200_000)


@pytest.fixture(scope="module")
def ec2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ec2Server]:
    # Nothing listens at the instances' addresses: the nodes never answer over SSH.
    with moto_ec2(tmp_path_factory.mktemp("moto"), public_ip_prefix="127.78.5.") as server:
        yield server


def test_sigterm_while_the_nodes_boot_ends_the_run_within_30s_with_no_instance_left(
        prefect_server: None, workspace: Path, tmp_path: Path, dataset_url: str, ec2: Ec2Server) -> None:
    from prefect.settings import PREFECT_API_URL

    region = "us-east-1"
    key = tmp_path / "id_ed25519"
    key.write_text("read at launch; no node ever answers here\n")
    env = {**os.environ, **aws_env(ec2, register_image(ec2, region), region), "TRAINPIPE_HOME": str(workspace),
           "TRAINPIPE_SSH_KEY_FILE": str(key), "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    config = job_config(tmp_path, dataset_url)
    config["cluster"] = {"provider": "aws", "nodes": 2, "procs_per_node": 1, "regions": [region],
                         "verify": {"bench": "off"}}
    run_id = "cancel-boot"
    cluster = cluster_name_for(run_id)
    run = Run(write_config(tmp_path / "job.yaml", config), run_id, env, tmp_path)
    try:
        wait_for(lambda: run.running() and bool(aws_left(ec2, cluster, region).get("instances")), 240,
                 "instances launching", interval=0.2)
        # The boot wait: both nodes' SSH refused, retried (for up to 900 s before the fix's token).
        wait_for(lambda: run.running() and run.output().count("retrying in") >= 2, 120, "the SSH boot wait",
                 interval=0.2)
        run.popen.send_signal(signal.SIGTERM)
        took = run.exit_seconds(BOOT_CANCEL_BOUND_S)
    finally:
        run.stop()
    print(f"SIGTERM during the boot wait → exit in {took:.1f}s")
    assert took < BOOT_CANCEL_BOUND_S, run.output()[-4000:]
    assert aws_left(ec2, cluster, region).get("instances", []) == [], "instances outlived the cancelled run"
    summary = summary_of(workspace, run_id)
    assert summary["status"] == "cancelled" and summary["nodes_left"] == 0, summary
    assert f"--run-id {run_id}" in run.stderr.read_text()


def local_run(tmp_path: Path, dataset_url: str, workspace: Path, run_id: str, env: dict[str, str]
              ) -> tuple[Run, CheckpointStore]:
    # Slow steps: training runs on long after the first commit, so the signal always lands in training.
    config = job_config(tmp_path, dataset_url, steps=100_000, ckpt_every=20, step_delay_s=0.05)
    config["checkpoints"]["flush_deadline_s"] = FLUSH_DEADLINE_S
    checkpoints = CheckpointStore(open_store(f"{config['checkpoints']['url']}/{run_id}"))
    run = Run(write_config(tmp_path / "job.yaml", config), run_id, {**env, "TRAINPIPE_HOME": str(workspace)},
              tmp_path)
    wait_for(lambda: run.running() and checkpoints.latest() is not None, 300, "the first commit", interval=0.2)
    return run, checkpoints


def assert_cancelled_with_resume(run: Run, workspace: Path, run_id: str, checkpoints: CheckpointStore) -> None:
    summary = summary_of(workspace, run_id)
    latest = checkpoints.latest()
    assert latest is not None
    assert summary["status"] == "cancelled", summary
    assert summary["checkpoint_step"] == latest.step and summary["checkpoint"].endswith(step_name(latest.step))
    assert summary["nodes_left"] == 0
    stderr = run.stderr.read_text()
    assert summary["checkpoint"] in stderr and f"--run-id {run_id}" in stderr, stderr[-3000:]
    assert f"--run-id {run_id}" in run.stdout.read_text()  # the summary's resume line
    base = workspace / "clusters" / cluster_name_for(run_id)
    assert not tagged_processes(CLUSTER_TAG, str(base)), "node processes outlived the run"


def prefect_servers_of(workspace: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline", "environ"]):
        with contextlib.suppress(psutil.Error):
            if (" server start " in " ".join(process.info["cmdline"] or [])
                    and (process.info["environ"] or {}).get("TRAINPIPE_HOME") == str(workspace)):
                found.append(process)
    return found


def test_ctrl_c_cancels_the_run_flushes_and_tears_down_within_the_bound(
        workspace: Path, tmp_path: Path, dataset_url: str) -> None:
    run_id = "cancel-ctrl-c"
    # No PREFECT_API_URL: the command starts its temporary server, which the terminal's SIGINT must not reach.
    env = without_prefect_api(dict(os.environ))
    run, checkpoints = local_run(tmp_path, dataset_url, workspace, run_id, env)
    try:
        os.killpg(run.popen.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        took = run.exit_seconds(EXIT_BOUND_S)
    finally:
        run.stop()
    print(f"Ctrl-C after the first commit → exit in {took:.1f}s")
    assert run.popen.returncode == 128 + signal.SIGINT, run.output()[-4000:]
    assert took < EXIT_BOUND_S, run.output()[-4000:]
    assert "Error logging to API" not in run.output(), "the temporary Prefect server died before the run's reports"
    assert_cancelled_with_resume(run, workspace, run_id, checkpoints)
    assert prefect_servers_of(workspace) == [], "the temporary Prefect server outlived the command"


def test_sigterm_then_a_second_ctrl_c_skips_the_flush_and_still_tears_down(
        prefect_server: None, workspace: Path, tmp_path: Path, dataset_url: str) -> None:
    from prefect.settings import PREFECT_API_URL

    run_id = "cancel-twice"
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    run, checkpoints = local_run(tmp_path, dataset_url, workspace, run_id, env)
    try:
        run.popen.send_signal(signal.SIGTERM)
        wait_for(lambda: "cancelling the run" in run.output(), 30, "the cancel taking effect", interval=0.05)
        run.popen.send_signal(signal.SIGINT)
        took = run.exit_seconds(EXIT_BOUND_S)
    finally:
        run.stop()
    assert took < EXIT_BOUND_S, run.output()[-4000:]
    assert "skipping the checkpoint flush" in run.output(), run.output()[-4000:]
    assert run.popen.returncode == 128 + signal.SIGTERM, run.output()[-4000:]
    assert_cancelled_with_resume(run, workspace, run_id, checkpoints)
