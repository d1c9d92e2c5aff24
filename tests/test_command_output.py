"""A command's output is read whole, however slow the sink its lines go to: a node's last event is in its output when
the command has ended (at 16 local nodes a loaded machine's Prefect logger held the reader up, and stage commands that
had succeeded were read without their `staged` line)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from infra.compute.access.remote import LocalRunner

LINES = 600
SINK_S = 0.01  # a loaded log handler's cost per line: 6 s in all, past the 5 s the reader was given after exit
PRINT = [sys.executable, "-c", f"for i in range({LINES}): print('line', i)"]


def slow_sink(seen: list[str]):
    def sink(line: str) -> None:
        time.sleep(SINK_S)  # stands in for a slow handler, it waits for nothing
        seen.append(line)
    return sink


def test_a_slow_sink_never_costs_the_local_output_its_last_lines(tmp_path: Path) -> None:
    seen: list[str] = []
    result = LocalRunner("node-0", tmp_path, {}).run(PRINT, on_line=slow_sink(seen))
    assert result.output.splitlines()[-1] == f"line {LINES - 1}"
    assert len(seen) == LINES and seen[-1] == f"line {LINES - 1}", "the sink is handed every line before run returns"
