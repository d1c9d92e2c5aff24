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

import json
import os
from collections.abc import Mapping
from enum import StrEnum
from typing import ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from infra.checkpoints.formats import FORMATS

# The variable a node command finds its request in; removed from the environment once read, so nothing the command
# starts (torchrun, the training script) inherits it.
REQUEST_ENV = "TRAINPIPE_NODE_REQUEST"
AGENT_MODULE = "infra.node"


class NodeCommand(StrEnum):
    """Every command of the node agent (`python -m infra.node COMMAND`), by its name on the command line."""

    PROBE = "probe"
    STAGE = "stage"
    RESTORE = "restore"
    CODE = "code"
    PEER_SERVE = "peer-serve"
    VERIFY_CKPT = "verify-ckpt"
    REJOIN = "rejoin"


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
        if value not in FORMATS:
            raise ValueError(f"format {value!r}: one of {', '.join(FORMATS)}")
        return value

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


def describe(request: NodeRequest) -> str:
    """The request in a line, for logs and errors (no secrets are ever in a request)."""
    return f"{request.command} {json.dumps(request.model_dump(exclude_defaults=True), sort_keys=True)}"
