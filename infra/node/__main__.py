"""`python -m infra.node COMMAND`: the agent the orchestrator runs on every node.

A command's input is its request record (infra.node.protocol), read from the environment; each command module's
`main(request)` takes that record. Commands not yet on the protocol still parse their own argv.
"""

from __future__ import annotations

import importlib
import logging
import sys

from infra.node.protocol import REQUESTS, NodeCommand, ProtocolError, read_request

COMMANDS = {
    "probe": "infra.node.probe",
    "stage": "infra.node.stage",
    "sync": "infra.node.sync",
    "restore": "infra.node.restore",
    "verify-ckpt": "infra.node.verify_ckpt",
    "watch": "infra.node.watchdog",
    "diskbench": "infra.node.diskbench",
    "netbench": "infra.node.netbench",
    "allreduce-bench": "infra.node.allreduce_bench",
    "chaos": "infra.node.chaos",
    "code": "infra.node.code",
    "peer-serve": "infra.node.peerserve",
    "rejoin": "infra.node.rejoin",
    "torchrun": "infra.node.torchrun",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m infra.node {{{','.join(COMMANDS)}}}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(COMMANDS[argv[0]])
    if argv[0] not in REQUESTS:
        return int(module.main(argv[1:]))
    try:
        request = read_request(NodeCommand(argv[0]))
    except ProtocolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return int(module.main(request))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
