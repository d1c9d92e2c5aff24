"""The job's code on every node: packed and put beside the run's checkpoints, fetched and unpacked by each node,
then the job's setup run once per node."""

from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger, task

from infra.cancel import Cancelled
from infra.compute.access.agent import NodeAgent
from infra.compute.access.remote import CANCEL_GRACE_S, RemoteError, wait_cancellable
from infra.compute.providers import Cluster, Node, runner_for
from infra.job.environment import training_environment
from infra.job.plan import Plan
from infra.job.spec import JobSpec
from infra.node.events import NodeEvent
from infra.node.fanout import SHARE_DIR
from infra.node.protocol import CodeRequest, EnvironmentKind, ExecRequest, PeerExchange, PullRequest
from infra.storage import open_store
from infra.workload.code import pack
from infra.workload.plan import code_archive_url
from tasks.node_output import last_event, node_line_sink
from tasks.policy import NO_RETRIES, TRANSIENT_RETRIES
from tasks.secrets import job_secrets
from tasks.train import TrainLaunch, failure_tail, node_context, workload_env, workload_env_names
from tasks.verify import probe_training_env

SETUP_STAMP = "setup.done"  # in the node's workdir: this setup already ran on this node
PULL_TIMEOUT_S = 3600.0  # an NGC image is ~10 GB


class SetupError(RuntimeError):
    """The job's setup failed on a node: not retried, the run ends with the command's last output."""


@dataclass(frozen=True)
class NodeReady:
    node: str
    code_sha256: str | None
    setup_s: float
    setup_skipped: bool
    image_digest: str | None = None  # training.image's digest on this node (IMAGE_PULLED)
    pull_s: float = 0.0
    environment: dict[str, str] | None = None  # a pulled image's check (tasks.verify.probe_training_env)


@task(name="publish-code", **TRANSIENT_RETRIES)
def publish_code(job: JobSpec, plan: Plan) -> str | None:
    """Where the nodes fetch the code from: a local dir is packed (the same bytes as at plan) and put beside the
    run's checkpoints once; an archive URL is used as it is."""
    code = job.training.code
    if code is None or not plan.workload.is_local_dir:
        return code
    with tempfile.TemporaryDirectory(prefix="trainpipe-code-") as scratch:
        packed = pack(Path(code), Path(scratch))
        if packed.sha256 != plan.workload.code_sha256:
            raise RuntimeError(f"training.code {code} changed after plan (sha256 {packed.sha256[:12]}…, planned "
                               f"{plan.workload.code_sha256}): run again")
        url = code_archive_url(plan.checkpoint_url, packed.sha256)
        folder, name = url.rsplit("/", 1)
        store = open_store(folder)
        if store.head(name) is None:
            store.put_file(packed.archive, name)
    get_run_logger().info("code: %s (%d files, sha256 %s)", url, packed.files, packed.sha256[:12])
    return url


def _setup_script(commands: tuple[str, ...]) -> str:
    # Run in the training environment: on a host, its interpreter's bin dir is first on PATH already (trainenv), so
    # `pip install` and `python` in setup mean the one that trains.
    return "set -e\n" + "\n".join(commands) + "\n"


class PullError(RuntimeError):
    """training.image could not be pulled on a node: one line naming the image and the node."""


def pull_image(job: JobSpec, cluster: Cluster, node: Node) -> tuple[str | None, float]:
    """training.image pulled on the node (a container environment only): its digest and the seconds it took."""
    environment = training_environment(job, cluster, node)
    if environment.kind is not EnvironmentKind.CONTAINER:
        return None, 0.0  # no image, or Slurm's containers, which fetch it as the step starts
    result = NodeAgent(runner_for(cluster, node), node.python).run(
        PullRequest(training_env=environment, node=node.name, timeout_s=PULL_TIMEOUT_S), timeout=PULL_TIMEOUT_S + 60,
        check=False, on_line=node_line_sink(get_run_logger(), f"{node.name} pull"))
    if result.returncode != 0:
        lines = [line for line in result.output.splitlines() if line.strip()]
        raise PullError(lines[-1] if lines else f"{node.name}: pulling {job.training.image} failed "
                        f"(exit {result.returncode})")
    pulled = last_event(result.output, NodeEvent.IMAGE_PULLED)
    get_run_logger().info("%s: image %s: %s (%.1fs%s)", node.name, pulled["image"], pulled["digest"],
                          pulled["seconds"], ", present on the node, not pulled" if pulled["local"] else "")
    return str(pulled["digest"]), float(pulled["seconds"])


@task(name="prepare-node", **NO_RETRIES)
def prepare_node(job: JobSpec, cluster: Cluster, node: Node, code_url: str | None, code_sha256: str | None,
                 launch: TrainLaunch, peers: list[str] | None = None, peer_env: dict[str, str] | None = None
                 ) -> NodeReady:
    """Fetch the code (when the job has some) and run the setup, once per node; not retried: a setup that fails
    would fail again.

    peers (fan-out, tasks/fanout.py): every node's peer server URL by rank, peer_env their credentials: the store
    serves the archive once per cluster, the nodes take it from its owner (an archive URL without a known sha256 is
    read by every node from the store: a peer's copy could not be checked)."""
    logger = get_run_logger()
    runner = runner_for(cluster, node)
    sink = node_line_sink(logger, f"{node.name} setup")
    digest, pull_s = pull_image(job, cluster, node)
    # A pulled image is checked now (verify did not pay for the pull): its python imports torch.
    found = probe_training_env(job, cluster, node) if digest is not None else None
    sha256 = None
    if code_url is not None:
        exchanging = bool(peers and code_sha256)
        request = CodeRequest(url=code_url, dest=node.code_dir, sha256=code_sha256 or None,
                              rank=node.rank if exchanging else 0,
                              peers=PeerExchange(urls=tuple(peers or ()), share_dir=node.path(SHARE_DIR))
                              if exchanging else None)
        # The job's secrets: a store credential given as one reaches the fetch.
        result = NodeAgent(runner, node.python, job_secrets(job)).run(
            request, env=peer_env if exchanging else None, timeout=3600, on_line=sink)
        sha256 = last_event(result.output, NodeEvent.CODE)["sha256"]
    setup = job.training.setup
    if not setup:
        return NodeReady(node.name, sha256, 0.0, setup_skipped=False, image_digest=digest, pull_s=pull_s,
                         environment=found)
    # Another image (or interpreter) is another environment: the setup runs again in it.
    environment = training_environment(job, cluster, node)
    stamp = hashlib.sha256(f"{sha256}\n{digest or environment.label}\n{chr(10).join(setup)}".encode()).hexdigest()
    if (runner.read_text(node.path(SETUP_STAMP)) or "").strip() == stamp:
        logger.info("%s: setup already ran on this node", node.name)
        return NodeReady(node.name, sha256, 0.0, setup_skipped=True, image_digest=digest, pull_s=pull_s,
                         environment=found)
    context = node_context(job, cluster, node, launch)
    started = time.monotonic()
    request = ExecRequest(argv=("bash", "-c", _setup_script(setup)), training_env=environment,
                          cwd=node.code_dir if code_url is not None else node.workdir,
                          env_names=workload_env_names(job, context))
    process = NodeAgent(runner, node.python, workload_env(job, context)).start(
        request, on_line=sink, log_path=node.path("logs", "setup.log"))
    try:
        code = wait_cancellable(process, job.training.timeout_s)
    except Cancelled:
        process.terminate(grace_s=CANCEL_GRACE_S)  # the run is being torn down: its setup goes first
        raise
    except TimeoutError:
        process.terminate()
        raise SetupError(f"{node.name}: training.setup still running after training.timeout_s") from None
    if code != 0:
        raise SetupError(f"{node.name}: training.setup exited {code}; its last output:\n{failure_tail(process)}")
    runner.write_text(node.path(SETUP_STAMP), stamp + "\n")
    seconds = time.monotonic() - started
    logger.info("%s: setup took %.1fs", node.name, seconds)
    return NodeReady(node.name, sha256, round(seconds, 3), setup_skipped=False, image_digest=digest, pull_s=pull_s,
                         environment=found)


def agreed_code_hash(ready: list[NodeReady]) -> str | None:
    """Every node must run the same code: an archive that changed while nodes fetched it is an error."""
    hashes = {r.code_sha256 for r in ready}
    if len(hashes) > 1:
        raise RemoteError(f"nodes fetched different code ({', '.join(sorted(str(h)[:12] for h in hashes))}): the "
                          "code archive changed while the run started: run again")
    return hashes.pop() if hashes else None


def agreed_image_digest(ready: list[NodeReady]) -> str | None:
    """Every node must train in the same image: a tag that moved while the nodes pulled it is an error."""
    digests = {r.image_digest for r in ready if r.image_digest is not None}
    if len(digests) > 1:
        raise PullError(f"nodes pulled different images ({', '.join(sorted(digests))}): the tag moved while the run "
                        "started: pin training.image by digest (image@sha256:...) or run again")
    return digests.pop() if digests else None
