"""The node protocol: every command the orchestrator sends a node is one request record, defined here once.

The orchestrator builds a command from a record (`NodeRequest.command_line`), and sends it through the cluster's
runner with the record itself and the command's environment (store credentials, the job's secrets, per-run peer keys)
in the environment, never on the command line: the environment travels on the runner's own channel (a local
process's environment, the SSH channel's stdin), while a command line is readable by every user of the node for as
long as it runs. On the node, `python -m infra.node COMMAND` reads the record back (`read_request`) into the same
class and hands it to the command. So both sides share one definition of every field: a field added on one side is
there on the other, and nothing is serialised by hand.

A record holds what the node needs to do its work and nothing secret; a value with a meaning of its own (a mode, a
source) is an enum or a constant of its command's module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from infra.checkpoints.formats import FORMATS
from infra.strict_model import one_of

# The variable a node command finds its request in; removed from the environment once read, so nothing the command
# starts (torchrun, the training script) inherits it.
REQUEST_ENV = "TRAINPIPE_NODE_REQUEST"
AGENT_MODULE = "infra.node"
LAUNCHER_STOP_GRACE_S = 30.0  # the launcher's SIGTERM-to-SIGKILL, when a request names none


class NodeCommand(StrEnum):
    """Every command of the node agent (`python -m infra.node COMMAND`), by its name on the command line."""

    PROBE = "probe"
    STAGE = "stage"
    RESTORE = "restore"
    CODE = "code"
    PEER_SERVE = "peer-serve"
    UNSHARE = "unshare"
    VERIFY_CKPT = "verify-ckpt"
    REJOIN = "rejoin"
    SYNC = "sync"
    WATCH = "watch"
    CHAOS = "chaos"
    NETBENCH = "netbench"
    DISKBENCH = "diskbench"
    TORCHRUN = "torchrun"
    EXEC = "exec"
    PULL = "pull"
    STACKS = "stacks"


class EnvironmentKind(StrEnum):
    """Where the user's training runs on a node (infra/node/trainenv.py builds each kind's command line)."""

    HOST = "host"  # an interpreter on the node itself: training.python, or the node's own python
    CONTAINER = "container"  # training.image under the node's engine (docker or podman)
    PYXIS = "pyxis"  # Slurm with Pyxis: srun --container-image
    OCI = "oci"  # Slurm's own OCI containers (oci.conf, runc): srun --container <bundle>


class TrainingEnvironment(BaseModel):
    """The user's environment a training command runs in (setup, torchrun and the script, evaluate): the agent never
    imports from it and installs nothing into it; the two meet only in the node's trainpipe dir (mounted at the same
    paths inside a container) and the TRAINPIPE_* environment."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: EnvironmentKind = EnvironmentKind.HOST
    python: str = "python3"  # the interpreter inside the environment (its torchrun is torch.distributed.run of it)
    image: str | None = None  # CONTAINER and PYXIS: the image reference; OCI: the bundle dir on the node
    engine: Literal["auto", "docker", "podman"] = "auto"  # CONTAINER: the node's engine (auto: docker, else podman)
    mounts: tuple[str, ...] = ()  # node dirs mounted at the same path (the node's trainpipe dir, the code dir)
    gpus: bool = False  # pass the node's GPUs (and InfiniBand devices) into the container
    name: str = "trainpipe"  # CONTAINER: the container's name prefix (node and command added), for cleanup
    # The node's trainpipe dir: the agent writes the launcher and a container's env file here (mounted, so the
    # launcher is at the same path inside). Empty: the system's temp dir (a host environment only).
    node_dir: str = ""

    @model_validator(mode="after")
    def _image_for_containers(self) -> TrainingEnvironment:
        if (self.kind is EnvironmentKind.HOST) != (self.image is None):
            raise ValueError(f"a {self.kind.value} training environment "
                             f"{'takes no' if self.kind is EnvironmentKind.HOST else 'needs an'} image")
        if self.kind is not EnvironmentKind.HOST and not any(
                self.node_dir == m or self.node_dir.startswith(m.rstrip("/") + "/") for m in self.mounts):
            raise ValueError(f"a {self.kind.value} training environment needs its node_dir {self.node_dir!r} "
                             "among its mounts (the launcher is written there)")
        return self

    @property
    def label(self) -> str:
        """How an error names it: the image, or the interpreter."""
        return f"image {self.image}" if self.image is not None else f"python {self.python}"


# What a training command's environment carries into the training environment, by name (the values come in the
# command's own environment, never in a record): besides these, a container gets nothing of the agent's.
EnvNames = tuple[str, ...]


class ProtocolError(ValueError):
    """A node command's request is missing or does not match its record: the orchestrator and the node agent are of
    different trainpipe versions, or the command was started by hand without a request."""


class NodeRequest(BaseModel):
    """One node command's request: its fields are the command's whole input."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    command: ClassVar[NodeCommand]

    def command_line(self, python: str) -> list[str]:
        """The argv that runs this request's command on a node with that Python; the request goes in the env."""
        return [python, "-m", AGENT_MODULE, self.command.value]

    def environment(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """env (credentials, secrets, peer keys) with this request added: everything the command's process gets."""
        return {**(env or {}), REQUEST_ENV: self.model_dump_json()}


class ProbeRequest(NodeRequest):
    """Can this node run the job: dirs writable, enough free disk, a free port for the rendezvous."""

    command: ClassVar[NodeCommand] = NodeCommand.PROBE
    dirs: tuple[str, ...] = ()  # dirs the job writes to
    need_bytes: int = 0  # free bytes needed on the first dir
    cache: str | None = None  # the node's dataset object cache: its bytes count as free
    budget: str | None = None  # the plan's disk budget of this node, term by term (need_bytes is its total)


# Fan-out's defaults (infra/node/fanout.py's Exchange): here, so a request needs nothing of the exchange's imports.
PEER_WAIT_S = 30.0  # how long a node waits for a file from an owner that shows no sign of life (no file, no beat)
PEER_CONNECT_GRACE_S = 15.0  # a peer's server may still be starting: refused connections are retried this long


class PeerExchange(BaseModel):
    """Fan-out (infra/node/fanout.py): the nodes fill each other through their peer servers, the store serving each
    file once per cluster; the servers' credentials come in the environment (TRAINPIPE_PEER_USER/_PASS)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    urls: tuple[str, ...]  # every node's peer server URL in rank order, this node's own included
    share_dir: str  # the dir this node's peer server serves
    wait_s: float = PEER_WAIT_S  # how long a peer may show no sign of life before what it owes is taken from the store
    connect_grace_s: float = PEER_CONNECT_GRACE_S  # how long a refused connection to a peer is retried


def _check_holders(holders: tuple[int, ...], nodes: int, what: str) -> None:
    if any(not 0 <= rank < nodes for rank in holders):
        raise ValueError(f"holders {list(holders)}: ranks must be below {what} ({nodes})")


class StageRequest(NodeRequest):
    """Mirror this node's files of the run's dataset snapshot into its data dir, and each input's snapshot whole into
    inputs_dir/<name>, verified, through the node's object cache (infra/node/stage.py)."""

    command: ClassVar[NodeCommand] = NodeCommand.STAGE
    rank: int  # this node's rank
    nodes: int  # nodes in the cluster
    workdir: str  # the node's workdir: data-files.txt goes here
    cache: str  # the node's object cache (kept across runs)
    snapshot: str | None = None  # URL of the run's dataset snapshot (None: only the inputs are staged)
    dest: str | None = None  # the node's data dir: becomes the mirror of the dataset
    inputs: dict[str, str] = {}  # input name -> its snapshot's URL, staged whole into inputs_dir/<name>
    inputs_dir: str | None = None  # where the inputs go, one folder each
    shard: Literal["replicate", "split"] = "replicate"
    run: str = "the run"  # run id, for error messages
    workers: int = 8
    progress_interval: float = 2.0  # seconds between progress events
    peers: PeerExchange | None = None
    # fan-out: the ranks that already hold the files (the survivors of a replaced node): only they fetch from the
    # store what they lack, the others take every file from them (empty: every rank fetches its share)
    holders: tuple[int, ...] = ()

    @field_validator("inputs")
    @classmethod
    def _named_inputs(cls, inputs: dict[str, str]) -> dict[str, str]:
        for name, url in inputs.items():
            if not name or not url:
                raise ValueError(f"{name!r}: {url!r}: an input needs a name and a snapshot URL")
        return inputs

    @model_validator(mode="after")
    def _consistent(self) -> StageRequest:
        if self.inputs and self.inputs_dir is None:
            raise ValueError("inputs need inputs_dir")
        if self.snapshot is not None and self.dest is None:
            raise ValueError("snapshot needs dest")
        _check_holders(self.holders, self.nodes, "nodes")
        if self.peers is not None and len(self.peers.urls) != self.nodes:
            raise ValueError(f"peers needs one URL per node ({self.nodes}), got {len(self.peers.urls)}")
        return self


class RestoreRequest(NodeRequest):
    """Download a committed checkpoint (the newest, falling back past a damaged one, or `step`) onto this node's
    disk, verified against its manifest (infra/node/restore.py)."""

    command: ClassVar[NodeCommand] = NodeCommand.RESTORE
    url: str  # the run's checkpoint root URL
    dest: str  # the node's checkpoint dir: the checkpoint lands in dest/<its name>
    step: int | None = None  # restore this committed step instead of the newest
    sync_dir: str | None = None  # the node's sync dir: the syncer learns what was restored
    format: str = "auto"  # the job's checkpoint format (infra.checkpoints.formats)
    rank: int = 0  # fan-out: this node's rank
    # afterwards dest holds only the restored checkpoint: a node that survived a preemption drops its saves newer
    # than the commit (never committed, and a syncer or script that found them would take them for this attempt's)
    prune: bool = False
    peers: PeerExchange | None = None
    holders: tuple[int, ...] = ()  # fan-out: ranks that may hold their own parts (a replace-one's survivors)
    # fan-out: this node's peer replicas (<workdir>/replica): it serves the part of a node not among holders whose
    # replica it keeps
    replica_dir: str | None = None

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        return one_of(value, FORMATS, "format")

    @model_validator(mode="after")
    def _consistent(self) -> RestoreRequest:
        urls = len(self.peers.urls) if self.peers is not None else 0
        if self.peers is not None and not 0 <= self.rank < urls:
            raise ValueError(f"rank {self.rank} is not among the {urls} peers")
        _check_holders(self.holders, urls, "the peers")
        return self


class CodeRequest(NodeRequest):
    """Fetch the job's code archive from the store (or, fanning out, from its owner's peer server), verified, and
    unpack it into dest (infra/node/code.py)."""

    command: ClassVar[NodeCommand] = NodeCommand.CODE
    url: str  # the code archive (.tar.gz) in the store
    dest: str  # the code dir to (re)create
    sha256: str | None = None  # the archive's expected sha256 (a packed local dir's content hash)
    rank: int = 0  # fan-out: this node's rank
    peers: PeerExchange | None = None

    @model_validator(mode="after")
    def _checkable(self) -> CodeRequest:
        if self.peers is not None and not self.sha256:
            raise ValueError("peers needs sha256: a peer's copy is checked against it")
        return self


class PeerServeRequest(NodeRequest):
    """Serve this node's fan-out share dir read-only to its peers (rclone serve http) until stopped; its credentials
    come in the environment (infra/node/peerserve.py)."""

    command: ClassVar[NodeCommand] = NodeCommand.PEER_SERVE
    dir: str  # the share dir to serve
    addr: str  # HOST:PORT on the cluster network; PORT 0: a free one


class UnshareRequest(NodeRequest):
    """Unlink what the node's fan-out share dir holds for the exchanges that ended (infra/node/unshare.py): each
    published piece is a hard link, which keeps the bytes on the disk after the stage cache evicts the object or the
    script deletes its checkpoint."""

    command: ClassVar[NodeCommand] = NodeCommand.UNSHARE
    dir: str  # the share dir
    keep: tuple[str, ...] = ()  # share names left in place (the code archive a replacement takes from the survivors)


class VerifyCkptRequest(NodeRequest):
    """Check a committed checkpoint in the store file by file against its manifest (infra/node/verify_ckpt.py)."""

    command: ClassVar[NodeCommand] = NodeCommand.VERIFY_CKPT
    url: str  # the run's checkpoint root URL
    step: int | None = None  # None: the latest committed step


class RejoinRequest(NodeRequest):
    """Ready a node that survived a preemption for the next attempt: clear, remove and set aside what would mislead
    it (infra/node/rejoin.py)."""

    command: ClassVar[NodeCommand] = NodeCommand.REJOIN
    clear: tuple[str, ...] = ()  # dirs to empty (kept themselves)
    remove: tuple[str, ...] = ()  # files to remove if present
    set_aside: tuple[str, ...] = ()  # files renamed to FILE.<suffix> if present
    suffix: str = "old"  # what set_aside appends to the name


# The checkpoint formats the syncer recognises (infra.checkpoints.formats.FORMATS, which a test holds this to).
CheckpointFormatName = Literal["auto", "dcp", "hf", "lightning", "torchtitan", "marker", "file"]


class SyncRequest(NodeRequest):
    """The checkpoint syncer beside training: ships this node's part of every complete checkpoint to the store (node
    rank 0 announces, commits and applies retention) until its stop file appears or it gets SIGTERM."""

    command: ClassVar[NodeCommand] = NodeCommand.SYNC
    ckpt_dir: str  # this node's local checkpoint dir (the script's)
    sync_dir: str  # where the syncer keeps its state and leases
    url: str  # the run's checkpoint root URL
    node_rank: int = Field(ge=0)
    nodes: int = Field(ge=1)  # nodes of the cluster
    procs_per_node: int = Field(1, ge=1)  # training processes per node
    attempt: str  # this attempt's id: commits take only its records
    config_hash: str  # recorded in each manifest
    keep: int = Field(ge=1)  # committed checkpoints kept in the store (the newest is never deleted)
    format: CheckpointFormatName = "auto"  # how complete checkpoints are recognised
    metrics_file: str | None = None  # the script's metrics: numbers checkpoints without a step
    poll_s: float = Field(0.5, gt=0)  # seconds between scans of ckpt_dir
    stop_file: str | None = None  # finish uploading and exit once this file exists
    lineage: str | None = None  # a file holding the JSON Lineage recorded in every manifest this syncer commits
    # The model registry's root (the job's checkpoints.url, where `model promote` keeps aliases): retention never
    # deletes a step an alias there points at. None: the parent of url.
    registry_url: str | None = None
    commit_timeout_s: float = Field(600.0, ge=0)  # on stop, how long to upload and commit what is complete
    flush_deadline_s: float = Field(20.0, ge=0)  # on stop, how long to wait for a save under way
    store_outage_s: float = Field(300.0, ge=0)  # ride out a store failing transiently this long, then exit 3
    replica_dir: str | None = None  # peer replica: where the buddy's part is kept (<workdir>/replica)
    replica_share_dir: str | None = None  # peer replica: the dir this node's peer server serves
    # peer replica: serve replica_share_dir on this cluster address while the syncer runs (credentials in
    # TRAINPIPE_PEER_USER/TRAINPIPE_PEER_PASS, in the environment)
    replica_serve: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> SyncRequest:
        if self.node_rank >= self.nodes:
            raise ValueError(f"node_rank {self.node_rank}: must be in [0, nodes={self.nodes})")
        replica = (self.replica_dir, self.replica_share_dir)
        if (any(replica) or self.replica_serve is not None) and not all(replica):
            raise ValueError("replica_dir and replica_share_dir go together (and replica_serve needs them): give "
                             "both (peer replica) or none")
        return self


class WatchRequest(NodeRequest):
    """The node's lease watchdog and preemption watcher: ends the node's processes (or powers it off) once the lease
    is older than its TTL; on a preemption notice stops the trainer, then asks the syncer to flush."""

    command: ClassVar[NodeCommand] = NodeCommand.WATCH
    lease: str  # the file holding the last renewal's unix time
    ttl_s: float  # seconds without renewal before teardown
    # allocation: the node's scheduler allocation judges the lease (a Slurm holder) and its end ends every process
    # here: the watchdog only watches the notices.
    on_expire: Literal["kill-node", "shutdown", "allocation"] = "kill-node"
    poll_s: float = Field(1.0, gt=0)
    notice_source: Literal["none", "aws", "gcp", "azure", "file"] = "none"  # where preemption notices come from
    notice_url: str | None = None  # the metadata service's base URL (None: the cloud's own)
    notice_poll_s: float = Field(2.0, gt=0)  # seconds between notice checks
    workdir: str | None = None  # the node's workdir (notice file); None: the lease's dir
    stop_sync_file: str | None = None  # written once the trainer stopped on a notice


class ChaosRequest(NodeRequest):
    """Take this node away on purpose once the trigger file appears (with a notice first, if any), the way a cloud
    reclaims a spot instance: every process of the node killed, its directory deleted."""

    command: ClassVar[NodeCommand] = NodeCommand.CHAOS
    trigger: str  # the file whose appearance starts the preemption
    workdir: str  # the node's directory, deleted at the end
    notice_s: float = Field(0.0, ge=0)  # notice before the node goes (0: none)
    poll_s: float = Field(0.2, gt=0)


class StacksRequest(NodeRequest):
    """Make this node's training ranks print their Python stacks and end: each torchrun worker of the node (with
    PYTHONFAULTHANDLER=1, which the workload environment sets) gets SIGABRT, which faulthandler turns into every
    thread's stack on the rank's stderr, then the abort. The orchestrator reads the stacks from the trainer's output."""

    command: ClassVar[NodeCommand] = NodeCommand.STACKS
    grace_s: float = Field(10.0, gt=0)  # how long the ranks get to print and exit


class NetbenchRequest(NodeRequest):
    """TCP throughput between two nodes: a server receives one client's streams then exits; a client sends to it
    and reports Gbit/s."""

    command: ClassVar[NodeCommand] = NodeCommand.NETBENCH
    mode: Literal["server", "client"]
    bind: str = ""  # server: the address to listen on ("": all)
    port: int = Field(0, ge=0, le=65535)  # server: 0 for a free one; client: the server's
    host: str | None = None  # client: the server node's address
    seconds: float | None = Field(None, gt=0)  # client: send for this long ...
    bytes: int | None = Field(None, ge=1)  # client: ... or this many bytes in all (at least one per stream)
    streams: int = Field(4, ge=1)  # parallel TCP connections
    timeout_s: float = Field(60.0, gt=0)  # give up when the peer is silent this long
    sockbuf_kb: int = Field(0, ge=0)  # SO_SNDBUF/SO_RCVBUF (0: kernel autotuning)

    @model_validator(mode="after")
    def _client_needs_target(self) -> NetbenchRequest:
        if self.mode == "client" and (self.host is None or self.port == 0
                                      or (self.seconds is None) == (self.bytes is None)):
            raise ValueError("a netbench client needs host, port and one of seconds or bytes")
        if self.bytes is not None and self.bytes < self.streams:
            raise ValueError(f"bytes {self.bytes}: at least one per stream ({self.streams})")
        return self


class DiskbenchRequest(NodeRequest):
    """Sequential write and read throughput of the disk a dir is on."""

    command: ClassVar[NodeCommand] = NodeCommand.DISKBENCH
    dir: str  # a directory on the disk to measure
    megabytes: int = Field(256, ge=1)  # size of the test file
    buffered: bool = False  # through the page cache, not O_DIRECT


class AllreduceBenchRequest(BaseModel):
    """All-reduce bandwidth of the cluster, in every rank of a torchrun (TorchrunRequest.worker). No command of the
    agent: infra/workload/allreduce_bench.py runs as a script in the training environment, which gets these fields as
    plain JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    sizes_mb: tuple[int, ...] = Field((1, 16, 64), min_length=1)  # message sizes in MB, each at least 1
    warmup: int = Field(2, ge=1)  # untimed iterations per size
    iters: int = Field(20, ge=3)  # timed iterations per size, at most (never under 3)
    seconds_per_size: float = Field(2.0, gt=0)  # fewer timed iterations when they would take longer than this
    timeout_s: float = Field(300.0, gt=0)  # the collective's timeout

    @model_validator(mode="after")
    def _sizes(self) -> AllreduceBenchRequest:
        if min(self.sizes_mb) < 1:
            raise ValueError(f"sizes_mb {list(self.sizes_mb)}: each at least 1 MB")
        return self


class TorchrunRequest(NodeRequest):
    """torchrun (torch.distributed.run of the training environment's Python) with a static rendezvous on the head
    node, plus one event (RANKS_EXITED) once every rank of this node exited 0. The agent starts it in the training
    environment through a stdlib launcher (infra/workload/launcher.py) and hands it the signals its runner sends;
    the agent's own stdin pipe to it is its lifeline (the agent gone: the ranks are stopped)."""

    command: ClassVar[NodeCommand] = NodeCommand.TORCHRUN
    # where torchrun and the ranks run (not `environment`: that is NodeRequest's method for the command's env)
    training_env: TrainingEnvironment
    env_names: EnvNames = ()  # of this command's environment, what the ranks get (a container gets only these)
    nnodes: int = Field(ge=1)
    nproc_per_node: int = Field(ge=1)
    node_rank: int = Field(ge=0)
    master_addr: str
    master_port: int = Field(ge=1, le=65535)
    max_restarts: int = Field(0, ge=0)
    # After a stop signal (or the agent gone), how long torchrun and the ranks have before everything of this node's
    # training is killed: below the orchestrator's own bound for the trainer, so no rank outlives its trainer.
    stop_grace_s: float = Field(LAUNCHER_STOP_GRACE_S, gt=0)
    # What every rank runs, as torchrun's script and its arguments (after `--`, so the script's own options never
    # reach torchrun's parser) ...
    script: tuple[str, ...] = ()
    # ... or, instead, the all-reduce bench (infra/workload/allreduce_bench.py, a torch-only script the agent writes
    # beside the launcher; its parameters reach the ranks as plain JSON in their environment).
    worker: AllreduceBenchRequest | None = None

    @model_validator(mode="after")
    def _one_program(self) -> TorchrunRequest:
        if bool(self.script) == (self.worker is not None):
            raise ValueError("give a script or a worker request (not both)")
        return self

    def torchrun_argv(self) -> list[str]:
        """torch.distributed.run's own argv (its options, then what every rank runs)."""
        options = ["--nnodes", str(self.nnodes), "--nproc-per-node", str(self.nproc_per_node), "--node-rank",
                   str(self.node_rank), "--master-addr", self.master_addr, "--master-port", str(self.master_port),
                   "--max-restarts", str(self.max_restarts)]
        return [*options, "--", *self.script] if self.worker is None else options


class ExecRequest(NodeRequest):
    """One command in the training environment (the job's setup, evaluate, the check verify makes), started by the
    launcher (infra/workload/launcher.py) with the agent's stdin pipe as its lifeline (infra/node/exec.py)."""

    command: ClassVar[NodeCommand] = NodeCommand.EXEC
    argv: tuple[str, ...] = Field(min_length=1)  # what runs, inside the environment (argv[0] found on its PATH)
    training_env: TrainingEnvironment
    cwd: str | None = None  # the working dir (inside a container: the same path, mounted)
    env_names: EnvNames = ()  # of this command's environment, what the command gets (a container gets only these)
    timeout_s: float | None = Field(None, gt=0)  # stop it (SIGTERM, then SIGKILL) past this


class PullRequest(NodeRequest):
    """Pull a CONTAINER environment's image with the node's engine and report its digest (IMAGE_PULLED); started
    beside staging, so the image is there when training starts (infra/node/pull.py)."""

    command: ClassVar[NodeCommand] = NodeCommand.PULL
    training_env: TrainingEnvironment
    node: str = "this node"  # the node's name, for the one-line error
    timeout_s: float = Field(3600.0, gt=0)

    @model_validator(mode="after")
    def _a_container(self) -> PullRequest:
        if self.training_env.kind is not EnvironmentKind.CONTAINER:
            raise ValueError(f"pull: a {self.training_env.kind.value} environment has no image to pull")
        return self


REQUESTS: dict[NodeCommand, type[NodeRequest]] = {
    cls.command: cls for cls in NodeRequest.__subclasses__()
}

R = TypeVar("R", bound=NodeRequest)


def read_request(command: NodeCommand, environ: dict[str, str] | None = None) -> NodeRequest:
    """The request the orchestrator sent with this command, taken out of the environment (os.environ by default)."""
    environ = os.environ if environ is None else environ
    text = environ.pop(REQUEST_ENV, None)
    if text is None:
        raise ProtocolError(f"python -m {AGENT_MODULE} {command}: no request in {REQUEST_ENV}: node commands are "
                            "started by trainpipe (infra.node.protocol), not by hand")
    try:
        return REQUESTS[command].model_validate_json(text)
    except ValidationError as exc:
        fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}" for e in exc.errors())
        raise ProtocolError(f"python -m {AGENT_MODULE} {command}: its request does not match this node agent's "
                            f"({fields}): install the orchestrator's trainpipe version on the node") from None


def as_request(request: NodeRequest, cls: type[R]) -> R:
    """request as the record its command's module expects (a command's main takes only its own record)."""
    if not isinstance(request, cls):
        raise ProtocolError(f"{cls.command} was given a {type(request).__name__}")
    return request


def runs_command(cmdline: Sequence[str], command: NodeCommand) -> bool:
    """Whether a process's command line (psutil's cmdline()) is this node command's: how a node's watcher finds its
    trainer (a TorchrunRequest's process) and tests find a command they started."""
    wanted = ["-m", AGENT_MODULE, command.value]
    return any(list(cmdline[i:i + 3]) == wanted for i in range(len(cmdline) - 2))

