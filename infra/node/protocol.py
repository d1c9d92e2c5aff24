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
from typing import ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

# The variable a node command finds its request in; removed from the environment once read, so nothing the command
# starts (torchrun, the training script) inherits it.
REQUEST_ENV = "TRAINPIPE_NODE_REQUEST"
AGENT_MODULE = "infra.node"


class NodeCommand(StrEnum):
    """Every command of the node agent (`python -m infra.node COMMAND`), by its name on the command line."""

    PROBE = "probe"


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
