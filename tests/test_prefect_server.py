"""Prefect as users run it, against a real `prefect server start` and a real `trainpipe serve`.

One server and one serving process for the whole module (server start-up is the expensive part); every run
trains 2 real local nodes under torchrun.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, TRAINPIPE, prefect_home
from jobs import job_config, make_dataset, write_config
from test_pipeline_e2e import tagged_processes

from flows.automations import DEAD_RUNS, SILENT_RUNS
from flows.retrain import default_run_id
from infra.job.plan import cluster_name_for

RETRAIN = "retrain/retrain"
NIGHTLY_CRON = "0 2 * * *"  # the schedule README.md documents
SILENCE_S = 45  # the shortest --silence-s: heartbeats come every 30 s
# A SIGKILLed run is marked Crashed SILENCE_S after its last heartbeat; the sweep run then starts within the
# runner's poll (10 s) and its process start-up. Under a full suite on 2 shared cores the server's trigger evaluation
# has lagged past 150 s (2 of 5 full runs on 2026-12-03) and once past 195 s (the full suite with the kill matrix
# and the example jobs beside it), so the bound leaves it room; alone it takes ~100 s.
SWEEP_BOUND_S = SILENCE_S + 30 + 345


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what} not within {timeout:.0f}s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop a process and everything it started (its own session)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@dataclass
class Stack:
    api_url: str
    ui_url: str
    env: dict[str, str]
    home: Path  # TRAINPIPE_HOME of the serving process
    tmp: Path
    dataset_url: str
    logs: Path
    serve: subprocess.Popen[bytes] | None = None
    serves_started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start_serve(self) -> None:
        log = (self.logs / f"serve-{len(self.serves_started)}.log").open("wb")
        self.serve = subprocess.Popen([TRAINPIPE, "serve", "--silence-s", str(SILENCE_S)], cwd=REPO, env=self.env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.serves_started.append(self.serve)
        _wait_for(lambda: b"Your deployments are being served" in (self.logs / log.name).read_bytes()
                  or self.serve.poll() is not None, 180, "trainpipe serve start-up")
        assert self.serve.poll() is None, self.serve_log()

    def serve_log(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(self.logs.glob("serve-*.log")))

    def config(self, name: str, **training: Any) -> dict[str, Any]:
        config = job_config(self.tmp / name, self.dataset_url, **training)
        config["name"] = name
        return config


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    tmp = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    logs = tmp / "logs"
    logs.mkdir()
    env = {**os.environ, "PREFECT_HOME": prefect_home(tmp / "prefect-home"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "TRAINPIPE_HOME": str(tmp / "home"), "DO_NOT_TRACK": "1"}
    env.pop("PREFECT_PROFILES_PATH", None)
    server = subprocess.Popen(["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env={**env, "PATH": f"{Path(TRAINPIPE).parent}:{env['PATH']}"}, cwd=tmp,
                              stdout=(logs / "server.log").open("wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    stack = Stack(api_url=env["PREFECT_API_URL"], ui_url=f"http://127.0.0.1:{port}", env=env, home=tmp / "home",
                  tmp=tmp, dataset_url=make_dataset(tmp / "dataset"), logs=logs)
    try:
        _wait_for(lambda: _healthy(stack.api_url) or server.poll() is not None, 180, "prefect server start-up")
        assert server.poll() is None, (logs / "server.log").read_text()[-3000:]
        with temporary_settings(updates={PREFECT_API_URL: stack.api_url}):
            stack.start_serve()
            yield stack
    finally:
        for serve in stack.serves_started:
            _stop(serve)
        _stop(server)
        leftovers = tagged_processes(stack.home)
        for process in leftovers:
            process.kill()
        assert not leftovers, f"node processes outlived the module: {[p.pid for p in leftovers]}"


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _client() -> Any:
    from prefect import get_client

    return get_client(sync_client=True)


def _flow_run(flow_run_id: Any) -> Any:
    with _client() as client:
        return client.read_flow_run(flow_run_id)


def _running_run(deployment: str) -> Any:
    """A flow run of the deployment that is running, if any."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with _client() as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])))
    return next((run for run in runs if run.state is not None and run.state.is_running()), None)


def _training_started(home: Path) -> bool:
    return any("trainer.train" in " ".join(p.cmdline()) for p in tagged_processes(home))


def test_retrain_via_run_deployment_completes_with_artifacts_and_summary(stack: Stack) -> None:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.deployments import run_deployment

    flow_run = run_deployment(RETRAIN, parameters={"job": stack.config("served", steps=60)}, timeout=420,
                              poll_interval=2)
    assert flow_run.state is not None and flow_run.state.is_completed(), (flow_run.state, stack.serve_log())

    run_id = default_run_id("served", str(flow_run.id))
    summary = json.loads((stack.home / "runs" / run_id / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 60 and summary["nodes_left"] == 0
    with _client() as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])))
    by_type: dict[str, list[Any]] = {}
    for artifact in artifacts:
        by_type.setdefault(artifact.type, []).append(artifact)
    assert {"markdown", "table", "progress"} <= set(by_type), [a.type for a in artifacts]
    markdown = "\n".join(str(a.data) for a in by_type["markdown"])
    assert f"]({summary['checkpoint']})" in markdown, "the markdown summary does not link the committed checkpoint"
    assert "](data:image/png;base64," in markdown, "no loss curve / time breakdown image in the summary"
    assert "| train |" in markdown
    training = [a for a in by_type["progress"] if "training" in (a.description or "")]
    assert training and float(training[0].data) == 100.0, [(a.description, a.data) for a in by_type["progress"]]
    phases = [row["phase"] for a in by_type["table"] for row in json.loads(a.data) if "phase" in row]
    assert {"plan", "provision", "stage", "train", "teardown"} <= set(phases)
    launches = [a for a in by_type["table"] if (a.key or "").endswith("-launch-attempts")]
    attempts = [row for a in launches for row in json.loads(a.data)]
    assert [(row["instance_type"], row["outcome"]) for row in attempts] == [("local-process", "launched")]
    assert "## Launch attempts" in markdown and "cost **$0.0000**" in markdown
    checkpoint_rows = [row for a in by_type["table"] if (a.key or "").endswith("-checkpoints")
                       for row in json.loads(a.data)]
    assert checkpoint_rows and all(row["stall_s"] is not None for row in checkpoint_rows), checkpoint_rows
    assert not tagged_processes(stack.home)


def test_cancel_through_the_api_ends_cancelled_and_frees_nodes_for_a_waiting_run(stack: Stack) -> None:
    """A submitted run is cancelled while it trains; a nightly run that the node limit held back then runs."""
    from prefect.states import Cancelling

    from tasks.capacity import NODE_LIMIT

    with _client() as client:
        client.upsert_global_concurrency_limit_by_name(NODE_LIMIT, 2)  # what `trainpipe serve --max-nodes 2` sets
    try:
        config = write_config(stack.tmp / "cancel.yaml", stack.config("cancelled", steps=5000))
        submitted = subprocess.run([TRAINPIPE, "submit", str(config)], cwd=REPO, env=stack.env, capture_output=True,
                                   text=True, timeout=120)
        assert submitted.returncode == 0, submitted.stderr
        match = re.search(r"flow run ([0-9a-f-]{36})", submitted.stdout)
        assert match, submitted.stdout
        flow_run_id = match.group(1)
        _wait_for(lambda: _training_started(stack.home), 300, "training of the submitted run")

        # Another deployment (no deployment limit shared): only the 2-node global limit holds it back.
        waiting_config = write_config(stack.tmp / "waiting.yaml", stack.config("waiting", steps=40))
        waiting = subprocess.Popen([TRAINPIPE, "submit", str(waiting_config), "--wait", "--deployment",
                                    "retrain/nightly-retrain"], cwd=REPO, env=stack.env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            # Running: the flow has begun, and the first thing it does is ask for its nodes.
            held = _wait_for(lambda: _running_run("nightly-retrain"), 300, "the waiting run's start")
            clusters = sorted(p.name for p in (stack.home / "clusters").iterdir())
            assert len(clusters) == 1 and clusters[0].startswith("tp-cancelled-"), f"over the node limit: {clusters}"

            cancelled_at = time.time()
            with _client() as client:
                client.set_flow_run_state(flow_run_id, Cancelling(message="cancelled by the test"))
            state = _wait_for(lambda: (s := _flow_run(flow_run_id).state) and s.is_final() and s, 120,
                              "the cancelled state")
            assert state.is_cancelled(), (state, stack.serve_log())
            _wait_for(lambda: not (stack.home / "clusters" / clusters[0]).exists(), 60, "the cancelled run's teardown")

            output, _ = waiting.communicate(timeout=300)
        finally:
            _stop(waiting)
        assert waiting.returncode == 0, output[-3000:]
        assert "state: Completed" in output and "committed checkpoint: [file://" in output, output[-3000:]
        assert "data:image" not in output, "submit --wait must not print the embedded image"
        # It got its nodes (its summary starts then) only after the cancel, though it was running well before.
        summary = json.loads((stack.home / "runs" / default_run_id("waiting", str(held.id)) / "summary.json")
                             .read_text())
        assert summary["started_at"] + summary["flow_started_s"] > cancelled_at, "it ran over the node limit"
        _wait_for(lambda: not tagged_processes(stack.home), 60, "every node process to end")
    finally:
        with _client() as client:
            client.delete_global_concurrency_limit_by_name(NODE_LIMIT)


def test_cluster_bench_measures_every_disk_and_tears_down(stack: Stack) -> None:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.deployments import run_deployment

    flow_run = run_deployment("cluster-bench/cluster-bench", parameters={"disk_megabytes": 32}, timeout=300,
                              poll_interval=2)
    assert flow_run.state is not None and flow_run.state.is_completed(), (flow_run.state, stack.serve_log())
    with _client() as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])))
    rows = [row for a in artifacts if a.key == "cluster-bench-disks" for row in json.loads(a.data)]
    assert any(a.type == "markdown" for a in artifacts)
    assert len(rows) == 2 and all(row["write MB/s"] > 0 and row["read MB/s"] > 0 for row in rows), rows
    assert not tagged_processes(stack.home)
    assert not any(p.name.startswith("tp-bench-") for p in (stack.home / "clusters").iterdir())


@pytest.mark.timeout(1200)  # training start (up to 300 s) and the sweep's bound, beyond the suite's 600 s per test
def test_sigkilled_serve_is_swept_by_the_automation_within_the_bound(stack: Stack) -> None:
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.deployments import run_deployment

    with _client() as client:
        names = {a.name for a in client.read_automations()}
    assert {SILENT_RUNS, DEAD_RUNS} <= names

    flow_run = run_deployment(RETRAIN, parameters={"job": stack.config("killed", steps=5000)}, timeout=0)
    cluster_dir = stack.home / "clusters" / cluster_name_for(default_run_id("killed", str(flow_run.id)))
    _wait_for(lambda: _training_started(stack.home), 300, "training of the run to kill")
    # The serving process and the run's own process die together, as on a lost machine: no hook can run.
    assert stack.serve is not None
    os.killpg(stack.serve.pid, signal.SIGKILL)
    stack.serve.wait()
    killed_at, killed_wall = time.monotonic(), datetime.now(UTC)
    assert cluster_dir.is_dir(), "the killed run's cluster should be left behind for the sweeper"

    stack.start_serve()  # the supervisor restarts serve; the automations do the rest
    _wait_for(lambda: _flow_run(flow_run.id).state.is_crashed(), SWEEP_BOUND_S, "the killed run marked Crashed")
    _wait_for(lambda: not cluster_dir.exists() and not tagged_processes(stack.home),
              SWEEP_BOUND_S - (time.monotonic() - killed_at), "the sweep of the killed run's cluster")
    took = time.monotonic() - killed_at

    def automation_sweeps() -> list[Any]:
        # The sweep deployment's own 300 s schedule may have swept the cluster first: the automation's run (on the
        # Crashed event) then comes after it, so it is waited for, not looked for once.
        with _client() as client:
            sweeps = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["sweep-orphans"])))
        return [run for run in sweeps if run.created_by and run.created_by.type == "AUTOMATION" and run.created
                and run.created > killed_wall]

    _wait_for(automation_sweeps, max(30.0, SWEEP_BOUND_S - took), "a sweep-orphans run started by the automation "
              "after the kill")
    print(f"cluster of the SIGKILLed run torn down {took:.0f}s after the kill (bound {SWEEP_BOUND_S}s)")


def test_parameters_violating_the_schema_are_rejected_with_the_field_named(stack: Stack) -> None:
    from prefect.deployments import run_deployment

    config = stack.config("bad")
    config["cluster"]["nodes"] = 0
    with pytest.raises(Exception) as rejected:
        run_deployment(RETRAIN, parameters={"job": config}, timeout=0)
    assert "nodes" in str(rejected.value) and "409" in str(rejected.value), str(rejected.value)


def test_nightly_retrain_has_the_documented_cron_schedule(stack: Stack) -> None:
    with _client() as client:
        nightly = client.read_deployment_by_name("retrain/nightly-retrain")
        sweep = client.read_deployment_by_name("sweep-orphans/sweep-orphans")
    crons = [getattr(s.schedule, "cron", None) for s in nightly.schedules]
    assert crons == [NIGHTLY_CRON] and nightly.schedules[0].schedule.timezone == "UTC"
    assert nightly.enforce_parameter_schema and nightly.parameters["job"]["name"] == "nightly"
    assert nightly.global_concurrency_limit is not None and nightly.global_concurrency_limit.limit == 1
    assert nightly.concurrency_options is not None
    assert nightly.concurrency_options.collision_strategy.value == "CANCEL_NEW", "a second night is skipped"
    assert [s.schedule.interval.total_seconds() for s in sweep.schedules] == [300]
    assert f'"{NIGHTLY_CRON}"' in (REPO / "README.md").read_text(), "README.md must document the nightly cron"


def test_browser_renders_the_retrain_parameters_form(stack: Stack, tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is not installed: add it to scripts/system-packages.txt and run `make test`"
    with _client() as client:
        deployment = client.read_deployment_by_name(RETRAIN)
    url = f"{stack.ui_url}/deployments/deployment/{deployment.id}/run"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--virtual-time-budget=20000"]
    dom = subprocess.run([chromium, *flags, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    rendered = dom.stdout
    if not all(field in rendered for field in ("cluster", "dataset", "checkpoints", "Number of nodes")):
        screenshot = stack.logs / "retrain-form.png"
        subprocess.run([chromium, *flags, f"--user-data-dir={tmp_path / 'profile2'}", "--window-size=1400,2000",
                        f"--screenshot={screenshot}", url], capture_output=True, timeout=120)
        pytest.fail(f"the parameters form did not render at {url}; screenshot {screenshot}; "
                    f"DOM tail: {rendered[-1500:]} {dom.stderr[-500:]}")


def test_prefect_yaml_deploys_to_a_process_work_pool(stack: Stack) -> None:
    """The worker route: `prefect deploy --all` from the checkout registers the same four deployments."""
    env = {**stack.env, "PWD": str(REPO)}
    prefect = str(Path(TRAINPIPE).with_name("prefect"))
    pool = subprocess.run([prefect, "work-pool", "create", "trainpipe", "--type", "process", "--overwrite"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert pool.returncode == 0, pool.stdout + pool.stderr
    deployed = subprocess.run([prefect, "--no-prompt", "deploy", "--all"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    with _client() as client:
        nightly = client.read_deployment_by_name("retrain/nightly-retrain")
        bench = client.read_deployment_by_name("cluster-bench/cluster-bench")
    assert nightly.work_pool_name == "trainpipe" and bench.work_pool_name == "trainpipe"
    assert [s.schedule.cron for s in nightly.schedules] == [NIGHTLY_CRON]
    assert nightly.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
