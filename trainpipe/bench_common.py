"""What the `trainpipe bench …` commands share: options they declare alike, how a report is printed and written.

A module of its own so that the command modules need not import trainpipe.bench_command, which imports them to
register them on the `bench` group (an import circle otherwise).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol

import typer

if TYPE_CHECKING:
    from infra.job.spec import JobSpec

# Options that several benches declare word for word: declared once, so their flags and help cannot drift apart.
CkptEvery = Annotated[int, typer.Option(min=1, help="checkpoint every this many steps")]
JsonFigures = Annotated[Path | None, typer.Option("--json", help="also write the figures as JSON here")]
JsonTable = Annotated[Path | None, typer.Option("--json", help="also write the table as JSON here")]
Workdir = Annotated[Path | None, typer.Option(help="scratch dir for the bench's data (default: the system temp)")]


def node_counts(text: str) -> tuple[int, ...]:
    """--nodes 2,4,8 as its node counts; a bad list is the option's error."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise typer.BadParameter(f"{text!r}: give node counts of at least 1 separated by commas, e.g. 2,4",
                                 param_hint="--nodes")
    return counts


class Report(Protocol):
    def table(self) -> str: ...

    def to_json(self) -> str: ...


def write_out(path: Path | None, data: str | bytes) -> None:
    """Write what an option such as --json or --chart asked for, and say so; nothing when it was not asked."""
    if path is None:
        return
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    typer.echo(f"wrote {path}")


def print_report(report: Report, json_out: Path | None) -> None:
    """A bench's table on stdout, and the same figures as JSON where --json asks."""
    typer.echo(report.table())
    write_out(json_out, report.to_json())


def run_retrain(job: JobSpec, run_id: str) -> dict[str, Any]:
    """The retrain flow, as `trainpipe run` runs it; a failed run still has its summary, which the caller reads."""
    from flows.retrain import retrain
    from infra.job.summary import load_summary
    from infra.workspace import runs_dir

    # Prefect's 20 s default for starting its in-process server is too short on a busy 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    try:
        retrain(job, run_id)
    except Exception as exc:  # the flow logged its traceback; the summary says what failed
        typer.echo(f"run {run_id} failed: {type(exc).__name__}: {exc}", err=True)
    path = runs_dir() / run_id / "summary.json"
    return load_summary(path) if path.is_file() else {"status": "failed", "error": f"no summary at {path}"}
