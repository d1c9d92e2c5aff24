"""The run's own teardown: retried when it fails transiently, and when it fails for good the summary is still
published, the failure recorded in it, and the run's own error is the one raised.

Real Prefect (tasks, retries, a flow run, artifacts) and a real local cluster; the only fault is the provider's
terminate, which raises the way a cloud's control plane does when it cannot be reached (and, last, a node process
that starts a writer into the node's dir as it is told to stop).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import job_config
from prefect import flow
from said import listening

import infra.compute.providers
import tasks.cluster
from flows.retrain import run_closed
from infra.compute.providers.local import LocalProvider
from infra.compute.spec import ClusterSpec
from infra.job.spec import parse_job
from infra.job.summary import RunSummary
from infra.lifecycle.recovery import Recoveries
from infra.node.processes import CLUSTER_TAG, tagged_processes
from infra.workspace import run_dir
from tasks.report import record_failure


class FailingTeardown(LocalProvider):
    """terminate fails `failures` times with `error`, then tears down for real."""

    def __init__(self, root: Path, error: Exception, failures: int) -> None:
        super().__init__(root)
        self.error, self.failures, self.calls = error, failures, 0

    def terminate(self, cluster_name: str) -> bool:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return super().terminate(cluster_name)


def test_a_transient_teardown_failure_is_retried_with_backoff_and_logged(
        prefect_server: None, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    provider = FailingTeardown(tmp_path / "clusters", ConnectionError("control plane unreachable"), failures=1)
    cluster = provider.launch("tp-flaky-teardown", ClusterSpec(nodes=1), "flaky-teardown")
    monkeypatch.setattr(infra.compute.providers, "get_provider", lambda name: provider)
    @flow(name="teardown")
    def teardown() -> int:
        return tasks.cluster.teardown_cluster("local", cluster.name)

    with listening("prefect.trainpipe.retry") as said:
        assert teardown() == 0
    assert provider.calls == 2 and provider.describe(cluster.name) is None
    assert any("teardown-cluster failed transiently" in m and "control plane unreachable" in m
               for m in said.messages), said.messages


def test_a_failing_teardown_still_publishes_the_summary_and_the_runs_own_error_is_raised(
        prefect_server: None, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.retrain import retrain

    provider = FailingTeardown(tmp_path / "clusters", RuntimeError("EC2 said no"), failures=99)
    monkeypatch.setattr(infra.compute.providers, "get_provider", lambda name: provider)
    (tmp_path / "empty").mkdir()
    job = parse_job(job_config(tmp_path, f"file://{tmp_path}/empty"))

    with pytest.raises(Exception) as raised:  # the plan's own error: an empty dataset
        retrain(job, "teardown-fails")
    assert "EC2 said no" not in str(raised.value)
    summary = json.loads((run_dir("teardown-fails") / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith(type(raised.value).__name__)
    assert summary["teardown_error"] == "RuntimeError: EC2 said no"
    assert provider.calls == 1, "a failure that is not transient is not retried"


def test_a_teardown_failure_after_a_successful_run_fails_it_once_the_summary_is_published(
        prefect_server: None, workspace: Path) -> None:
    def teardown() -> int:
        raise RuntimeError("EC2 said no")

    summary = RunSummary(run_id="teardown-after-success", job="e2e", provider="aws", nodes=2)

    @flow(name="closed-run")
    def closed() -> None:
        recoveries = Recoveries(parse_job(job_config(Path("/tmp"), "file:///d")).recovery)
        with run_closed(summary, teardown, lambda exc: record_failure(summary, exc, None), recoveries,
                        run_dir(summary.run_id)):
            summary.status = "completed"

    with pytest.raises(RuntimeError, match="EC2 said no"):
        closed()
    published: dict[str, Any] = json.loads((run_dir(summary.run_id) / "summary.json").read_text())
    assert published["status"] == "failed" and published["error"] == "RuntimeError: EC2 said no"
    assert published["teardown_error"] == "RuntimeError: EC2 said no"


def test_the_crash_hooks_teardown_runs_outside_any_run_context(workspace: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The flow's crash and cancellation hooks call teardown_cluster.fn with no task or flow run around it: it tears
    down and answers instead of raising MissingContextError at its last line (which hid whether it had worked)."""
    provider = LocalProvider(tmp_path / "clusters")
    cluster = provider.launch("tp-crash-hook", ClusterSpec(nodes=1), "crash-hook")
    monkeypatch.setattr(infra.compute.providers, "get_provider", lambda name: provider)
    assert tasks.cluster.teardown_cluster.fn("local", cluster.name) == 0
    assert provider.describe(cluster.name) is None


# A node process that, told to stop, starts a child which keeps writing into the node's dir: the child was not in
# the listing teardown killed, and its files appeared while the dir was removed (seen in CI: "Directory not empty").
SPAWNS_A_WRITER_ON_TERM = """
import os, signal, subprocess, sys, time
from pathlib import Path
out = Path(sys.argv[1])
WRITER = ("import sys, time\\nfrom pathlib import Path\\nout = Path(sys.argv[1]); out.mkdir(parents=True, "
          "exist_ok=True)\\ni = 0\\nwhile True:\\n    (out / str(i)).touch(); i += 1\\n")
def on_term(*_):
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(out)])
    deadline = time.monotonic() + 60
    while not (out / "0").exists() and writer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # in the child: it exits only once the writer writes (the behaviour under test)
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
signal.pause()
"""


def test_teardown_ends_a_process_started_after_its_listing_and_removes_the_cluster(tmp_path: Path) -> None:
    provider = LocalProvider(tmp_path / "clusters")
    cluster = provider.launch("tp-writer", ClusterSpec(nodes=1), "writer")
    node_dir = Path(cluster.nodes[0].workdir)
    env = {**os.environ, CLUSTER_TAG: str(provider.root / cluster.name)}
    parent = subprocess.Popen([sys.executable, "-c", SPAWNS_A_WRITER_ON_TERM, str(node_dir / "logs" / "spawned")],
                              env=env, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None and parent.stdout.readline() == "ready\n"
    assert provider.terminate(cluster.name)
    parent.wait(timeout=30)
    assert not (provider.root / cluster.name).exists() and provider.describe(cluster.name) is None
    assert not tagged_processes(CLUSTER_TAG, str(provider.root / cluster.name))
