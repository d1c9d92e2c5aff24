"""`python -m infra.node COMMAND`: the agent the orchestrator runs on every node.

A command's input is its request record (infra.node.protocol), read from the environment; each command module's
`main(request)` takes that record. The all-reduce bench is no command of the agent: it runs as a script in the
training environment, under the agent's torchrun (infra/node/torchrun.py).
"""

from __future__ import annotations

import importlib
import logging
import sys

from infra.node.protocol import NodeCommand, ProtocolError, read_request

COMMANDS: dict[NodeCommand, str] = {
    NodeCommand.PROBE: "infra.node.probe",
    NodeCommand.STAGE: "infra.node.stage",
    NodeCommand.SYNC: "infra.node.sync",
    NodeCommand.RESTORE: "infra.node.restore",
    NodeCommand.VERIFY_CKPT: "infra.node.verify_ckpt",
    NodeCommand.WATCH: "infra.node.watchdog",
    NodeCommand.DISKBENCH: "infra.node.diskbench",
    NodeCommand.NETBENCH: "infra.node.netbench",
    NodeCommand.CHAOS: "infra.node.chaos",
    NodeCommand.CODE: "infra.node.code",
    NodeCommand.PEER_SERVE: "infra.node.peerserve",
    NodeCommand.UNSHARE: "infra.node.unshare",
    NodeCommand.REJOIN: "infra.node.rejoin",
    NodeCommand.TORCHRUN: "infra.node.torchrun",
    NodeCommand.EXEC: "infra.node.exec",
    NodeCommand.PULL: "infra.node.pull",
    NodeCommand.STACKS: "infra.node.stacks",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m infra.node {{{','.join(COMMANDS)}}}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    command = NodeCommand(argv[0])
    module = importlib.import_module(COMMANDS[command])
    try:
        request = read_request(command)
    except ProtocolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return int(module.main(request))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
