"""One live run per cluster: a second orchestrator that finds a live owner refuses in one line and touches nothing;
distinct run ids get distinct clusters (issue: a cron overlap or a manual resume while the first run trained killed
it, and `Exp_1` and `exp-1` shared one cluster)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cloud_env import wait_for
from jobs import job_config, make_dataset, write_config
from runs import Run

from infra.checkpoints.store import CheckpointStore
from infra.compute.providers.local import LocalProvider
from infra.compute.spec import ClusterSpec
from infra.job.plan import cluster_name_for
from infra.lifecycle.ownership import OWNER_FILE, ClusterInUse, Owner, claim, refuse_live_owner
from infra.node.watchdog import LEASE_FILE
from infra.storage import open_store


def test_run_ids_that_fold_alike_get_distinct_cluster_names() -> None:
    names = {cluster_name_for(run_id) for run_id in ("Exp_1", "exp-1", "exp.1", "EXP-1")}
    assert len(names) == 4
    assert cluster_name_for("exp-1") == "tp-exp-1"  # an id that needs no folding keeps its plain name
    assert all(name == name.lower() and set(name) <= set("abcdefghijklmnopqrstuvwxyz0123456789-") for name in names)
    assert cluster_name_for("Exp_1") == cluster_name_for("Exp_1")


@pytest.fixture
def local_cluster(workspace: Path):
    provider = LocalProvider()
    name = "tp-owned"
    cluster = provider.launch(name, ClusterSpec(provider="local", nodes=2), "owned")
    yield provider, cluster
    provider.terminate(name)


def _other_process() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])


def _owner_of(process: subprocess.Popen[bytes], **changes: object) -> Owner:
    import psutil

    me = Owner.me("first-run", lease_ttl_s=30)
    fields = {**me.__dict__, "pid": process.pid, "create_time": psutil.Process(process.pid).create_time(), **changes}
    return Owner(**fields)


def _lease(cluster, age_s: float) -> None:
    for node in cluster.nodes:
        Path(node.path(LEASE_FILE)).write_text(f"{time.time() - age_s:.3f}\n")


def test_a_live_owner_is_refused_naming_it_and_a_gone_one_is_not(local_cluster) -> None:
    provider, cluster = local_cluster
    first = _other_process()
    try:
        claim(provider, cluster, cluster.nodes, _owner_of(first))
        _lease(cluster, age_s=1)
        with pytest.raises(ClusterInUse, match=rf"in use by run first-run: its orchestrator \(pid {first.pid} on "):
            refuse_live_owner(provider, cluster.name)
        assert Path(cluster.head.path(OWNER_FILE)).is_file(), "the refusal touched the cluster"
    finally:
        first.kill()
        first.wait()
    refuse_live_owner(provider, cluster.name)  # its process is gone: the cluster is the next run's to take


def test_an_owner_on_another_host_is_alive_while_its_lease_is_fresh(local_cluster) -> None:
    provider, cluster = local_cluster
    elsewhere = Owner(run_id="far", user="u", host="another-host", pid=1, create_time=0.0, since=time.time(),
                      lease_ttl_s=30)
    claim(provider, cluster, cluster.nodes, elsewhere)
    _lease(cluster, age_s=5)
    with pytest.raises(ClusterInUse, match=r"pid 1 on another-host, user u.*lease renewed 5s ago"):
        refuse_live_owner(provider, cluster.name)
    _lease(cluster, age_s=31)
    refuse_live_owner(provider, cluster.name)  # lapsed


def test_this_process_may_take_its_own_cluster_back(local_cluster) -> None:
    provider, cluster = local_cluster
    claim(provider, cluster, cluster.nodes, Owner.me("owned", lease_ttl_s=30))
    _lease(cluster, age_s=0)
    refuse_live_owner(provider, cluster.name)  # a retried provision of the same run


@pytest.fixture(scope="module")
def dataset_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(tmp_path_factory.mktemp("live-run-dataset"), tokens=200_000)


def test_a_second_run_of_a_live_run_id_is_refused_and_ids_that_fold_alike_train_side_by_side(
        prefect_server: None, workspace: Path, tmp_path: Path, dataset_url: str) -> None:
    import os

    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "TRAINPIPE_HOME": str(workspace)}
    config = write_config(tmp_path / "job.yaml", job_config(tmp_path, dataset_url, steps=160, ckpt_every=40,
                                                            step_delay_s=0.05))
    (tmp_path / "logs-second").mkdir()
    first = Run(config, "Exp_1", env, tmp_path)
    try:
        checkpoints = CheckpointStore(open_store(f"file://{tmp_path}/store/ckpt/Exp_1"))
        wait_for(lambda: first.running() and checkpoints.latest() is not None, 300, "the first run's first commit",
                 interval=0.2)
        second = Run(config, "Exp_1", env, tmp_path / "logs-second")
        took = second.exit_seconds(60)
        assert second.popen.returncode == 2, second.output()[-3000:]
        assert took < 60
        stderr = second.stderr.read_text()
        assert f"is in use by run Exp_1: its orchestrator (pid {first.popen.pid} on " in stderr, stderr[-3000:]
        assert len([line for line in stderr.splitlines() if line.startswith("error:")]) == 1, stderr[-3000:]
        # Folds to the same characters as Exp_1, a run of its own: its own cluster, beside the first, still training.
        assert first.running()
        short = write_config(tmp_path / "short.yaml", job_config(tmp_path, dataset_url, steps=40, ckpt_every=20))
        third = Run(short, "exp-1", env, tmp_path)
        third.exit_seconds(400)
        assert third.popen.returncode == 0, third.output()[-3000:]
        first.exit_seconds(400)
        assert first.popen.returncode == 0, first.output()[-3000:]
    finally:
        first.stop()
    summary = json.loads((workspace / "runs" / "Exp_1" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 160, summary.get("error")
    latest = checkpoints.latest()
    assert latest is not None and latest.step == 160, "the first run's final step is committed"
    other = json.loads((workspace / "runs" / "exp-1" / "summary.json").read_text())
    assert other["status"] == "completed" and other["steps"] == 40, other.get("error")
