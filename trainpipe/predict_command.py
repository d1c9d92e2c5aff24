"""`trainpipe predict SUMMARY`: a run's measured step breakdown replayed on other networks, disks and instance types.

Plain Python: no Prefect. Exit 2 with one line when the summary cannot be read or has no breakdown.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

# The infra modules are imported where they are used: the command line imports this module to register the command,
# and `trainpipe --help` should not wait for the catalog's and the job models' imports.
if TYPE_CHECKING:
    from infra.analysis.predict import Target
    from infra.analysis.predict_report import RunFacts
    from infra.compute.catalog import Catalog


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def summary_path(summary: str) -> Path:
    """A summary.json, a run directory holding one, or a run id under the workspace's runs."""
    from infra.workspace import run_dir

    given = Path(summary)
    for path in (given, given / "summary.json", run_dir(summary) / "summary.json"):
        if path.is_file():
            return path
    _fail(f"{summary}: neither a summary.json nor a run id with {run_dir(summary) / 'summary.json'}: give the path "
          "of a run's summary.json or its run id (`trainpipe status` lists the latest)")


def _providers(catalog: Catalog, run_provider: str, asked: list[str] | None) -> list[str]:
    """Those asked for, else the run's when the catalog lists it (local, ssh: it does not), else every provider the
    catalog lists that a job config can name."""
    from infra.compute.providers.table import PROVIDER_NAMES

    usable = [p for p in PROVIDER_NAMES if catalog.for_provider(p)]
    for name in asked or []:
        if name not in usable:
            _fail(f"--provider {name}: the catalog has no instance types of it that a job can use: use one of "
                  + ", ".join(usable))
    return asked or ([run_provider] if run_provider in usable else usable)


def _candidate_targets(catalog: Catalog, facts: RunFacts, providers: list[str], accelerator: str | None,
                       compute_speedup: float) -> tuple[list[Target], list[str]]:
    """Catalog targets for each provider; a provider the floors leave empty becomes a note, not a failure."""
    from infra.analysis.predict import catalog_targets, ranks_per_node
    from infra.compute.optimizer import NoCandidateError
    from infra.compute.spec import ClusterSpec

    targets: list[Target] = []
    notes: list[str] = []
    for provider in providers:
        spec = ClusterSpec(provider=provider, nodes=facts.nodes, accelerator=accelerator,
                           procs_per_node=ranks_per_node(facts.breakdown))
        try:
            targets += catalog_targets(catalog, spec, compute_speedup)
        except NoCandidateError as exc:
            notes.append(f"no {provider} candidates: {exc}")
    return targets, notes


def predict(
    summary: Annotated[str, typer.Argument(help="a run id, or the path of its summary.json")],
    deadline_h: Annotated[float | None, typer.Option("--deadline-h", min=0.0, help="the job must end within this "
                                                     "many hours; the cheapest candidate that does is named")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="steps of the job to predict (default: the run's)")] = None,
    provider: Annotated[list[str] | None, typer.Option(help="catalog provider(s) to price (default: the run's, "
                                                       "else every one the catalog and configs share)")] = None,
    accelerator: Annotated[str | None, typer.Option(help="only candidates with this GPU, e.g. H100")] = None,
    compute_speedup: Annotated[float, typer.Option(min=0.001, help="how much faster the candidates compute than "
                                                   "the measured run's hardware (default: as measured)")] = 1.0,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Predict step time, job time and cost with 2× network, local NVMe and on every catalog candidate."""
    from infra.analysis.predict import cheapest_meeting, what_if
    from infra.analysis.predict_report import NoBreakdownError, facts_from_summary, render, to_json
    from infra.compute.catalog import CatalogError, load_catalog
    from infra.job.summary import load_summary

    path = summary_path(summary)
    try:
        facts = facts_from_summary(load_summary(path), str(path), steps)
    except json.JSONDecodeError as exc:
        _fail(f"{path}: not JSON ({exc}): give a run's summary.json")
    except NoBreakdownError as exc:
        _fail(str(exc))
    try:
        catalog = load_catalog()
    except CatalogError as exc:
        _fail(str(exc))
    providers = _providers(catalog, facts.provider, provider)
    targets, notes = _candidate_targets(catalog, facts, providers, accelerator, compute_speedup)
    predictions = what_if(facts.breakdown, facts.measured, facts.job, facts.price_per_hour, targets)
    deadline_s = deadline_h * 3600 if deadline_h is not None else math.inf
    choice = cheapest_meeting([p for p in predictions if p.kind == "candidate"], deadline_s)
    if json_out:
        typer.echo(json.dumps(to_json(facts, predictions, choice, deadline_s, notes), indent=2))
    else:
        typer.echo(render(facts, predictions, choice, notes))
