"""`rejoin`: a node that survived a preemption gets ready for the next attempt on its replaced cluster.

What the next attempt reuses stays (staged data, the stage cache, code, setup, local checkpoints: restore finds its
own parts there). What would mislead it goes: the syncer's state and stop request of the attempt that ended (a new
syncer would stop at once, or take old saves for its own), the attempt's preemption notice and chaos trigger, and
the metrics file (set aside, renamed, so the orchestrator and the syncer read only the new attempt's steps). Prints a
`rejoined` event with a free port (the head's is the next attempt's rendezvous port, as probe's is on a new node).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from infra.node.events import NodeEvent, emit
from infra.node.ports import free_port
from infra.node.protocol import NodeRequest, RejoinRequest, as_request


def main(request: NodeRequest) -> int:
    rejoining = as_request(request, RejoinRequest)
    cleared = [Path(directory) for directory in rejoining.clear]
    for directory in cleared:
        directory.mkdir(parents=True, exist_ok=True)
        for entry in directory.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    for path in map(Path, rejoining.remove):
        path.unlink(missing_ok=True)
    aside = []
    for path in map(Path, rejoining.set_aside):
        if path.exists():
            target = path.with_name(f"{path.name}.{rejoining.suffix}")
            path.replace(target)
            aside.append(str(target))
    emit(NodeEvent.REJOINED, free_port=free_port(), cleared=[str(d) for d in cleared], set_aside=aside)
    return 0
