"""The instance-type catalog: the shipped figures, overridden per provider by what `trainpipe catalog refresh` wrote.

May import: the shared infra modules (workspace) only; the optimizer and the providers read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from infra.compute.catalog.model import CatalogFile, InstanceType, NetworkKind, RegionOffer
from infra.workspace import workspace_dir

SHIPPED = "instances.json"


class CatalogError(ValueError):
    """A catalog file that cannot be read; one line naming the file and the fix."""


def refreshed_dir() -> Path:
    """Where `trainpipe catalog refresh PROVIDER` writes PROVIDER.json (it replaces that provider's shipped part)."""
    return workspace_dir() / "catalog"


def parse_catalog(text: str, source: str) -> CatalogFile:
    try:
        return CatalogFile.model_validate(json.loads(text))
    except (json.JSONDecodeError, ValidationError) as exc:
        first = str(exc).splitlines()[0]
        raise CatalogError(f"{source}: not a valid catalog ({first}): delete it or run `trainpipe catalog refresh`"
                           ) from None


@dataclass(frozen=True)
class Catalog:
    instances: tuple[InstanceType, ...]

    def for_provider(self, provider: str) -> tuple[InstanceType, ...]:
        return tuple(i for i in self.instances if i.provider == provider)

    def get(self, provider: str, name: str) -> InstanceType | None:
        return next((i for i in self.instances if i.provider == provider and i.name == name), None)

    def regions(self, provider: str) -> tuple[str, ...]:
        return tuple(sorted({region for i in self.for_provider(provider) for region in i.regions}))

    def replace_provider(self, provider: str, instances: tuple[InstanceType, ...]) -> Catalog:
        return Catalog(tuple(i for i in self.instances if i.provider != provider) + instances)


def shipped_catalog() -> Catalog:
    text = resources.files("infra.compute.catalog").joinpath(SHIPPED).read_text()
    return Catalog(parse_catalog(text, f"infra/compute/catalog/{SHIPPED}").instances)


def load_catalog(refreshed: Path | None = None) -> Catalog:
    """The shipped catalog, with each provider's part replaced by its refreshed file where one exists."""
    catalog = shipped_catalog()
    directory = refreshed or refreshed_dir()
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        part = parse_catalog(path.read_text(), str(path))
        catalog = catalog.replace_provider(path.stem, tuple(i for i in part.instances if i.provider == path.stem))
    return catalog


def write_provider_part(provider: str, part: CatalogFile, refreshed: Path | None = None) -> Path:
    directory = refreshed or refreshed_dir()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{provider}.json"
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(part.model_dump_json(indent=1) + "\n")
    tmp.replace(target)
    return target


__all__ = [
    "Catalog", "CatalogError", "CatalogFile", "InstanceType", "NetworkKind", "RegionOffer", "load_catalog",
    "shipped_catalog", "write_provider_part",
]
