"""The orchestrator SIGKILLed in every phase: nothing is left once the sweep has run, and a rerun with the same run id
resumes from the last commit.

The orchestrator is the retrain flow, unmodified, in a process and session of its own, as a Prefect worker runs it
(forked from a warm interpreter: tests/warm_flows.py; the last run of each matrix, and the cloud run that gets
cancelled first, are the installed `trainpipe run`). Its
node processes run in sessions of their own, as on other machines, and outlive it. The phase it is killed in is found
from what it shows, never from a hook in it: its own output (Prefect's task-run lines), the store (a commit), the
cluster (a node directory appearing), the simulated clouds (instances appearing or shutting down), and for teardown
a node process that takes a few seconds to stop on SIGTERM, as a trainer flushing its last checkpoint does, whose
SIGTERM says that teardown has begun. After the kill the phase is read back from the output and must be the one
aimed at.

Local nodes: every phase, one run each, in order; where a commit exists the next run is the rerun (train → sync →
teardown → a last run that completes), so every resume is checked without a run of its own. netns nodes: the phases
with a cluster of their own to leave behind (provision, verify, stage, train, teardown). AWS, GCP, Nebius
and Azure (the simulated control planes; nobody answers at the instances' addresses, so provisioning waits for the nodes
to boot): killed while provisioning, and (AWS, GCP) while tearing down after a cancel (SIGTERM) reached it. The
phase × outcome table is printed at the end of the module.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from aws_server import Ec2Server, moto_ec2
from azure_arm_server import SUBSCRIPTION, ArmServer
from cloud_env import aws_env, aws_left, ec2_client, gcp_env, gcp_key_file, gcp_left, register_image, wait_for
from conftest import REPO, TRAINPIPE, cannot_run_here
from gce_server import PROJECT, GceServer
from google.auth.credentials import AnonymousCredentials
from jobs import job_config, make_dataset, write_config
from test_cli import invoke
from warm_flows import WarmFlows, alive, warm_flows

from infra.checkpoints.store import CheckpointStore
from infra.compute.providers import Provider, get_provider
from infra.compute.providers.aws.provider import TAG_HEARTBEAT, AwsProvider
from infra.compute.providers.azure import names as azure_names
from infra.compute.providers.azure.provider import AzureProvider
from infra.compute.providers.gcp.labels import LABEL_CLUSTER, LABEL_HEARTBEAT
from infra.compute.providers.gcp.provider import GcpProvider
from infra.compute.providers.local import CLUSTER_TAG, NODE_TAG
from infra.compute.providers.netns import emulation as netns
from infra.job.plan import cluster_name_for
from infra.lifecycle.sweep import sweep_clusters
from infra.node.processes import tagged_processes
from infra.storage import open_store

PHASES = ("plan", "provision", "verify", "stage", "train", "sync", "teardown")
# Where each phase begins, in the orchestrator's output (Prefect names task runs <task>-<3 hex>).
BEGINS = {
    "plan": re.compile(r"Beginning flow run"),
    "provision": re.compile(r"Task run 'plan-[0-9a-f]{3}' - Finished in state Completed"),
    "verify": re.compile(r"Task run 'provision-cluster-[0-9a-f]{3}' - Finished in state Completed"),
    "stage": re.compile(r"Task run 'bench-cluster-[0-9a-f]{3}' - Finished in state Completed"),
    "train": re.compile(r"Task run 'train-[0-9a-f]{3}' - "),
    "sync": re.compile(r"Task run 'train-[0-9a-f]{3}' - Finished in state Completed"),
    "teardown": re.compile(r"Task run 'verify-committed-checkpoint-[0-9a-f]{3}' - Finished in state Completed"),
}
RESUMED = re.compile(r"resumed from \S+ at step (\d+)")
STEPS, EVERY = 100, 20
CLOUD_TTL_S = 10.0
SLOW_STOP_S = 3.0  # how long the stand-in for a flushing trainer takes to exit on SIGTERM

ROWS: list[dict[str, str]] = []


@pytest.fixture(scope="module", autouse=True)
def table(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if not ROWS:
        return
    columns = ("provider", "phase", "killed in", "left by the kill", "left after", "last commit", "rerun resumed at")
    widths = [max(len(c), *(len(r[c]) for r in ROWS)) for c in columns]
    lines = ["", "orchestrator SIGKILL: phase × outcome",
             "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(r[c].ljust(w) for c, w in zip(columns, widths, strict=True)) for r in ROWS]
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        print("\n".join(lines), flush=True)


@pytest.fixture(scope="module")
def flows(prefect_server: None) -> Iterator[WarmFlows]:
    with warm_flows({**os.environ, **prefect_env()}) as server:
        yield server


@pytest.fixture(scope="module")
def dataset_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(tmp_path_factory.mktemp("kill-dataset"), tokens=200_000)


def prefect_env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {"PREFECT_API_URL": str(PREFECT_API_URL.value()), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def trainpipe_run(config: Path, run_id: str) -> list[str]:
    return [TRAINPIPE, "run", str(config), "--run-id", run_id]


class Orchestrator:
    """An orchestrator in a session of its own, its output in a file: the retrain flow forked from the warm server
    (tests/warm_flows.py: a process as a Prefect worker runs it), or a command."""

    def __init__(self, log: Path, pid: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        self.log, self.pid, self.popen = log, pid, popen

    @classmethod
    def flow(cls, flows: WarmFlows, config: Path, run_id: str, env: dict[str, str], log: Path) -> Orchestrator:
        return cls(log, flows.start("retrain", config, run_id, log, env))

    @classmethod
    def command(cls, argv: list[str], env: dict[str, str], log: Path) -> Orchestrator:
        popen = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
        return cls(log, popen.pid, popen)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def ended(self) -> bool:
        return self.popen.poll() is not None if self.popen is not None else not alive(self.pid)

    def running(self) -> bool:
        assert not self.ended(), "the run ended before the kill:\n" + self.output()[-4000:]
        return True

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)  # a fork that has not made its own session yet

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        wait_for(self.ended, 30, "the killed orchestrator going", interval=0.02)

    def wait_for(self, check: Callable[[], bool], what: str, timeout: float = 240, interval: float = 0.02) -> None:
        wait_for(lambda: self.running() and check(), timeout, what, interval=interval)


def phase_at(output: str) -> str:
    """The last phase whose beginning the output shows."""
    return next((phase for phase in reversed(PHASES) if BEGINS[phase].search(output)), "before the flow")


# -- local and netns nodes --------------------------------------------------------------------------------------------


def cluster_dir(provider: Provider, run_id: str) -> Path:
    return provider.root / cluster_name_for(run_id)  # type: ignore[attr-defined]


def leftovers(provider: Provider, run_id: str) -> dict[str, int]:
    """What of the run's cluster exists on this machine: processes, node dirs, network namespaces."""
    base = cluster_dir(provider, run_id)
    found = {"processes": len(tagged_processes(CLUSTER_TAG, str(base))),
             "node dirs": len(list(base.glob("node-*"))) if base.exists() else 0}
    if provider.name == "netns":
        group = netns.groups().get(provider.group(cluster_name_for(run_id)))  # type: ignore[attr-defined]
        found["namespaces"] = len(group.namespaces) if group else 0
        found["processes"] += len(netns.group_pids(group)) if group else 0
    return found


def shown(counts: dict[str, int | list[str]]) -> str:
    parts = [f"{len(v) if isinstance(v, list) else v} {k}" for k, v in counts.items()
             if (len(v) if isinstance(v, list) else v)]
    return ", ".join(parts) or "nothing"


def start_slow_stopper(provider: Provider, run_id: str, flag: Path) -> subprocess.Popen[bytes]:
    """A node process (it carries node 0's tags, as every process a runner starts does) that takes SLOW_STOP_S to
    exit on SIGTERM, and says when the SIGTERM came: teardown has begun."""
    base = cluster_dir(provider, run_id)
    code = (f"import signal, sys, time\n"
            f"def stop(*_):\n    open({str(flag)!r}, 'w').write(str(time.time()))\n    time.sleep({SLOW_STOP_S})\n"
            f"    sys.exit(0)\n"
            f"signal.signal(signal.SIGTERM, stop)\nwhile True:\n    signal.pause()\n")
    env = {**os.environ, CLUSTER_TAG: str(base), NODE_TAG: f"{cluster_name_for(run_id)}-node-0"}
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=base, start_new_session=True)


# netns leaves out the two phases whose kill meets nothing of its own: plan runs before any cluster exists, and sync
# (the train task over, the flush under way) kills the same node processes in the same namespaces as train.
@pytest.mark.parametrize(("provider_name", "phases"), [
    pytest.param("local", PHASES, id="local"),
    pytest.param("netns", tuple(phase for phase in PHASES if phase not in ("plan", "sync")), id="netns")])
def test_sigkill_in_every_phase_leaves_nothing_after_the_sweep_and_reruns_resume(
        provider_name: str, phases: tuple[str, ...], flows: WarmFlows, workspace: Path, tmp_path: Path,
        dataset_url: str) -> None:
    if provider_name == "netns" and (why := netns.problem()) is not None:
        cannot_run_here(why)
    provider = get_provider(provider_name)
    run_id = f"kill-{provider_name}"
    config = job_config(tmp_path, dataset_url, steps=STEPS, ckpt_every=EVERY)
    config["cluster"]["provider"] = provider_name
    config_path = write_config(tmp_path / "job.yaml", config)
    checkpoints = CheckpointStore(open_store(f"{config['checkpoints']['url']}/{run_id}"))
    env = {**os.environ, **prefect_env(), "TRAINPIPE_HOME": str(workspace)}
    base = cluster_dir(provider, run_id)
    expected_resume: int | None = None

    for phase in phases:
        orchestrator = Orchestrator.flow(flows, config_path, run_id, env, tmp_path / f"{phase}.log")
        slow_stopper = None
        try:
            if phase in ("plan", "verify", "stage", "sync"):
                orchestrator.wait_for(lambda o=orchestrator, p=phase: bool(BEGINS[p].search(o.output())), phase)
            elif phase == "provision":
                # The launch's first mark: a netns cluster's network state (its namespaces come next, in seconds),
                # a local cluster's directory (its record in it; the nodes' dirs and processes come next).
                first = netns.STATE_DIR / f"{provider.group(cluster_name_for(run_id))}.json" \
                    if provider_name == "netns" else base  # type: ignore[attr-defined]
                orchestrator.wait_for(first.exists, "the launch beginning", interval=0.005)
            elif phase == "train":
                orchestrator.wait_for(lambda: checkpoints.latest() is not None, "the first commit")
            else:
                flag = tmp_path / "teardown-began"
                orchestrator.wait_for(lambda: (base / "node-0").is_dir(), "the cluster")
                slow_stopper = start_slow_stopper(provider, run_id, flag)
                orchestrator.wait_for(flag.exists, "teardown")
        finally:
            orchestrator.kill()
        output = orchestrator.output()
        killed_in = phase_at(output)
        left = leftovers(provider, run_id)
        resumed = [int(step) for step in RESUMED.findall(output)]

        swept = sweep_clusters(providers=[provider])
        if slow_stopper is not None:
            slow_stopper.wait(timeout=30)
        after = leftovers(provider, run_id)
        latest = checkpoints.latest()
        ROWS.append({"provider": provider_name, "phase": phase, "killed in": killed_in, "left by the kill": shown(left),
                     "left after": f"{shown(after)} (sweep: {len(swept)} clusters)",
                     "last commit": str(latest.step) if latest else "none",
                     "rerun resumed at": "-"})
        if expected_resume is not None:
            ROWS[-2]["rerun resumed at"] = str(resumed[0]) if resumed else "not resumed"
            assert resumed == [expected_resume], f"the run after the kill in {ROWS[-2]['phase']} resumed at {resumed}"
        assert killed_in == phase, f"aimed at {phase}, killed in {killed_in}:\n{output[-3000:]}"
        assert after == {k: 0 for k in after}, f"left after the sweep: {after}"
        assert not base.exists(), "the cluster's directory outlived the sweep"
        if phase in ("plan", "provision", "verify", "stage"):
            assert latest is None, "nothing is committed before training"
        else:
            assert latest is not None and EVERY <= latest.step <= STEPS
            expected_resume = latest.step + 1

    final = subprocess.run(trainpipe_run(config_path, run_id), cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=600)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    summary = json.loads((workspace / "runs" / run_id / "summary.json").read_text())
    resumed = [int(step) for step in RESUMED.findall(final.stdout + final.stderr)]
    ROWS[-1]["rerun resumed at"] = str(resumed[0]) if resumed else "not resumed"
    assert resumed == [expected_resume], f"the last run resumed at {resumed}"
    assert summary["status"] == "completed" and summary["resumed_from_step"] == expected_resume - 1
    assert summary["nodes_left"] == 0
    # The URL the run printed is what `trainpipe ckpt verify` takes.
    printed = re.search(r"checkpoint: (\S+/step-\d{8})", final.stdout)
    assert printed is not None, final.stdout[-2000:]
    verified = invoke("ckpt", "verify", printed.group(1))
    assert verified.exit_code == 0, verified.output
    assert json.loads(verified.stdout)["step"] == STEPS
    assert leftovers(provider, run_id) == {k: 0 for k in leftovers(provider, run_id)}


# -- AWS and GCP ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ec2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ec2Server]:
    # Nothing listens at the instances' addresses: launch waits for them to boot until it is killed.
    with moto_ec2(tmp_path_factory.mktemp("moto"), public_ip_prefix="127.78.1.", shutting_down_s=3.0) as server:
        yield server


@pytest.fixture(scope="module")
def gce() -> Iterator[GceServer]:
    with GceServer(nat_prefix="127.78.2.") as server:
        yield server


@pytest.fixture(scope="module")
def arm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ArmServer]:
    with ArmServer(tmp_path_factory.mktemp("arm"), public_prefix="127.78.4.", private_prefix="127.79.4.") as server:
        yield server


class FakeToken:
    """The sweeper's credential here: the simulated ARM takes any token."""

    def get_token(self, *scopes: str, **_: object) -> object:
        from azure.core.credentials import AccessToken

        return AccessToken("fake-token", int(time.time()) + 3600)


# Azure: the launch phase only (a teardown there is one delete of the cluster's resource group), to keep CI short.
@pytest.mark.parametrize(("provider_name", "phases"), [("aws", ("provision", "teardown")),
                                                       ("gcp", ("provision", "teardown")), ("azure", ("provision",))])
def test_sigkill_while_provisioning_and_while_tearing_down_on_the_clouds(
        provider_name: str, phases: tuple[str, ...], flows: WarmFlows, workspace: Path, tmp_path: Path,
        dataset_url: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    key = tmp_path / "id_ed25519"
    key.write_text("read at launch; no node ever answers here\n")
    common = {**os.environ, **prefect_env(), "TRAINPIPE_HOME": str(workspace), "TRAINPIPE_SSH_KEY_FILE": str(key)}
    if provider_name == "aws":
        ec2: Ec2Server = request.getfixturevalue("ec2")
        region = "us-east-1"
        env = {**common, **aws_env(ec2, register_image(ec2, region), region)}
        for name, value in aws_env(ec2, env["TRAINPIPE_AWS_AMI"], region).items():
            monkeypatch.setenv(name, value)
        sweeper: Provider = AwsProvider(bootstrap=False)

        def left(cluster: str) -> dict[str, list[str]]:
            return aws_left(ec2, cluster, region)

        def launched(cluster: str) -> bool:
            return bool(left(cluster).get("instances"))

        def tearing_down(cluster: str) -> bool:
            return any(i.endswith(":shutting-down") for i in left(cluster).get("instances", []))

        def heartbeat(cluster: str) -> float:
            tags = [float(t["Value"]) for r in ec2_client(ec2, region).describe_instances(Filters=[
                {"Name": "tag:trainpipe:cluster", "Values": [cluster]}])["Reservations"] for i in r["Instances"]
                for t in i.get("Tags", []) if t["Key"] == TAG_HEARTBEAT]
            return max(tags, default=0.0)
    elif provider_name == "azure":
        arm: ArmServer = request.getfixturevalue("arm")
        region = "eastus"
        env = {**common, **arm.env(), "TRAINPIPE_SSH_CIDR": "127.0.0.1/32",
               "TRAINPIPE_AZURE_SSH_PUBLIC_KEY": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKillMatrix test"}
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(arm.ca_file))
        sweeper = AzureProvider(subscription=SUBSCRIPTION, credential=FakeToken(), endpoint=arm.endpoint,
                                bootstrap=False)

        def left(cluster: str) -> dict[str, list[str]]:
            group = azure_names.group_name(cluster)
            found = {"resource group": [g["name"] for g in arm.groups() if g["name"] == group],
                     "vms": [r["name"] for r in arm.resources("virtualMachines", group)]}
            return {k: v for k, v in found.items() if v}

        def launched(cluster: str) -> bool:
            return bool(left(cluster).get("vms"))

        def tearing_down(cluster: str) -> bool:
            return any(c.method == "DELETE" and azure_names.group_name(cluster) in c.path for c in arm.calls())

        def heartbeat(cluster: str) -> float:
            return max((float(g["tags"][azure_names.TAG_HEARTBEAT]) for g in arm.groups()
                        if g["name"] == azure_names.group_name(cluster)), default=0.0)
    else:
        gce: GceServer = request.getfixturevalue("gce")
        region = "us-central1"
        env = {**common, **gcp_env(gce, gcp_key_file(tmp_path / "service-account.json", gce)),
               "TRAINPIPE_GCP_ZONES": "us-central1-a"}
        sweeper = GcpProvider(project=PROJECT, credentials=AnonymousCredentials(), api_endpoint=gce.endpoint,
                              bootstrap=False)

        def left(cluster: str) -> dict[str, list[str]]:
            return gcp_left(gce, cluster)

        def launched(cluster: str) -> bool:
            return bool(left(cluster).get("instances"))

        def tearing_down(cluster: str) -> bool:
            return any(c.status == 200 and f"instances/{cluster}" in c.path for c in gce.calls("DELETE"))

        def heartbeat(cluster: str) -> float:
            return max((float(i["labels"][LABEL_HEARTBEAT]) for i in gce.instances()
                        if i["labels"].get(LABEL_CLUSTER) == cluster and LABEL_HEARTBEAT in i["labels"]), default=0.0)

    config = job_config(tmp_path, dataset_url, steps=STEPS, ckpt_every=EVERY)
    config["cluster"] = {"provider": provider_name, "nodes": 2, "procs_per_node": 1, "regions": [region],
                         "lease_ttl_s": CLOUD_TTL_S, "verify": {"bench": "off"}}
    config_path = write_config(tmp_path / "job.yaml", config)

    for phase in phases:
        run_id = f"kill-{provider_name}-{phase}"
        cluster = cluster_name_for(run_id)
        # To be cancelled, `trainpipe run`: it turns a SIGTERM into the run's own teardown.
        log = tmp_path / f"{phase}.log"
        orchestrator = (Orchestrator.command(trainpipe_run(config_path, run_id), env, log) if phase == "teardown"
                        else Orchestrator.flow(flows, config_path, run_id, env, log))
        try:
            orchestrator.wait_for(lambda c=cluster: launched(c), "instances launching")
            if phase == "teardown":
                orchestrator.signal(signal.SIGTERM)  # a cancel: the run's own teardown begins
                orchestrator.wait_for(lambda c=cluster: tearing_down(c), "the run's teardown", timeout=120)
        finally:
            orchestrator.kill()
        output = orchestrator.output()
        killed_in = "teardown" if tearing_down(cluster) else phase_at(output)
        left_by_kill = left(cluster)
        if phase == "provision":
            # No watchdog runs on a node that never booted: the sweep takes the cluster once its heartbeat, which
            # the dead orchestrator no longer renews, is older than the lease.
            wait_for(lambda c=cluster: time.time() - heartbeat(c) > CLOUD_TTL_S, CLOUD_TTL_S + 30,
                     "the heartbeat expiring", interval=0.5)
        swept = sweep_clusters(providers=[sweeper])
        after = left(cluster)
        ROWS.append({"provider": provider_name, "phase": phase, "killed in": killed_in,
                     "left by the kill": shown(left_by_kill),
                     "left after": f"{shown(after)} (sweep: {len(swept)} clusters)",
                     "last commit": "none", "rerun resumed at": "-"})
        assert killed_in == phase, output[-3000:]
        assert left_by_kill, "the kill should have left something for the sweep"
        assert after == {}, f"left after the sweep: {after}"
    # The orchestrators' processes carry the key file in their environment; this module's servers, started by the
    # first test that asks for them, carry that test's TRAINPIPE_HOME but not the key file.
    assert not [p for p in psutil.process_iter(["environ"])
                if (p.info["environ"] or {}).get("TRAINPIPE_SSH_KEY_FILE") == str(key)], \
        "an orchestrator of this test outlived its kill"


def test_sigkill_while_provisioning_on_nebius(prefect_server: None, workspace: Path, tmp_path: Path,
                                              dataset_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Nebius row (tests/nebius_server.py, nobody answering at its instances' addresses): the installed
    `trainpipe run` killed while it waits for its nodes to boot; the sweep takes the GPU cluster and its instances once
    the heartbeat on the GPU cluster is older than the lease."""
    from nebius_server import NebiusServer

    from infra.compute.providers.nebius.labels import LABEL_CLUSTER as NEBIUS_CLUSTER
    from infra.compute.providers.nebius.labels import LABEL_HEARTBEAT as NEBIUS_HEARTBEAT
    from infra.compute.providers.nebius.provider import NebiusProvider

    key = tmp_path / "id_ed25519"
    key.write_text("read at launch; no node ever answers here\n")
    key.with_name("id_ed25519.pub").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKILL kill-matrix\n")
    with NebiusServer() as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        env = {**os.environ, **prefect_env(), "TRAINPIPE_HOME": str(workspace), "TRAINPIPE_SSH_KEY_FILE": str(key)}
        fake = server.fake

        def left(cluster: str) -> dict[str, list[str]]:
            found = {"instances": [i.metadata.name for i in fake.instances.values()
                                   if i.metadata.labels.get(NEBIUS_CLUSTER) == cluster],
                     "GPU clusters": [g.metadata.name for g in fake.gpu_clusters.values()
                                      if g.metadata.labels.get(NEBIUS_CLUSTER) == cluster]}
            return {k: v for k, v in found.items() if v}

        def heartbeat(cluster: str) -> float:
            return max((float(g.metadata.labels[NEBIUS_HEARTBEAT]) for g in fake.gpu_clusters.values()
                        if g.metadata.labels.get(NEBIUS_CLUSTER) == cluster), default=0.0)

        config = job_config(tmp_path, dataset_url, steps=STEPS, ckpt_every=EVERY)
        config["cluster"] = {"provider": "nebius", "nodes": 2, "procs_per_node": 1, "regions": ["eu-north1"],
                             "lease_ttl_s": CLOUD_TTL_S, "verify": {"bench": "off"}}
        config_path = write_config(tmp_path / "job.yaml", config)
        run_id = "kill-nebius-provision"
        cluster = cluster_name_for(run_id)
        orchestrator = Orchestrator.command(trainpipe_run(config_path, run_id), env, tmp_path / "provision.log")
        try:
            orchestrator.wait_for(lambda: bool(left(cluster).get("instances")), "instances launching")
        finally:
            orchestrator.kill()
        killed_in, left_by_kill = phase_at(orchestrator.output()), left(cluster)
        wait_for(lambda: time.time() - heartbeat(cluster) > CLOUD_TTL_S, CLOUD_TTL_S + 30, "the heartbeat expiring",
                 interval=0.5)
        swept = sweep_clusters(providers=[NebiusProvider(bootstrap=False)])
        after = left(cluster)
    ROWS.append({"provider": "nebius", "phase": "provision", "killed in": killed_in,
                 "left by the kill": shown(left_by_kill),
                 "left after": f"{shown(after)} (sweep: {len(swept)} clusters)", "last commit": "none",
                 "rerun resumed at": "-"})
    assert killed_in == "provision", orchestrator.output()[-3000:]
    assert left_by_kill.get("GPU clusters") and left_by_kill.get("instances"), "the kill should leave the cluster"
    assert after == {}, f"left after the sweep: {after}"
