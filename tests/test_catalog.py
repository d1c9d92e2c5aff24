"""The shipped catalog: the types the issue lists, every figure with a source, and refreshed parts overriding it."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.compute.catalog import CatalogError, CatalogFile, load_catalog, shipped_catalog, write_provider_part

REQUIRED = {
    "aws": {"p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge", "g5.48xlarge",
            "g6.48xlarge", "trn1.32xlarge"},
    "gcp": {"a2-highgpu-8g", "a2-ultragpu-8g", "a3-highgpu-8g", "a3-megagpu-8g"},
    "azure": {"Standard_ND96asr_v4", "Standard_ND96isr_H100_v5"},
    "nebius": {"gpu-h100-sxm-8gpu-128vcpu-1600gb", "gpu-h200-sxm-8gpu-128vcpu-1600gb"},
}


def test_shipped_catalog_has_the_listed_types_with_sources() -> None:
    catalog = shipped_catalog()
    for provider, names in REQUIRED.items():
        assert names <= {i.name for i in catalog.for_provider(provider)}, provider
    for item in catalog.instances:
        assert item.source and item.regions, item.name
        assert all(offer.source and (offer.on_demand or offer.spot) for offer in item.regions.values()), item.name
        assert (item.local_nvme_bytes > 0) == (item.local_nvme_count > 0), item.name
        # Figures that are not from a price list say so.
        assert all("estimate" in offer.source for offer in item.regions.values() if offer.spot), item.name
    p5 = catalog.get("aws", "p5.48xlarge")
    assert p5 is not None and (p5.gpus, p5.accelerator, p5.network_gbps, p5.network_kind) == (8, "H100", 3200, "efa")


def test_refreshed_part_replaces_only_its_provider(tmp_path: Path) -> None:
    shipped = shipped_catalog()
    p5 = shipped.get("aws", "p5.48xlarge")
    assert p5 is not None
    cheaper = p5.model_copy(update={"regions": {"us-east-1": p5.regions["us-east-1"].model_copy(
        update={"on_demand": 55.04, "source": "test"})}})
    write_provider_part("aws", CatalogFile(generated_at="now", instances=(cheaper,)), tmp_path)
    merged = load_catalog(tmp_path)
    assert [i.name for i in merged.for_provider("aws")] == ["p5.48xlarge"]
    assert merged.get("aws", "p5.48xlarge").regions["us-east-1"].on_demand == 55.04  # type: ignore[union-attr]
    assert merged.for_provider("gcp") == shipped.for_provider("gcp")


def test_a_damaged_refreshed_file_fails_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "aws.json").write_text('{"instances": [{"name": 1}]}')
    with pytest.raises(CatalogError) as caught:
        load_catalog(tmp_path)
    assert str(caught.value).startswith(f"{tmp_path / 'aws.json'}: not a valid catalog")
    assert str(caught.value).endswith("delete it or run `trainpipe catalog refresh`")
    assert "\n" not in str(caught.value)
