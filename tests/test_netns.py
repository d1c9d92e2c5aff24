"""provider netns for real: nodes in network namespaces on a bridge, links shaped with tc tbf, an S3 store in a
namespace of its own, the verify floor, a whole job through the flow, and nothing left after a teardown or after a
SIGKILLed orchestrator's `trainpipe sweep`.

Namespaces need root: these tests skip without it, except in CI (CI=true), which runs as root and where a skip
would hide a broken provider.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, TRAINPIPE, cannot_run_here, prefect_home
from jobs import job_config, make_dataset, write_config
from provider_checks import assert_replaces_only_the_lost
from test_cluster_bench import bench_task_failure
from test_pipeline_e2e import tagged_processes

from infra.analysis import clusterbench
from infra.checkpoints.store import CheckpointStore
from infra.compute.providers import Cluster, ClusterRecord, InvalidRequestError, get_provider
from infra.compute.providers.netns import emulation as netns
from infra.compute.providers.netns.provider import NetnsProvider
from infra.compute.providers.netns.store import NetnsStore
from infra.compute.spec import ClusterSpec
from infra.dataset.stagecache import node_cache_dir
from infra.dataset.synth import synthesize
from infra.job.spec import load_job, parse_job
from infra.storage import open_store

QUICK_VERIFY = {"tcp_seconds": 1, "allreduce_sizes_mb": [1], "disk_bytes_mb": 8}
MB = 2**20


def require_netns() -> None:
    """Skip (fail in CI) where namespaces cannot be made."""
    problem = netns.problem()
    if problem is not None:
        cannot_run_here(problem)


@pytest.fixture
def provider(workspace: Path) -> Iterator[NetnsProvider]:
    """The netns provider of this test's workspace; whatever a failed test launched is torn down after it."""
    require_netns()
    provider = NetnsProvider()
    yield provider
    for record in provider.list_clusters():
        if record.name.startswith("tp-"):  # this workspace's clusters (records), not other sessions' orphans
            provider.terminate(record.name)


def spec_for(nodes: int = 2, link_mbit: float | None = None, relaunch: str = "same-machines", **cluster: Any
             ) -> ClusterSpec:
    return ClusterSpec(provider="netns", nodes=nodes, netns={"link_mbit": link_mbit, "relaunch": relaunch}, **cluster)


def leftovers(gid: str) -> list[str]:
    """Namespaces and interfaces of the group that still exist, as `ip` itself lists them."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()
    names += [link["ifname"] for link in json.loads(subprocess.run(["ip", "-j", "link"], capture_output=True,
                                                                   text=True, check=True).stdout)]
    return [name for name in names if f"-{gid}" in name]


ECHO_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print("port", server.getsockname()[1], flush=True)
conn, peer = server.accept()
conn.sendall(conn.recv(100) + b" from " + peer[0].encode())
conn.close()
"""

ECHO_CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as sock:
    sock.sendall(b"hello")
    print(sock.recv(100).decode())
"""


# -- lifecycle ----------------------------------------------------------------------------------------------


def test_launch_run_in_each_namespace_and_teardown_leaves_nothing(provider: NetnsProvider, workspace: Path) -> None:
    cluster = provider.launch("tp-netns-life", spec_for(link_mbit=200), "netns-life")
    gid = provider.group(cluster.name)
    head, other = cluster.nodes
    assert head.address != other.address and "127.0.0.1" not in (head.address, other.address)
    assert head.address.rsplit(".", 1)[0] == other.address.rsplit(".", 1)[0], "one /24 per cluster"
    assert [n.cluster_address for n in cluster.nodes] == [head.address, other.address], "the namespace's one address"
    assert sorted(leftovers(gid)) == sorted([f"tpn-{gid}-0", f"tpn-{gid}-1", f"tpb-{gid}", f"tpv-{gid}-0",
                                             f"tpv-{gid}-1"])

    for node in cluster.nodes:
        runner = provider.runner(cluster, node)
        [eth0] = json.loads(runner.run(["ip", "-j", "-4", "addr", "show", "dev", "eth0"]).output)
        assert eth0["addr_info"][0]["local"] == node.address
        assert "rate 200Mbit" in runner.run(["tc", "qdisc", "show", "dev", "eth0"]).output
    assert "rate 200Mbit" in subprocess.run(["tc", "qdisc", "show", "dev", f"tpv-{gid}-1"], capture_output=True,
                                            text=True, check=True).stdout

    # Node 0 reaches node 1 at its own address, through the bridge.
    lines: list[str] = []
    server = provider.runner(cluster, other).start([other.python, "-c", ECHO_SERVER, other.address],
                                                   on_line=lines.append)
    deadline = time.monotonic() + 60
    while not lines and time.monotonic() < deadline:
        assert server.poll() is None, server.tail()
        time.sleep(0.1)
    port = lines[0].split()[1]
    reply = provider.runner(cluster, head).run([head.python, "-c", ECHO_CLIENT, other.address, port],
                                               timeout=60)
    assert reply.output.strip() == f"hello from {head.address}"
    assert server.wait(10) == 0, server.tail()

    idle = provider.runner(cluster, other).start(["sleep", "300"])

    def listed() -> ClusterRecord:
        [record] = [r for r in provider.list_clusters() if r.name == cluster.name]
        return record

    # start() returns once `ip netns exec` is forked: the process is the namespace's from its setns() on.
    deadline = time.monotonic() + 30
    while (record := listed()).processes == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert record.owner_alive and record.processes == 1, "the process in the namespace carries the cluster's tags"
    assert tagged_processes(workspace)

    assert provider.terminate(cluster.name)
    assert idle.wait(10) is not None
    assert leftovers(gid) == [], "namespaces or interfaces outlived the teardown"
    assert not tagged_processes(workspace), "processes outlived the teardown"
    assert not (provider.root / cluster.name).exists()
    assert provider.terminate(cluster.name) is False, "a second teardown finds nothing"
    assert cluster.name not in [r.name for r in provider.list_clusters()]


def test_without_root_launch_is_an_invalid_request_and_listing_still_works(
        workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    provider = NetnsProvider()
    with pytest.raises(InvalidRequestError, match="provider netns needs root and iproute2"):
        provider.launch("tp-netns-noroot", spec_for(), "noroot")
    assert [r for r in provider.list_clusters() if r.name.startswith("tp-")] == []
    assert provider.terminate("tp-netns-noroot") is False


def test_a_group_without_record_or_owner_is_listed_and_swept(provider: NetnsProvider) -> None:
    """What a launch killed between its first namespace and its record leaves: found by name, removed with what
    runs inside."""
    finished = subprocess.Popen(["true"])
    dead_owner = {"pid": finished.pid, "create_time": time.time(), "host": "here"}
    finished.wait()
    gid = netns.group_id(f"orphan-{time.time_ns()}")
    netns.write_state(gid, {"kind": "cluster", "name": "tp-gone", "run_id": "gone", "owner": dead_owner,
                            "record": "/nonexistent/cluster.json", "created_at": time.time()})
    try:
        netns.create_cluster_network(gid, 2, None)
        stray = subprocess.Popen(netns.exec_argv(netns.node_namespace(gid, 1), ["sleep", "300"]),
                                 start_new_session=True)
        [record] = [r for r in provider.list_clusters() if r.name == f"tpn-{gid}"]
        assert (record.provider, record.run_id, record.nodes, record.owner_alive) == ("netns", "gone", 2, False)
        assert record.processes == 1
        assert get_provider("netns").terminate(record.name)
        assert stray.wait(10) is not None
        assert leftovers(gid) == [] and netns.read_state(gid) is None
    finally:
        netns.remove_group(gid)


# -- shaping and the verify floor ---------------------------------------------------------------------------


def test_links_are_shaped_to_the_rate_and_reshaped_live(provider: NetnsProvider) -> None:
    spec = spec_for(link_mbit=100, verify={**QUICK_VERIFY, "tcp_seconds": 2, "tcp_streams": 2})
    cluster = provider.launch("tp-netns-shape", spec, "netns-shape")
    [shaped] = clusterbench.measure_links(cluster, spec)
    assert provider.set_link_mbit(cluster.name, None) == 2
    [unshaped] = clusterbench.measure_links(cluster, spec)
    provider.terminate(cluster.name)

    print(f"node-0 → node-1: {shaped.gbps * 1000:.1f} Mbit/s shaped to 100, {unshaped.gbps:.2f} Gbit/s unshaped")
    assert 0.060 <= shaped.gbps <= 0.110, shaped
    assert unshaped.gbps > 5 * shaped.gbps, unshaped


def test_verify_fails_below_the_floor_naming_measured_and_expected(
        provider: NetnsProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = job_config(tmp_path, f"file://{tmp_path}/dataset")
    config["cluster"].update(provider="netns", min_network_gbps=1.0, netns={"link_mbit": 100},
                             verify={**QUICK_VERIFY, "bench": "fail"})
    job = parse_job(config)
    cluster = provider.launch("tp-netns-floor", job.cluster, "netns-floor")
    line = str(bench_task_failure(job, provider, cluster, monkeypatch)).splitlines()[1]
    found = re.match(r"tcp node-0 → node-1: ([\d.]+) Gbit/s measured vs 1 Gbit/s expected \(job floor "
                     r"cluster\.min_network_gbps\): below 80% of it", line)
    assert found, line
    assert 0.06 <= float(found[1]) <= 0.11, line
    assert leftovers(provider.group(cluster.name)) == []


# -- the object store in its own namespace ------------------------------------------------------------------


TRANSFER = """
import json, os, sys, time
from pathlib import Path
from infra.storage import open_store
store, path = open_store(sys.argv[1]), Path(sys.argv[2])
started = time.monotonic(); store.put_file(path, "from-node"); up = time.monotonic() - started
started = time.monotonic(); store.get_file("from-node", path.with_suffix(".back")); down = time.monotonic() - started
assert path.with_suffix(".back").read_bytes() == path.read_bytes()
print(json.dumps({"up_s": up, "down_s": down}))
"""


def mbit(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e6


def test_store_in_its_own_namespace_serves_at_its_link_rate(provider: NetnsProvider, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    payload = tmp_path / "payload.bin"
    payload.write_bytes(os.urandom(5 * MB))
    forward_before = netns.IP_FORWARD.read_text()
    with NetnsStore(tmp_path / "s3", link_mbit=50) as store:
        gid = store.gid
        assert gid is not None and leftovers(gid) == [f"tps-{gid}", f"tpv-{gid}-s"]
        url = store.make_bucket("netns-bucket")
        for name, value in store.env().items():
            monkeypatch.setenv(name, value)
        bucket = open_store(url)

        # From the root namespace: the orchestrator's way.
        started = time.monotonic()
        bucket.put_file(payload, "from-root")
        up = mbit(5 * MB, time.monotonic() - started)
        started = time.monotonic()
        bucket.get_file("from-root", tmp_path / "from-root.bin")
        down = mbit(5 * MB, time.monotonic() - started)
        assert (tmp_path / "from-root.bin").read_bytes() == payload.read_bytes()

        # From a node's namespace: through its bridge, the root namespace's routing and the store's link.
        cluster = provider.launch("tp-netns-store", spec_for(nodes=1), "netns-store")
        node = cluster.head
        result = provider.runner(cluster, node).run([node.python, "-c", TRANSFER, url, str(payload)], timeout=120)
        timings = json.loads(result.output.strip().splitlines()[-1])
        provider.terminate(cluster.name)
        node_up, node_down = mbit(5 * MB, timings["up_s"]), mbit(5 * MB, timings["down_s"])

        store.set_link_mbit(None)
        started = time.monotonic()
        bucket.get_file("from-node", tmp_path / "unshaped.bin")
        unshaped = mbit(5 * MB, time.monotonic() - started)

    print(f"store at 50 Mbit/s: root up {up:.1f} down {down:.1f}, node up {node_up:.1f} down {node_down:.1f}, "
          f"unshaped down {unshaped:.0f} Mbit/s")
    for figure in (up, down, node_up, node_down):
        assert 25 <= figure <= 55, figure
    assert unshaped > 4 * 50
    assert leftovers(gid) == [] and netns.read_state(gid) is None, "the store's namespace outlived it"
    assert netns.IP_FORWARD.read_text() == forward_before


# -- whole jobs ---------------------------------------------------------------------------------------------


def netns_job_config(tmp: Path, dataset_url: str, link_mbit: float | None, **training: Any) -> dict[str, Any]:
    config = job_config(tmp, dataset_url, **training)
    config["cluster"].update(provider="netns", netns={"link_mbit": link_mbit})
    return config


def test_a_two_node_job_on_netns_trains_commits_and_leaves_nothing(
        prefect_server: None, provider: NetnsProvider, workspace: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The dataset and the checkpoints live in the store behind its own shaped link: every node stages over its
    link and the store's, gloo runs between the namespaces."""
    from flows.retrain import retrain

    with NetnsStore(tmp_path / "s3", link_mbit=200, etag_hash="") as store:
        for name, value in store.env().items():
            monkeypatch.setenv(name, value)
        bucket = store.make_bucket("netns-job")
        synthesize(open_store(f"{bucket}/dataset"), 400_000, vocab_size=256, shard_tokens=100_000, seed=3)
        config = netns_job_config(tmp_path, f"{bucket}/dataset", link_mbit=1000, steps=80, ckpt_every=40)
        config["checkpoints"].update(url=f"{bucket}/ckpt")
        summary = retrain(parse_job(config), "netns-run")
        latest = CheckpointStore(open_store(f"{bucket}/ckpt/netns-run")).latest()

    assert summary["status"] == "completed", summary
    assert summary["steps"] == 80 and summary["final_loss"] < summary["initial_loss"], "loss did not fall"
    assert summary["checkpoint"].endswith("/netns-run/step-00000080")
    assert latest is not None and latest.step == 80
    assert summary["nodes_left"] == 0
    assert leftovers(provider.group("tp-netns-run")) == [], "namespaces or interfaces outlived the run"
    assert not tagged_processes(workspace), "node processes outlived the run"


def test_sigkilled_run_on_netns_is_swept_with_its_namespaces(provider: NetnsProvider, workspace: Path,
                                                              tmp_path: Path) -> None:
    config = netns_job_config(tmp_path, make_dataset(tmp_path / "dataset"), link_mbit=1000, steps=4000)
    config_path = write_config(tmp_path / "job.yaml", config)
    env = {**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_HOME": prefect_home(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    gid = provider.group("tp-kill-run")
    log = tmp_path / "orchestrator.log"
    orchestrator = subprocess.Popen([TRAINPIPE, "run", str(config_path), "--run-id", "kill-run"], cwd=REPO, env=env,
                                    stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not any("trainer.train" in " ".join(p.cmdline()) for p in tagged_processes(workspace)):
            assert orchestrator.poll() is None, "the run ended before training started:\n" + log.read_text()[-3000:]
            assert time.monotonic() < deadline, "training did not start within 300 s"
            time.sleep(0.5)
    finally:
        # The orchestrator and its Prefect server die without a chance to clean up: nodes and namespaces stay.
        os.killpg(orchestrator.pid, signal.SIGKILL)
        orchestrator.wait()

    assert tagged_processes(workspace), "the nodes' processes should outlive the orchestrator (orphans)"
    assert len(leftovers(gid)) == 5, "the namespaces should outlive the orchestrator"
    status = subprocess.run([TRAINPIPE, "status"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert any("tp-kill-run" in line and "netns" in line and "ORPHANED" in line
               for line in status.stdout.splitlines()), status.stdout
    swept = subprocess.run([TRAINPIPE, "sweep"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert "tearing down tp-kill-run (netns, run kill-run" in swept.stdout
    assert not tagged_processes(workspace), "sweep left node processes running"
    assert leftovers(gid) == [], "sweep left namespaces or interfaces"
    assert not (provider.root / "tp-kill-run").exists()


def test_describe_and_nodes_alive_follow_the_record(provider: NetnsProvider) -> None:
    cluster: Cluster = provider.launch("tp-netns-status", spec_for(nodes=1), "netns-status")
    try:
        assert provider.describe(cluster.name) == cluster
        assert provider.nodes_alive(cluster) == {cluster.head.name: True}
    finally:
        provider.terminate(cluster.name)
    assert provider.describe(cluster.name) is None


def test_replace_nodes_gives_the_lost_node_its_namespace_again_empty(provider: NetnsProvider) -> None:
    cluster: Cluster = provider.launch("tp-netns-replace", spec_for(nodes=2), "netns-replace")
    try:
        replaced = assert_replaces_only_the_lost(provider, cluster)
        runner = provider.runner(replaced, replaced.nodes[1])
        assert runner.run(["ip", "-4", "-o", "addr", "show", netns.INNER_IF]).output.count(
            f" {replaced.nodes[1].address}/") == 1, "the replacement answers on the lost node's address"
    finally:
        provider.terminate(cluster.name)


def test_the_example_is_a_two_node_netns_job_on_1_gbit_links() -> None:
    job = load_job(REPO / "examples" / "netns.yaml")
    assert (job.cluster.provider, job.cluster.nodes, job.cluster.netns.link_mbit) == ("netns", 2, 1000)


@pytest.mark.parametrize(("relaunch", "kept"), [("same-machines", True), ("new-machines", False)])
def test_a_recoverys_teardown_keeps_the_nodes_data_only_on_the_same_machines(
        provider: NetnsProvider, relaunch: str, kept: bool) -> None:
    """new-machines stands in for a cloud's relaunch (its instances come back empty): what the recovery bench sets
    replace-one against."""
    cluster: Cluster = provider.launch("tp-netns-relaunch", spec_for(nodes=1, relaunch=relaunch), "netns-relaunch")
    node = cluster.head
    staged = Path(node.data_dir) / "shard-0.bin"
    cached = Path(node_cache_dir("netns", node.workdir)) / "object"
    try:
        for path in (staged, cached):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"staged")
        provider.terminate_keeping_data(cluster.name)
        assert (staged.exists(), cached.exists()) == (kept, kept)
        assert provider.describe(cluster.name) is None
    finally:
        provider.terminate(cluster.name)
        shutil.rmtree(cached.parent, ignore_errors=True)
