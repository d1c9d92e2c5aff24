"""Node output into the Prefect run log, labelled with the node, and node events picked out of it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from infra.node.events import parse


def node_line_sink(logger: logging.Logger | logging.LoggerAdapter[Any], node: str,
                   on_event: Callable[[dict[str, Any]], None] | None = None) -> Callable[[str], None]:
    def sink(line: str) -> None:
        event = parse(line)
        if event is not None and on_event is not None:
            on_event(event)
        logger.info("[%s] %s", node, line)

    return sink


def last_event(output: str, name: str) -> dict[str, Any]:
    """The last event of that name a command printed; its absence means the command broke its contract."""
    for line in reversed(output.splitlines()):
        event = parse(line)
        if event is not None and event["event"] == name:
            return event
    raise RuntimeError(f"no '{name}' event in the command's output: {output.strip().splitlines()[-1:]}")
