"""The preemption notices the nodes' own watchers wrote (infra.node.preemption_notice's file in each node's workdir).

Where the control plane does not show what a node was told (Azure's Scheduled Events; a user's own machines, whose
only notices are the chaos injector's), the file is how the orchestrator learns of it: the watcher writes it before it
stops the trainer, so a trainer that exits on the notice is already explained by it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from infra.compute.access.remote import RemoteError, Runner
from infra.compute.providers.base import Node, PreemptionNotice
from infra.compute.providers.hosts import in_parallel
from infra.node.preemption_notice import NOTICE_FILE, parse_notice

log = logging.getLogger(__name__)
# A watch reads every node each round (every 2 s): a node that has not answered by then is read again next round.
READ_WITHIN_S = 10.0


def read_node_notices(nodes: Iterable[Node], runner_of: Callable[[Node], Runner],
                      within_s: float = READ_WITHIN_S) -> list[PreemptionNotice]:
    """The notice of each node that has one, read from every node at once; a node that cannot be read, or does not
    answer within within_s, is skipped this round (whether it is gone is nodes_alive's call), with a warning naming
    it: the watch that calls this every round is never held up by one host that stopped answering."""
    def read(node: Node) -> str | None:
        return runner_of(node).read_text(node.path(NOTICE_FILE))

    notices = []
    for node, text, error in in_parallel(list(nodes), read, within_s=within_s):
        if isinstance(error, RemoteError | OSError):  # TimeoutError included: an OSError
            log.warning("%s: cannot read its preemption notice: %s", node.name, error)
            continue
        if error is not None:
            raise error
        notice = parse_notice(text)
        if notice is not None:
            notices.append(PreemptionNotice(node=node.name, deadline=notice.deadline, reason=notice.reason))
    return notices
