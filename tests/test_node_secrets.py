"""A store credential given only as the job's `training.secrets` reaches every node command that reads the store.

One ssh node (a real OpenSSH server on loopback) whose sessions have no AWS variable at all (sshd passes none of its
own environment on), an S3 store (rclone serve s3) whose endpoint and keys the job names as secrets: each task that
starts a store command on a node (stage, restore, evaluate's restore, the code fetch, verify-ckpt, the syncer)
resolves the job's secrets and sends them in the command's environment, and the command reads the store with them;
the same stage without the key pair fails with the store's missing-credentials error, so the node really has none of
its own.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from jobs import job_config
from servers import S3Server
from sshd import ssh_servers
from test_checkpoints import commit_step, make_step, node_dirs
from test_dataset_stage import freeze, put_dataset, tree

import tasks.checkpoint
import tasks.evaluate
import tasks.stage
import tasks.train
import tasks.workload
from infra.checkpoints.store import CheckpointStore
from infra.compute.access.remote import RemoteError
from infra.compute.access.ssh.connection import close_connections
from infra.compute.providers import Cluster, Node, agent_for, runner_for
from infra.compute.providers.ssh.provider import SshProvider
from infra.job.secrets import SecretRef
from infra.job.spec import JobSpec, parse_job
from infra.node.events import NodeEvent, parse
from infra.node.sync import stop_request
from infra.storage import open_store
from infra.workload.code import pack
from tasks.train import TrainLaunch

STEP = 100
SYNCED = 200  # the step the syncer test saves on the node
# Where the orchestrator keeps each value (its own environment); the job names these, the node gets the values.
STORE_SETTINGS = {"AWS_ENDPOINT_URL": "TP_NODE_TEST_S3_ENDPOINT", "AWS_DEFAULT_REGION": "TP_NODE_TEST_S3_REGION"}
STORE_KEYS = {"AWS_ACCESS_KEY_ID": "TP_NODE_TEST_S3_KEY", "AWS_SECRET_ACCESS_KEY": "TP_NODE_TEST_S3_SECRET"}


@dataclass(frozen=True)
class Setup:
    """The launched one-node ssh cluster and what is in its store."""

    cluster: Cluster
    job: JobSpec  # its training.secrets name the store's endpoint, region and key pair
    snapshot_url: str  # the dataset's snapshot
    dataset: dict[str, bytes]
    checkpoint_url: str  # a committed step STEP
    code_url: str  # a packed code dir
    code_sha256: str
    tmp: Path

    @property
    def node(self) -> Node:
        return self.cluster.nodes[0]

    @property
    def secrets(self) -> dict[str, SecretRef]:
        return dict(self.job.training.secrets)

    def launch(self) -> TrainLaunch:
        return TrainLaunch(self.checkpoint_url, self.snapshot_url, rendezvous_port=0, config_hash="c0ffee",
                           attempt_id="0-secrets")


def _quiet_tasks(patch: pytest.MonkeyPatch) -> None:
    """The tasks run outside a flow (their .fn): a plain logger, and no Prefect artifacts (there is no server)."""
    logger = logging.getLogger("test.node_secrets")
    for module in (tasks.stage, tasks.evaluate, tasks.workload, tasks.checkpoint):
        patch.setattr(module, "get_run_logger", lambda: logger)
    patch.setattr(tasks.stage, "_progress_artifact", lambda node, what: lambda event: None)
    patch.setattr(tasks.evaluate, "create_table_artifact", lambda *args, **kwargs: None)


def _job(tmp: Path, bucket: str, host: dict[str, Any], eval_script: Path) -> JobSpec:
    config = job_config(tmp, f"{bucket}/dataset")
    config["cluster"] = {"provider": "ssh", "nodes": 1, "procs_per_node": 1, "verify": {"bench": "off"},
                         "ssh": {"hosts": [host]}}
    config["checkpoints"]["url"] = f"{bucket}/ckpt"
    config["training"]["secrets"] = {name: {"env": ref} for name, ref in {**STORE_SETTINGS, **STORE_KEYS}.items()}
    config["evaluate"] = {"command": [str(eval_script), "{checkpoint}"], "timeout_s": 120}
    return parse_job(config)


def _eval_script(tmp: Path) -> Path:
    """An evaluation that checks the restored checkpoint is there and reports its file count."""
    script = tmp / "eval.py"
    script.write_text("import json, os, sys\n"
                      "files = sum(len(names) for _, _, names in os.walk(sys.argv[1]))\n"
                      "assert files, sys.argv[1]\n"
                      "json.dump({'files': files}, open(os.environ['TRAINPIPE_EVAL_FILE'], 'w'))\n")
    return script


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("node-secrets")
    # The node runs this checkout's node agent, whatever trainpipe its Python has installed.
    with ssh_servers(tmp / "sshd", 1, session_env={"PYTHONPATH": str(REPO)}) as (key, [server]), \
            pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINPIPE_HOME", str(tmp / "home"))
        for name, value in s3_server.env().items():  # the orchestrator's own access, to fill the store
            patch.setenv(name, value)
        env = s3_server.env()
        for name, ref in {**STORE_SETTINGS, **STORE_KEYS}.items():
            patch.setenv(ref, env[name])
        _quiet_tasks(patch)
        bucket = s3_server.make_bucket("node-secrets")
        dataset = {"a/x.bin": b"x" * 5000, "b.bin": b"y" * 700}
        store = open_store(f"{bucket}/dataset")
        put_dataset(store, tmp / "source", dataset)
        checkpoints = CheckpointStore(open_store(f"{bucket}/ckpt/run-1"))
        commit_step(checkpoints, node_dirs(tmp / "writers"), STEP)
        (tmp / "code").mkdir()
        (tmp / "code" / "train.py").write_text("print('hello')\n")
        packed = pack(tmp / "code", tmp / "packed")
        open_store(f"{bucket}/code").put_file(packed.archive, packed.archive.name)
        host = {"host": server.host, "port": server.port, "user": "root", "key_file": str(key),
                "workdir": str(tmp / "nvme"), "python": sys.executable, "host_key": server.fingerprint}
        (tmp / "nvme").mkdir()
        job = _job(tmp, bucket, host, _eval_script(tmp))
        provider = SshProvider()
        cluster = provider.launch("tp-node-secrets", job.cluster, "run-1")
        try:
            yield Setup(cluster, job, freeze(store, f"{bucket}/ckpt/run-1"), dataset, checkpoints.store.url,
                        f"{bucket}/code/{packed.archive.name}", packed.sha256, tmp)
        finally:
            provider.terminate(cluster.name)
            close_connections()


def _stage(setup: Setup) -> None:
    staged = tasks.stage.stage_node.fn(setup.cluster, setup.node, setup.snapshot_url, "replicate", {},
                                       secrets=setup.secrets)
    assert staged.dataset is not None and staged.dataset.files == len(setup.dataset)
    assert tree(Path(setup.node.data_dir)) == setup.dataset


def _restore(setup: Setup) -> None:
    restored = tasks.stage.restore_checkpoint.fn(setup.cluster, setup.node, setup.checkpoint_url, "auto",
                                                 secrets=setup.secrets)
    assert restored.step == STEP and Path(restored.path).is_dir()


def _evaluate_restore(setup: Setup) -> None:
    evaluation = tasks.evaluate.evaluate_checkpoint.fn(setup.job, setup.cluster, setup.launch(), STEP)
    assert evaluation.step == STEP and evaluation.metrics["files"] > 0


def _code(setup: Setup) -> None:
    ready = tasks.workload.prepare_node.fn(setup.job, setup.cluster, setup.node, setup.code_url, setup.code_sha256,
                                           setup.launch())
    assert ready.code_sha256 == setup.code_sha256
    assert (Path(setup.node.code_dir) / "train.py").read_text() == "print('hello')\n"


def _verify_ckpt(setup: Setup) -> None:
    verified = tasks.checkpoint.verify_committed_checkpoint.fn(setup.cluster, setup.checkpoint_url, "auto",
                                                               secrets=setup.secrets)
    assert verified.step == STEP


def _sync(setup: Setup) -> None:
    """The syncer as the train task starts it (its request and its environment): a step saved on the node is
    uploaded and committed in the store with the job's secrets alone."""
    node, job = setup.node, setup.job
    launch = dataclasses.replace(setup.launch(), checkpoint_url=f"{setup.checkpoint_url.rsplit('/', 1)[0]}/run-sync")
    request = tasks.train.syncer_request(job, setup.cluster, node, launch)
    make_step(Path(node.ckpt_dir), SYNCED, 0, world_size=1)
    Path(node.sync_dir).mkdir(parents=True, exist_ok=True)
    committed = threading.Event()

    def on_line(line: str) -> None:
        event = parse(line)
        if event is not None and event.kind is NodeEvent.COMMITTED and event.get("step") == SYNCED:
            committed.set()

    syncer = agent_for(setup.cluster, node, tasks.train.syncer_env(job)).start(
        request, on_line=on_line, log_path=node.path("logs", "sync-secrets.log"))
    try:
        assert committed.wait(120), f"no commit of step {SYNCED}: {syncer.tail(20)}"
    finally:
        Path(request.stop_file).write_text(stop_request())
        code = syncer.wait(120)
    assert code == 0, syncer.tail(20)
    assert [m.step for m in CheckpointStore(open_store(launch.checkpoint_url)).committed()] == [SYNCED]


# Every node command that reads or writes the store, driven through the task (or, for the syncer, the request and
# environment) that starts it.
STORE_COMMANDS: dict[str, Callable[[Setup], None]] = {
    "stage": _stage,
    "restore": _restore,
    "evaluate-restore": _evaluate_restore,
    "code": _code,
    "verify-ckpt": _verify_ckpt,
    "sync": _sync,
}


def test_the_node_has_no_store_credentials_of_its_own(setup: Setup) -> None:
    """What the tests below prove rests on this: nothing but the job's secrets gives the node its access."""
    node_env = runner_for(setup.cluster, setup.node).run(["env"], timeout=60).output
    assert [line for line in node_env.splitlines() if line.startswith("AWS_")] == []
    assert f"PYTHONPATH={REPO}" in node_env.splitlines()

    settings_only = {name: ref for name, ref in setup.secrets.items() if name in STORE_SETTINGS}
    with pytest.raises(RemoteError, match="no AWS credentials"):
        tasks.stage.stage_node.fn(setup.cluster, setup.node, setup.snapshot_url, "replicate", {},
                                  secrets=settings_only)


@pytest.mark.parametrize("command", list(STORE_COMMANDS))
def test_a_store_credential_given_only_as_a_secret_reaches_the_command(setup: Setup, command: str) -> None:
    STORE_COMMANDS[command](setup)
