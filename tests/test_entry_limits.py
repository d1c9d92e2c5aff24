"""The orchestrator lifts its soft limit of open files (about 8 fds per node: 1024 runs out near 128 nodes)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

PROBE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, int(sys.argv[1])))
from trainpipe.entry import raise_open_files_limit
print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _soft_after(hard: int, wanted: int | None = None) -> list[int]:
    code = PROBE if wanted is None else PROBE.replace("raise_open_files_limit()", f"raise_open_files_limit({wanted})")
    out = subprocess.run([sys.executable, "-c", code, str(hard)], cwd=REPO, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return [int(x) for x in out.split()]


def test_the_soft_limit_rises_to_what_is_wanted_within_the_hard_one() -> None:
    assert _soft_after(hard=4096) == [4096, 4096]  # the hard limit caps it
    assert _soft_after(hard=4096, wanted=2048) == [2048, 2048]
    assert _soft_after(hard=200 + 256, wanted=300) == [300, 300]


def test_a_soft_limit_already_high_enough_is_left_alone() -> None:
    assert _soft_after(hard=4096, wanted=128) == [256, 256]
