"""The `trainpipe` command's entry point.

`trainpipe cp` moves bulk bytes and is timed start to exit against s5cmd (`trainpipe bench transfer`), so it starts
on the storage engine's imports alone (~0.15 s) instead of the whole command line's (pandas, Great Expectations'
neighbours, the job models: ~0.6 s more). Every other command goes through `trainpipe.cli`.
"""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] == ["cp"]:
        import typer

        from infra.storage import StorageError
        from trainpipe.cp_command import cp
        from trainpipe.errors import exit_2_on

        app = typer.Typer(add_completion=False)
        app.command("cp")(exit_2_on(StorageError)(cp))
        app(args=sys.argv[2:], prog_name="trainpipe cp")
        return
    from trainpipe.cli import app as full_app

    full_app()


if __name__ == "__main__":
    main()
