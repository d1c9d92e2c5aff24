"""`trainpipe catalog refresh aws`: rebuild the AWS part of the catalog from EC2's own answers.

Hardware figures come from DescribeInstanceTypes, the zones from DescribeInstanceTypeOfferings, spot prices from
DescribeSpotPriceHistory and on-demand prices from the Price List API when it answers; a price EC2 does not give
keeps the shipped figure and says so in its source.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from infra.compute.catalog import CatalogFile, InstanceType, RegionOffer, shipped_catalog, write_provider_part

log = logging.getLogger(__name__)
GIB = 2**30
SOURCE = "EC2 DescribeInstanceTypes"


def _gbps(text: str) -> float:
    """'3200 Gigabit' / 'Up to 25 Gigabit' / '400 Gigabit' → Gbit/s."""
    found = re.search(r"([\d.]+)\s*Gigabit", text)
    return float(found.group(1)) if found else 1.0


def hardware(described: dict[str, Any], shipped: InstanceType) -> dict[str, Any]:
    gpus = described.get("GpuInfo", {}).get("Gpus") or described.get("NeuronInfo", {}).get("NeuronDevices") or []
    network = described["NetworkInfo"]
    disks = described.get("InstanceStorageInfo", {}).get("Disks", [])
    efa = network.get("EfaInfo", {}).get("MaximumEfaInterfaces", 0) if network.get("EfaSupported") else 0
    memory = gpus[0].get("MemoryInfo", {}).get("SizeInMiB", 0) if gpus else 0
    return {
        "accelerator": gpus[0]["Name"] if gpus and "Name" in gpus[0] else shipped.accelerator,
        "gpus": sum(g.get("Count", 0) for g in gpus) or shipped.gpus,
        "gpu_memory_gb": round(memory / 1024) if memory else shipped.gpu_memory_gb,
        "vcpus": described["VCpuInfo"]["DefaultVCpus"],
        "memory_gb": described["MemoryInfo"]["SizeInMiB"] * 2**20 / GIB,
        "network_gbps": _gbps(network.get("NetworkPerformance", "")),
        "network_kind": "efa" if efa else "ethernet",
        "efa_interfaces": efa,
        "local_nvme_bytes": sum(d["SizeInGB"] * d["Count"] for d in disks) * 10**9,
        "local_nvme_count": sum(d["Count"] for d in disks),
        "source": f"{SOURCE} ({datetime.now(UTC):%Y-%m-%d})",
    }


def _zones(ec2: Any, name: str) -> tuple[str, ...]:
    offerings = ec2.describe_instance_type_offerings(
        LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [name]}])
    return tuple(sorted(o["Location"] for o in offerings["InstanceTypeOfferings"]))


def _spot_price(ec2: Any, name: str) -> float | None:
    history = ec2.describe_spot_price_history(InstanceTypes=[name], ProductDescriptions=["Linux/UNIX"],
                                              MaxResults=20)["SpotPriceHistory"]
    prices = [float(h["SpotPrice"]) for h in history]
    return round(sum(prices) / len(prices), 4) if prices else None


def _on_demand_price(pricing: Any, name: str, region: str) -> float | None:
    filters = [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in (
        ("instanceType", name), ("regionCode", region), ("operatingSystem", "Linux"), ("tenancy", "Shared"),
        ("preInstalledSw", "NA"), ("capacitystatus", "Used"))]
    for item in pricing.get_products(ServiceCode="AmazonEC2", Filters=filters, MaxResults=1)["PriceList"]:
        for term in json.loads(item)["terms"].get("OnDemand", {}).values():
            for dimension in term["priceDimensions"].values():
                return float(dimension["pricePerUnit"]["USD"])
    return None


def refresh_aws(regions: tuple[str, ...] | None = None, refreshed: Path | None = None,
                pricing: bool = True) -> Path:
    """Writes the refreshed AWS part next to the workspace (see infra.compute.catalog.refreshed_dir) and returns
    its path."""
    shipped = {i.name: i for i in shipped_catalog().for_provider("aws")}
    regions = regions or tuple(sorted({r for i in shipped.values() for r in i.regions}))
    session = boto3.session.Session()
    price_list = session.client("pricing", region_name="us-east-1") if pricing else None
    described: dict[str, dict[str, Any]] = {}
    offers: dict[str, dict[str, RegionOffer]] = {name: {} for name in shipped}
    for region in regions:
        ec2 = session.client("ec2", region_name=region)
        for page in ec2.get_paginator("describe_instance_types").paginate(InstanceTypes=sorted(shipped)):
            described.update({t["InstanceType"]: t for t in page["InstanceTypes"]})
        for name, item in shipped.items():
            zones = _zones(ec2, name)
            if not zones:
                continue
            old = item.regions.get(region)
            spot = _spot_price(ec2, name)
            on_demand = _on_demand_price(price_list, name, region) if price_list else None
            offers[name][region] = RegionOffer(
                on_demand=on_demand or (old.on_demand if old else None), spot=spot or (old.spot if old else None),
                zones=zones, source="; ".join([
                    "on-demand: AWS Price List API" if on_demand else "on-demand: shipped catalog",
                    "spot: EC2 spot price history (mean of recent)" if spot else "spot: shipped catalog estimate",
                ]))
    instances = []
    for name, item in shipped.items():
        priced = {r: o for r, o in offers[name].items() if o.on_demand or o.spot}
        if name not in described or not priced:
            log.warning("catalog refresh: %s is not offered in %s: keeping it out", name, ", ".join(regions))
            continue
        instances.append(InstanceType(provider="aws", name=name, regions=priced,
                                      **hardware(described[name], item)))
    part = CatalogFile(generated_at=datetime.now(UTC).isoformat(timespec="seconds"), instances=tuple(instances))
    return write_provider_part("aws", part, refreshed)


def refresh_errors() -> tuple[type[Exception], ...]:
    return (ClientError, BotoCoreError)
