"""The optimizer, table-driven: floors that exclude types, price caps, region and zone limits, spot ordering."""

from __future__ import annotations

import pytest

from infra.compute.catalog import Catalog, InstanceType, RegionOffer, shipped_catalog
from infra.compute.optimizer import NoCandidateError, candidates
from infra.compute.spec import ClusterSpec

GB = 10**9


def instance(name: str, acc: str | None, gpus: int, gbps: float, nvme: int, regions: dict[str, RegionOffer],
             gpu_gb: float = 80) -> InstanceType:
    return InstanceType(provider="aws", name=name, accelerator=acc, gpus=gpus, gpu_memory_gb=gpu_gb, vcpus=96,
                        memory_gb=1000, network_gbps=gbps, network_kind="efa" if gbps >= 100 else "ethernet",
                        local_nvme_bytes=nvme * 1000 * GB, local_nvme_count=nvme, regions=regions, source="test table")


def offer(od: float | None, spot: float | None, *zones: str) -> RegionOffer:
    return RegionOffer(on_demand=od, spot=spot, zones=zones, source="test table")


CATALOG = Catalog((
    instance("big-h100", "H100", 8, 3200, 8, {"r1": offer(100, 40, "r1a", "r1b"), "r2": offer(90, None, "r2a")}),
    instance("mid-a100", "A100", 8, 400, 8, {"r1": offer(30, 12, "r1a"), "r3": offer(28, 20, "r3a")}),
    instance("a100-40", "A100", 8, 400, 8, {"r1": offer(25, 10, "r1a")}, gpu_gb=40),
    instance("slow-h100", "H100", 8, 50, 0, {"r1": offer(60, 25, "r1a")}),
    instance("small-l4", "L4", 4, 40, 1, {"r1": offer(5, 2, "r1a"), "r2": offer(4.5, 1.5)}, gpu_gb=24),
))


def spec(**fields) -> ClusterSpec:
    return ClusterSpec(provider="aws", nodes=2, **fields)


def order(**fields) -> list[str]:
    return [f"{c.instance_type}@{c.zone or c.region}/{c.market}" for c in candidates(spec(**fields), CATALOG, 10.0)]


@pytest.mark.parametrize(("fields", "expected"), [
    # Network floor drops slow-h100; spot never: on-demand only, cheapest job first; zones expand per region.
    ({"accelerator": "H100", "procs_per_node": 8, "min_network_gbps": 100},
     ["big-h100@r2a/on-demand", "big-h100@r1a/on-demand", "big-h100@r1b/on-demand"]),
    # prefer: every spot candidate before any on-demand one; r2 sells no spot, so it appears only on-demand.
    ({"accelerator": "H100", "procs_per_node": 8, "min_network_gbps": 100, "spot": "prefer"},
     ["big-h100@r1a/spot", "big-h100@r1b/spot", "big-h100@r2a/on-demand", "big-h100@r1a/on-demand",
      "big-h100@r1b/on-demand"]),
    ({"accelerator": "H100", "procs_per_node": 8, "spot": "only", "zones": ("r1b",)}, ["big-h100@r1b/spot"]),
    # A memory suffix excludes the 40 GB A100; the region limit drops r3.
    ({"accelerator": "A100-80GB", "regions": ("r1",)}, ["mid-a100@r1a/on-demand"]),
    # Price cap: $/hour for the whole cluster (2 nodes): 2×28 = 56 fits, 2×30 = 60 does not.
    ({"accelerator": "A100-80GB", "max_price_per_hour": 58}, ["mid-a100@r3a/on-demand"]),
    # Region preference breaks ties only; price wins first.
    ({"accelerator": "A100", "spot": "only"}, ["a100-40@r1a/spot", "mid-a100@r1a/spot", "mid-a100@r3a/spot"]),
    # A region without zones in the catalog leaves the zone to the provider.
    ({"accelerator": "L4", "procs_per_node": 4, "local_nvme": True},
     ["small-l4@r2/on-demand", "small-l4@r1a/on-demand"]),
    ({"instance_type": "slow-h100", "spot": "only"}, ["slow-h100@r1a/spot"]),
])
def test_candidates_in_order(fields: dict, expected: list[str]) -> None:
    assert order(**fields) == expected


@pytest.mark.parametrize(("fields", "message"), [
    ({"accelerator": "H100", "min_network_gbps": 5000},
     "cluster.min_network_gbps: no aws instance type meets 5000 Gbps; closest: big-h100 (3200 Gbps efa): "
     "lower min_network_gbps"),
    ({"accelerator": "B200"}, "cluster.accelerator: no aws instance type meets accelerator B200; closest: big-h100"),
    ({"accelerator": "L4", "procs_per_node": 8}, "cluster.procs_per_node: no aws instance type meets 8 GPUs per node; "
                                                 "closest: small-l4 (4 GPUs)"),
    ({"accelerator": "H100", "min_network_gbps": 10, "local_nvme": True, "regions": ("r2",), "spot": "only"},
     "cluster.spot: no aws instance type meets a known price on the chosen market; closest: big-h100 (no price for "
     "spot)"),
    ({"accelerator": "A100-80GB", "max_price_per_hour": 50},
     "cluster.max_price_per_hour: no aws instance type meets at most $50.0/hour for 2 nodes; closest: mid-a100 "
     "($56.00/hour for 2 nodes in r3): raise max_price_per_hour"),
    ({"accelerator": "H100", "regions": ("r9",)}, "cluster.regions: no aws instance type meets a region in r9"),
    ({"instance_type": "p9.huge"}, "cluster.instance_type: no aws instance type meets instance type 'p9.huge'"),
])
def test_a_floor_no_instance_meets_names_the_floor_and_the_closest(fields: dict, message: str) -> None:
    with pytest.raises(NoCandidateError) as caught:
        candidates(spec(**fields), CATALOG, 1.0)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_cost_estimate_is_price_times_nodes_times_hours() -> None:
    [first, *_] = candidates(spec(accelerator="A100-80GB", regions=("r3",)), CATALOG, 10.0)
    assert (first.cluster_per_hour, first.job_cost) == (56.0, 560.0)


def test_shipped_catalog_finds_4x8_h100_with_efa_and_nvme() -> None:
    job = ClusterSpec(provider="aws", nodes=4, procs_per_node=8, accelerator="H100", min_network_gbps=100,
                      local_nvme=True, spot="prefer", regions=("us-east-1",))
    found = candidates(job, shipped_catalog(), 2.0)
    assert {c.instance_type for c in found} == {"p5.48xlarge"}
    assert [c.spot for c in found] == sorted((c.spot for c in found), reverse=True)
    assert all(c.efa_interfaces == 32 and c.zone and c.zone.startswith("us-east-1") for c in found)


def test_plan_prints_the_candidate_table_and_a_missed_floor_exits_2(workspace, tmp_path) -> None:
    from jobs import job_config, make_dataset, write_config
    from typer.testing import CliRunner

    from trainpipe.cli import app

    config = job_config(tmp_path, make_dataset(tmp_path / "ds", tokens=20_000, shard_tokens=10_000), timeout_s=7200)
    config["cluster"] = {"provider": "aws", "nodes": 4, "procs_per_node": 8, "accelerator": "H100",
                         "min_network_gbps": 100, "local_nvme": True, "spot": True, "regions": ["us-east-1"]}
    result = CliRunner().invoke(app, ["plan", str(write_config(tmp_path / "job.yaml", config))])
    assert result.exit_code == 0, result.output
    # spot: true means prefer: the spot rows come first; the job costs at most 2 h (timeout_s) × 4 nodes × price.
    assert "candidates: 6, cheapest p5.48xlarge us-east-1a spot — job ≤ $304.00 ($152.00/h × 2 h" in result.output
    rows = [line.split() for line in result.output.splitlines() if "p5.48xlarge" in line and "Gbps" in line]
    assert [(r[2], r[3]) for r in rows] == [(z, m) for m in ("spot", "on-demand")
                                            for z in ("us-east-1a", "us-east-1b", "us-east-1c")]

    config["cluster"]["min_network_gbps"] = 5000
    result = CliRunner().invoke(app, ["plan", str(write_config(tmp_path / "job.yaml", config))])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("error: cluster.min_network_gbps: no aws instance type meets 5000 Gbps; closest: "
                                     "p5.48xlarge (3200 Gbps efa): lower min_network_gbps")
