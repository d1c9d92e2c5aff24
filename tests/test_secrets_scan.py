"""No secret in any output: the whole pipeline (`trainpipe run`, local nodes, dataset and checkpoints in the real S3
server of the fixtures) runs with AWS keys and a session token (the S3 server's own key pair, which the run uses), a
GCP access token and a service account key file, and an SSH private key (a key file, and its text in a variable, as
CI systems pass them) in its environment. Then every place the run wrote or published is searched for each secret:
its output, every file of the workspace (summary.json), every node log (copied while the nodes lived, as teardown
removes them), every object of the store, the Prefect home, the flow run's parameters, artifacts and logs on the
Prefect server, and the command line of every process that ran meanwhile (the S3 server's included: its key pair
travels in its environment). A PEM counts as found if any line of its body is.

SSH nodes, where a command's environment crosses to another machine, have their own scan in the ssh provider's
pipeline test (tests/test_ssh_provider.py): a job's training.secrets against every command line of the sshd host and
the flow run's parameters; tests/test_ssh.py checks the runner alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import threading
from pathlib import Path

import psutil
import pytest
from conftest import REPO, TRAINPIPE
from jobs import job_config, write_config
from servers import S3Server
from sshd import keygen

from infra.compute.providers.local import CLUSTER_TAG
from infra.dataset.synth import synthesize
from infra.storage import open_store

RUN_ID = "secrets-run"


def pem_lines(pem: str) -> list[str]:
    return [line for line in pem.splitlines() if len(line) >= 16 and not line.startswith("-----")]


def gcp_key_file(path: Path) -> tuple[Path, str]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    path.write_text(json.dumps({"type": "service_account", "project_id": "trainpipe-secrets", "private_key": pem,
                                "private_key_id": secrets.token_hex(20), "client_email": "x@trainpipe-secrets.iam",
                                "token_uri": "http://127.0.0.1:9/token"}))
    return path, pem


class Sampler:
    """The command lines of the run's processes (the orchestrator and all it started, the nodes' processes, the S3
    server), sampled while the run goes on; and the nodes' logs, copied while they exist. Other test sessions on this
    machine are not the run's."""

    def __init__(self, orchestrator: psutil.Process, workspace: Path, s3_root: Path, copies: Path) -> None:
        self.orchestrator, self.workspace, self.s3_root = orchestrator, workspace, s3_root
        self.clusters, self.copies = workspace / "clusters", copies
        self.command_lines: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _ours(self) -> list[psutil.Process]:
        found = []
        with contextlib.suppress(psutil.Error):
            found += [self.orchestrator, *self.orchestrator.children(recursive=True)]
        for process in psutil.process_iter():
            try:
                cmdline = " ".join(process.cmdline())
                if _tagged(process, self.workspace) or ("rclone" in cmdline and str(self.s3_root) in cmdline):
                    found.append(process)
            except psutil.Error:
                continue
        return found

    def _sample(self) -> None:
        while not self._stop.wait(0.3):
            for process in self._ours():
                try:
                    self.command_lines.add("\0".join(process.cmdline()))
                except psutil.Error:
                    continue
            for log in self.clusters.glob("*/node-*/logs/*"):
                target = self.copies / log.relative_to(self.clusters)
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    shutil.copyfile(log, target)
                except OSError:
                    continue  # removed between the glob and the copy: teardown

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def prefect_places(run_id: str) -> list[tuple[str, str]]:
    """(place, text) of the flow run on the Prefect server: its parameters, each artifact, each log record."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_flow_runs(limit=200) if r.parameters.get("run_id") == run_id]
        assert len(runs) == 1, f"flow runs of {run_id}: {len(runs)}"
        run = runs[0]
        places = [(f"flow run {run.name} parameters", json.dumps(run.parameters, default=str))]
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
        places += [(f"artifact {a.key or a.id}", json.dumps(a.data, default=str) + str(a.description)) for a in
                   artifacts]
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])), limit=200)
        offset = len(logs)
        while True:  # the server pages logs
            more = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])),
                                    limit=200, offset=offset)
            if not more:
                break
            logs += more
            offset += len(more)
        places += [(f"server log {index}", log.message) for index, log in enumerate(logs)]
        assert artifacts and logs, "the run published nothing to search"
    return places


def test_no_secret_in_any_output(prefect_server: None, workspace: Path, tmp_path: Path, s3_server: S3Server,
                                 s3_url: str) -> None:
    from prefect.settings import PREFECT_API_URL

    ssh_key = keygen(tmp_path / "deploy_ed25519", "deploy")
    gcp_key, gcp_pem = gcp_key_file(tmp_path / "gcp-sa.json")
    gcp_token = "ya29." + secrets.token_urlsafe(48)
    session_token = "IQoJb3JpZ2luX2VjE" + secrets.token_urlsafe(60)
    env = {**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_HOME": str(tmp_path / "prefect-home"),
           "PREFECT_API_URL": str(PREFECT_API_URL.value()), **s3_server.env(), "AWS_SESSION_TOKEN": session_token,
           "GOOGLE_APPLICATION_CREDENTIALS": str(gcp_key), "CLOUDSDK_AUTH_ACCESS_TOKEN": gcp_token,
           "GOOGLE_OAUTH_ACCESS_TOKEN": gcp_token, "TRAINPIPE_SSH_KEY_FILE": str(ssh_key),
           "SSH_PRIVATE_KEY": ssh_key.read_text()}
    needles = {"AWS access key id": s3_server.access_key, "AWS secret key (the S3 server's)": s3_server.secret_key,
               "AWS session token": session_token, "GCP access token": gcp_token,
               **{f"GCP key line {i}": line for i, line in enumerate(pem_lines(gcp_pem))},
               **{f"SSH key line {i}": line for i, line in enumerate(pem_lines(ssh_key.read_text()))}}

    dataset = f"{s3_url}/dataset"
    synthesize(open_store(dataset), 200_000, vocab_size=256, shard_tokens=100_000, seed=3)
    config = job_config(tmp_path, dataset, steps=40, ckpt_every=20)
    config["checkpoints"]["url"] = f"{s3_url}/ckpt"
    orchestrator = subprocess.Popen([TRAINPIPE, "run", str(write_config(tmp_path / "job.yaml", config)),
                                     "--run-id", RUN_ID], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
    sampler = Sampler(psutil.Process(orchestrator.pid), workspace, s3_server.root, tmp_path / "node-logs")
    try:
        stdout, stderr = orchestrator.communicate(timeout=600)
    finally:
        sampler.stop()
    assert orchestrator.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert not [p for p in psutil.process_iter() if _tagged(p, workspace)], "node processes outlived the run"

    places: list[tuple[str, str]] = [("orchestrator stdout", stdout), ("orchestrator stderr", stderr)]
    bucket = s3_server.root / s3_url.removeprefix("s3://")
    for root in (workspace, tmp_path / "node-logs", tmp_path / "prefect-home", bucket):
        places += [(str(path), path.read_bytes().decode(errors="replace")) for path in sorted(root.rglob("*"))
                   if path.is_file()]
    places += prefect_places(RUN_ID)
    places += [(f"command line {i}", line) for i, line in enumerate(sorted(sampler.command_lines))]

    node_logs = [p for p, _ in places if "/node-logs/" in p]
    assert any(p.endswith("train.log") for p in node_logs) and any(p.endswith("sync.log") for p in node_logs)
    assert any(p.endswith("summary.json") for p, _ in places)
    assert any("rclone" in text and "serve" in text for p, text in places if p.startswith("command line"))
    hits = [(place, name) for place, text in places for name, needle in needles.items() if needle in text]
    print(f"\nsecrets scan: {len(needles)} secrets × {len(places)} places searched ({len(node_logs)} node logs, "
          f"{sum(p.startswith('command line') for p, _ in places)} command lines, "
          f"{sum(p.startswith(('artifact', 'server log', 'flow run')) for p, _ in places)} Prefect records): "
          f"{len(hits)} hits")
    assert hits == [], hits


def _tagged(process: psutil.Process, workspace: Path) -> bool:
    try:
        return process.environ().get(CLUSTER_TAG, "").startswith(str(workspace))
    except psutil.Error:
        return False


def test_the_s3_servers_key_pair_is_not_on_their_command_lines(s3_server: S3Server) -> None:
    """What `ps` shows every user of the machine: the servers of the tests and of NetnsStore are started alike
    (infra.compute.providers.netns.store.rclone_serve_s3)."""
    lines = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
    servers = [line for line in lines if "rclone" in line and " serve s3 " in line and str(s3_server.root) in line]
    assert servers, "the session's S3 server is not running"
    assert not [line for line in servers if re.search(re.escape(s3_server.secret_key), line)]
    assert not [line for line in servers if "--auth-key" in line]


def test_the_netns_stores_key_pair_is_in_its_environment_not_its_command_line(tmp_path: Path) -> None:
    from infra.compute.providers.netns import emulation as netns
    from infra.compute.providers.netns.store import STORE_TAG, NetnsStore

    if (why := netns.problem()) is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    with NetnsStore(tmp_path / "s3") as store:
        url = store.make_bucket("authenticated")  # the server checks the pair it got from its environment
        [server] = [p for p in psutil.process_iter() if _has(p, STORE_TAG, store.gid)
                    and "rclone" in " ".join(p.cmdline())]
        assert store.secret_key not in " ".join(server.cmdline()) and "--auth-key" not in server.cmdline()
        assert store.secret_key in server.environ()["RCLONE_AUTH_KEY"]
    assert url == "s3://authenticated"


def _has(process: psutil.Process, tag: str, value: str | None) -> bool:
    try:
        return process.environ().get(tag) == value
    except psutil.Error:
        return False
