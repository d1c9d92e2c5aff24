"""The `trainpipe` command's entry point.

`trainpipe cp` moves bulk bytes and is timed start to exit against s5cmd (`trainpipe bench transfer`), so it starts
on the storage engine's imports alone (trainpipe.cp_command: no typer, no botocore) instead of the whole command
line's (pandas, Great Expectations' neighbours, the job models: ~0.6 s more).
Every other command goes through `trainpipe.cli`.

Every command first lifts its soft limit of open files to the hard limit: an orchestrator holds about 8 per node (the
pipes of each node command, SSH channels; `trainpipe bench scale`: 125 at 16 nodes), so a cluster of 128 or more
nodes would hit the usual soft limit of 1024 in the middle of a run.
"""

from __future__ import annotations

import resource
import sys

OPEN_FILES_WANTED = 65536


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> int:
    """The soft RLIMIT_NOFILE raised towards `wanted`, never above the hard limit (which only root may raise): the
    soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


def main() -> None:
    raise_open_files_limit()
    if sys.argv[1:2] == ["cp"]:
        from trainpipe.cp_command import main as cp

        cp(sys.argv[2:])
        return
    from trainpipe.cli import app as full_app

    full_app()


if __name__ == "__main__":
    main()
