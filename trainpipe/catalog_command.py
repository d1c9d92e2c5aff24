"""`trainpipe catalog refresh PROVIDER` and `trainpipe catalog show`: the instance catalog the optimizer reads."""

from __future__ import annotations

from typing import Annotated

import typer

catalog_app = typer.Typer(no_args_is_help=True, help="The instance-type catalog (GPUs, network, NVMe, prices).")
REFRESHABLE = ("aws",)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@catalog_app.command("refresh")
def refresh(
    provider: Annotated[str, typer.Argument(help="the provider whose part to rebuild: aws")],
    regions: Annotated[str, typer.Option(help="comma-separated regions; default: those the catalog lists")] = "",
    prices: Annotated[bool, typer.Option("--prices/--no-prices", help="ask the AWS Price List API")] = True,
) -> None:
    """Rebuild PROVIDER's part from its API (needs credentials); the optimizer uses it instead of the shipped one."""
    if provider not in REFRESHABLE:
        _fail(f"catalog refresh {provider}: only {', '.join(REFRESHABLE)} can be refreshed: use one of them")
    # Imported here, not at the top: the command line imports this module to register it, and `--help` need not wait.
    from infra.compute.catalog import load_catalog
    from infra.compute.catalog.aws_refresh import refresh_aws, refresh_errors

    wanted = tuple(r for r in regions.split(",") if r) or None
    try:
        path = refresh_aws(regions=wanted, pricing=prices)
    except refresh_errors() as exc:
        _fail(f"catalog refresh {provider}: {type(exc).__name__}: {' '.join(str(exc).split())}: check credentials "
              "and region (or pass --no-prices when the Price List API is not reachable)")
    typer.echo(f"{provider}: {len(load_catalog().for_provider(provider))} instance types written to {path}")


@catalog_app.command("show")
def show(provider: Annotated[str, typer.Argument(help="aws, gcp, azure or nebius; default: all")] = "") -> None:
    """Every instance type with its hardware, and per region its prices and their source."""
    from infra.compute.catalog import CatalogError, load_catalog

    try:
        catalog = load_catalog()
    except CatalogError as exc:
        _fail(str(exc))
    for item in catalog.instances:
        if provider and item.provider != provider:
            continue
        typer.echo(f"{item.provider:<7} {item.describe()}  [{item.source}]")
        for region, offer in item.regions.items():
            typer.echo(f"          {region:<14} on-demand {offer.on_demand or '-'}  spot {offer.spot or '-'}  "
                       f"[{offer.source}]")
