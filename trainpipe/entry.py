"""The `trainpipe` command's entry point.

`trainpipe cp` moves bulk bytes and is timed start to exit against s5cmd (`trainpipe bench transfer`), so it starts
on the storage engine's imports alone (trainpipe.cp_command: no typer, no botocore) instead of the whole command
line's (pandas, Great Expectations' neighbours, the job models: ~0.6 s more).
Every other command goes through `trainpipe.cli`.
"""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] == ["cp"]:
        from trainpipe.cp_command import main as cp

        cp(sys.argv[2:])
        return
    from trainpipe.cli import app as full_app

    full_app()


if __name__ == "__main__":
    main()
