"""The preemption notices the nodes' own watchers wrote (infra.node.preemption_notice's file in each node's workdir).

Where the control plane does not show what a node was told (Azure's Scheduled Events; a user's own machines, whose
only notices are the chaos injector's), the file is how the orchestrator learns of it: the watcher writes it before it
stops the trainer, so a trainer that exits on the notice is already explained by it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from infra.compute.access.remote import RemoteError, Runner
from infra.compute.providers.base import Node, PreemptionNotice
from infra.node.preemption_notice import NOTICE_FILE, parse_notice

log = logging.getLogger(__name__)


def read_node_notices(nodes: Iterable[Node], runner_of: Callable[[Node], Runner]) -> list[PreemptionNotice]:
    """The notice of each node that has one; a node that cannot be read is skipped (whether it is gone is
    nodes_alive's call), with a warning naming it."""
    notices = []
    for node in nodes:
        try:
            notice = parse_notice(runner_of(node).read_text(node.path(NOTICE_FILE)))
        except (RemoteError, OSError) as exc:
            log.warning("%s: cannot read its preemption notice: %s", node.name, exc)
            continue
        if notice is not None:
            notices.append(PreemptionNotice(node=node.name, deadline=notice.deadline, reason=notice.reason))
    return notices
