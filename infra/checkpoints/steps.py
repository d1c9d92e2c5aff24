"""The one naming of checkpoint steps: `step-` and the step number zero-padded to 8 digits.

Used by the trainer's local checkpoint dirs and markers, the store's commit layout (step dirs, announcements) and
the step URLs `trainpipe run` prints and `trainpipe restore` reads. Eight digits is the padding, not a limit: a
step past 99,999,999 has more digits, and every parser here accepts them (so nothing written can become unreadable).
"""

from __future__ import annotations

import re

PREFIX = "step-"
DIGITS = 8
# The regex fragment of a step name, for patterns that embed one (a key under a step dir, a URL ending in one).
PATTERN = rf"{PREFIX}(?P<step>\d{{{DIGITS},}})"
_NAME = re.compile(rf"^{PATTERN}(?P<suffix>.*)$")


def step_name(step: int) -> str:
    """step-00000100 for step 100."""
    return f"{PREFIX}{step:0{DIGITS}d}"


def parse_step_name(name: str, suffix: str = "") -> int | None:
    """The step a name stands for when it is a step name followed by exactly suffix (".json", ".complete"), or
    None for any other name."""
    match = _NAME.match(name)
    return int(match["step"]) if match and match["suffix"] == suffix else None
