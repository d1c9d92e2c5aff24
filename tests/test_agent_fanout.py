"""The agent's wheels reach a cloud cluster's nodes once (infra/compute/access/agent_fanout.py): the orchestrator
copies the bundle to the head only, the other nodes fetch it from the head's file server over the cluster network,
verified by sha256; a second bootstrap moves nothing; a head that serves a wrong file sends its peers back to the
orchestrator's copy, logged, and they still get their agent; the head's server is gone once the bootstrap ends.

Three stand-in machines (tests/cloud_nodes.py): a real sshd per node on its public address, each with a HOME of its
own, so each node's agent dir (~/.trainpipe/agent) is its own and a file a node lacks really moves; the head's
server must bind the head's private (cluster) address.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cloud_nodes import Instance, Machines, machines
from sshd import require_sshd

from infra.compute.access.agent_env import DEFAULT_AGENT_DIR, node_bundle
from infra.compute.access.agent_fanout import SERVER_MARKER
from infra.compute.access.agent_store import AGENT_PREFIX
from infra.compute.access.bootstrap import NodeReport
from infra.compute.access.hostkeys import generate_host_key
from infra.compute.access.ssh.connection import close_connections
from infra.compute.providers.aws.provider import AwsProvider
from infra.compute.providers.base import Cluster, Node
from infra.compute.providers.cloud import HOST_KEYS, boot_script
from infra.storage import open_store

PREFIX, PRIVATE = "127.81.0.", "127.82.0."  # nobody else's stand-ins use these
NODES = 3
WORKDIR = "/mnt/trainpipe/trainpipe"  # each stand-in's own /mnt
LOGGERS = ("infra.compute.access.agent_env", "infra.compute.access.agent_fanout")


@dataclass
class Stand:
    machines: Machines
    provider: AwsProvider
    cluster: Cluster
    bundle_bytes: int

    def home(self, rank: int) -> Path:
        return self.machines.nodes[f"{PREFIX}{rank + 1}"].root / "home"

    def bootstrap(self) -> dict[str, NodeReport]:
        self.provider.bootstrap_nodes(self.cluster)
        return self.provider.last_reports


@pytest.fixture(scope="module")
def stand(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stand]:
    require_sshd()
    root = tmp_path_factory.mktemp("agent-fanout")
    host_key = generate_host_key()
    instances = [Instance(f"{PREFIX}{rank + 1}", f"i-fanout-{rank}", "zone-a", boot_script(host_key, ""),
                          f"{PRIVATE}{rank + 1}") for rank in range(NODES)]
    nodes = tuple(Node(name=f"tp-fanout-node-{rank}", rank=rank, address=i.address, cluster_address=i.private_address,
                       workdir=WORKDIR, data_dir=f"{WORKDIR}/data", ckpt_dir=f"{WORKDIR}/ckpt",
                       python=f"{WORKDIR}/agent-env/bin/python", node_python="python3")
                  for rank, i in enumerate(instances))
    cluster = Cluster(name="tp-fanout", provider="aws", run_id="run-fanout", nodes=nodes, created_at=0.0,
                      owner={HOST_KEYS: {node.name: host_key.fingerprint for node in nodes}})
    with machines(root, PREFIX, lambda: instances, lambda node: "") as stand_ins, pytest.MonkeyPatch.context() as env:
        env.setenv("TRAINPIPE_SSH_KEY_FILE", str(stand_ins.client_key))
        env.setenv("TRAINPIPE_SSH_USER", "root")
        provider = AwsProvider(bootstrap=True)
        provider.agent_dir = DEFAULT_AGENT_DIR  # under each node's own HOME: a dir per node, not the tests' shared one
        head = provider._reached(cluster, nodes[0])
        bundle = node_bundle(head, "python3", provider.agent_dir).bundle
        try:
            yield Stand(stand_ins, provider, cluster, sum(bundle.size(name) for name in bundle.files))
        finally:
            close_connections()


def served_urls(caplog: pytest.LogCaptureFixture) -> list[str]:
    return re.findall(r"serving the agent's wheels to its peers at (\S+)", caplog.text)


def assert_no_server_left() -> None:
    left = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and SERVER_MARKER.encode() in (entry / "cmdline").read_bytes():
                left.append(entry.name)
        except OSError:
            continue  # ended while listed
    assert left == [], f"the head's file server outlived the bootstrap: pids {left}"


def assert_agent_runs(stand: Stand, rank: int, report: NodeReport) -> None:
    """The node's env imports the agent, from its own agent dir (PYTHONPATH, the test's worktree, left out)."""
    node = stand.cluster.nodes[rank]
    runner = stand.provider.runner(stand.cluster, node)
    result = runner.run(["env", "-u", "PYTHONPATH", report.agent_python, "-c",
                         "import os, infra, infra.node.__main__; print(os.path.realpath(infra.__file__))"],
                        timeout=120, check=False)
    assert result.returncode == 0, result.output
    assert Path(result.output.strip().splitlines()[-1]).resolve().is_relative_to(stand.home(rank).resolve())


def figures(reports: dict[str, NodeReport]) -> str:
    return "; ".join(f"{name}: {r.agent_copied_bytes} B from the orchestrator, {r.agent_peer_bytes} B from the head, "
                     f"{r.agent_store_bytes} B from the store, {r.agent_seconds:.1f}s" for name, r in reports.items())


def test_the_bundle_leaves_the_orchestrator_once_and_the_others_fetch_it_from_the_head(
        stand: Stand, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        reports = stand.bootstrap()
    print("first bootstrap:", figures(reports))
    head, *others = (reports[node.name] for node in stand.cluster.nodes)
    assert head.agent_copied_bytes == stand.bundle_bytes and head.agent_peer_bytes == 0
    for report in others:
        assert (report.agent_copied_bytes, report.agent_peer_bytes) == (0, stand.bundle_bytes), report.node
    [url] = served_urls(caplog)
    assert url.startswith(f"http://{stand.cluster.head.cluster_address}:"), "bound to the head's cluster address"
    for rank, node in enumerate(stand.cluster.nodes):
        assert reports[node.name].agent_installed, node.name
        assert_agent_runs(stand, rank, reports[node.name])
    assert stand.provider.last_reports == reports
    assert_no_server_left()


def test_a_second_bootstrap_copies_and_fetches_nothing(stand: Stand, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        reports = stand.bootstrap()
    print("second bootstrap:", figures(reports))
    for report in reports.values():
        assert (report.agent_installed, report.agent_copied_bytes, report.agent_peer_bytes) == (False, 0, 0)
    assert served_urls(caplog) == [], "a server started though no node lacked a file"
    assert_no_server_left()


def test_a_head_serving_a_wrong_file_sends_its_peers_to_the_orchestrator(
        stand: Stand, caplog: pytest.LogCaptureFixture) -> None:
    for rank in range(1, NODES):  # fresh peers: their agent dirs gone
        shutil.rmtree(stand.home(rank) / ".trainpipe")
    [bundle_dir] = (stand.home(0) / ".trainpipe/agent/bundles").iterdir()
    wheels = sorted(bundle_dir.glob("*.whl"))
    damaged = wheels[len(wheels) // 2]  # some files before it come from the head, the rest from here
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size: only the sha256 tells
    damaged.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO):
        reports = stand.bootstrap()
    print("head with a damaged wheel:", figures(reports))
    head, *others = (reports[node.name] for node in stand.cluster.nodes)
    assert (head.agent_copied_bytes, head.agent_peer_bytes) == (0, 0), "the head had every file by its size"
    fallbacks = [r.getMessage() for r in caplog.records if "fetching the agent's wheels from" in r.getMessage()]
    assert len(fallbacks) == NODES - 1, fallbacks
    for report in others:
        assert report.agent_installed
        assert 0 < report.agent_copied_bytes < stand.bundle_bytes, "only what the head could not give came from here"
        assert report.agent_peer_bytes > 0 and report.agent_copied_bytes + report.agent_peer_bytes == stand.bundle_bytes
        [said] = [m for m in fallbacks if m.startswith(f"{report.node}:")]
        assert f"{damaged.name}: sha256" in said and "copying what is missing from here instead" in said
    for rank in range(1, NODES):
        assert_agent_runs(stand, rank, reports[stand.cluster.nodes[rank].name])
        peer_copy = next((stand.home(rank) / ".trainpipe/agent/bundles").iterdir()) / damaged.name
        assert peer_copy.read_bytes() != bytes(data), "the damaged bytes were kept"
    assert_no_server_left()
    assert not [p for p in os.listdir(bundle_dir) if p.endswith(".part")]


def fresh_nodes(stand: Stand) -> None:
    """Every node without its agent dir, as a new cluster's machines are."""
    for rank in range(NODES):
        shutil.rmtree(stand.home(rank) / ".trainpipe", ignore_errors=True)


def test_the_head_fetches_the_wheels_from_the_run_store_prefix_once_and_serves_its_peers(
        stand: Stand, s3_url: str, caplog: pytest.LogCaptureFixture) -> None:
    prefix = f"{s3_url}/run-fanout/{AGENT_PREFIX}"
    store = open_store(prefix)
    stand.provider.with_agent_store(prefix)
    try:
        fresh_nodes(stand)
        with caplog.at_level(logging.INFO):
            reports = stand.bootstrap()
        print("from the store:", figures(reports))
        head, *others = (reports[node.name] for node in stand.cluster.nodes)
        assert (head.agent_copied_bytes, head.agent_store_bytes, head.agent_peer_bytes) == (0, stand.bundle_bytes, 0)
        for report in others:
            assert (report.agent_copied_bytes, report.agent_store_bytes, report.agent_peer_bytes) == (
                0, 0, stand.bundle_bytes), report.node
        bundle = node_bundle(stand.provider.runner(stand.cluster, stand.cluster.head), "python3",
                             stand.provider.agent_dir).bundle
        stored = {info.key: info for info in store.list()}
        assert set(stored) == {f"{sha}/{name}" for name, sha in bundle.hashes.items()}, "content-keyed, each once"
        for rank, node in enumerate(stand.cluster.nodes):
            assert_agent_runs(stand, rank, reports[node.name])
        assert "X-Amz-Signature" not in caplog.text, "a presigned URL (a credential) reached the log"

        fresh_nodes(stand)  # a second cluster of the run: the store has every file, nothing is sent again
        with caplog.at_level(logging.INFO):
            again = stand.bootstrap()
        assert again[stand.cluster.head.name].agent_store_bytes == stand.bundle_bytes
        assert {info.key: info.mtime for info in store.list()} == {key: info.mtime for key, info in stored.items()}
    finally:
        stand.provider.with_agent_store(None)
    assert_no_server_left()


def test_a_store_that_cannot_presign_leaves_the_wheels_copied_from_here_said_once(
        stand: Stand, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stand.provider.with_agent_store(f"file://{tmp_path}/store/run-fanout/{AGENT_PREFIX}")
    try:
        fresh_nodes(stand)
        with caplog.at_level(logging.INFO):
            reports = stand.bootstrap()
    finally:
        stand.provider.with_agent_store(None)
    head, *others = (reports[node.name] for node in stand.cluster.nodes)
    assert (head.agent_copied_bytes, head.agent_store_bytes) == (stand.bundle_bytes, 0)
    assert all((r.agent_peer_bytes, r.agent_store_bytes) == (stand.bundle_bytes, 0) for r in others)
    said = [r.getMessage() for r in caplog.records if "store gives no presigned URLs" in r.getMessage()]
    assert len(said) == 1, said
    assert not (tmp_path / "store").exists(), "files were put where no node can fetch them"
