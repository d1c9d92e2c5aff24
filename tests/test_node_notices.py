"""The notices the nodes' watchers wrote, read by the orchestrator's watch every round (Azure, the ssh provider)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from infra.compute.access.remote import LocalRunner
from infra.compute.providers.base import Node
from infra.compute.providers.node_notices import read_node_notices
from infra.node.preemption_notice import NOTICE_FILE, Notice, write_notice


class SilentRunner(LocalRunner):
    """A node whose host stopped answering: a read waits as an SSH read does on a host that accepts and never
    replies, until the test ends."""

    def __init__(self, node_name: str, workdir: Path, released: threading.Event) -> None:
        super().__init__(node_name, workdir, {})
        self.released = released

    def read_text(self, path: str) -> str | None:
        self.released.wait(600)
        raise OSError(f"{self.node_name}: connection lost")


def test_a_node_that_stopped_answering_does_not_hold_up_the_others_notices(tmp_path: Path) -> None:
    """Read one after the other, a silent node kept the watch from every other node's notice (and from its own next
    round) for the whole SSH connect bound, 60 s a round."""
    nodes = [Node(name=f"node-{rank}", rank=rank, address="127.0.0.1", workdir=str(tmp_path / f"node-{rank}"),
                  data_dir="", ckpt_dir="", python="python3") for rank in range(3)]
    for node in nodes:
        Path(node.workdir).mkdir()
    write_notice(Path(nodes[2].workdir) / NOTICE_FILE, Notice("spot: Preempt", time.time() + 30, "azure"))
    released = threading.Event()
    runners = {node.name: LocalRunner(node.name, Path(node.workdir), {}) for node in nodes}
    runners["node-0"] = SilentRunner("node-0", Path(nodes[0].workdir), released)
    try:
        started = time.monotonic()
        notices = read_node_notices(nodes, lambda node: runners[node.name], within_s=2.0)
        took = time.monotonic() - started
    finally:
        released.set()
    assert [(notice.node, notice.reason) for notice in notices] == [("node-2", "spot: Preempt")]
    assert took < 30, f"the round waited {took:.1f}s on the silent node"
