"""`rejoin`: a node that survived a preemption gets ready for the next attempt on its replaced cluster.

What the next attempt reuses stays (staged data, the stage cache, code, setup, local checkpoints: restore finds its
own parts there). What would mislead it goes: the syncer's state and stop request of the attempt that ended (a new
syncer would stop at once, or take old saves for its own), the attempt's preemption notice and chaos trigger, and
the metrics file (set aside, renamed, so the orchestrator and the syncer read only the new attempt's steps). Prints a
`rejoined` event with a free port (the head's is the next attempt's rendezvous port, as probe's is on a new node).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from infra.node.events import NodeEvent, emit
from infra.node.ports import free_port


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.node rejoin", description=__doc__.splitlines()[0])
    parser.add_argument("--clear", type=Path, action="append", default=[], help="a dir to empty (kept itself)")
    parser.add_argument("--remove", type=Path, action="append", default=[], help="a file to remove if present")
    parser.add_argument("--set-aside", type=Path, action="append", default=[],
                        help="a file renamed to FILE.<suffix> if present")
    parser.add_argument("--suffix", default="old", help="what --set-aside appends to the name")
    args = parser.parse_args(argv)
    for directory in args.clear:
        directory.mkdir(parents=True, exist_ok=True)
        for entry in directory.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    for path in args.remove:
        path.unlink(missing_ok=True)
    aside = []
    for path in args.set_aside:
        if path.exists():
            target = path.with_name(f"{path.name}.{args.suffix}")
            path.replace(target)
            aside.append(str(target))
    emit(NodeEvent.REJOINED, free_port=free_port(), cleared=[str(d) for d in args.clear], set_aside=aside)
    return 0
