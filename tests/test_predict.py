"""The what-if predictor on synthetic step breakdowns, table-driven: each row is one formula of
infra.analysis.predict."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from infra.analysis.breakdown import StepBreakdown
from infra.analysis.predict import (
    FANOUT_LABEL,
    GBIT,
    LOCAL_NVME_LABEL,
    LOCAL_READ_LATENCY_S,
    MB,
    REPLACE_LABEL,
    Hardware,
    Job,
    Prediction,
    Target,
    catalog_targets,
    cheapest_meeting,
    predict,
    recovery,
    staging_time,
    what_if,
)
from infra.analysis.predict_report import facts_from_summary
from infra.compute.catalog import load_catalog
from infra.compute.spec import ClusterSpec
from trainpipe.cli import app

MEASURED = Hardware(network_gbps=10, store_gbps=8, local_disk_read_mb_s=1000, local_disk_write_mb_s=500,
                    label="as measured")
JOB = Job(steps=1000, dataset_bytes=4 * 10**9)


def breakdown(**fields: Any) -> StepBreakdown:
    """100 steps of 0.5 s: compute 20 s, exposed all-reduce 20 s (no overlap), sync 1 s, data 5 s, checkpoints 4 s."""
    base: dict[str, Any] = dict(
        steps=100, wall_s=50.0, comm_exposed_s=20.0, comm_total_s=20.0, sync_wait_s=1.0, data_wait_s=5.0,
        ckpt_block_s=4.0, allreduce_bytes=10**9, read_bytes=10**9, read_requests=1000, ckpt_bytes=2 * 10**9,
        ckpt_saves=4, world_size=2, nodes=2)
    return StepBreakdown(**{**base, **fields})


def on(b: StepBreakdown, staged: bool = False, price: float | None = None, **hardware: Any) -> Prediction:
    return predict(b, MEASURED, Target(replace(MEASURED, label="target", **hardware), price, staged=staged), JOB)


@pytest.mark.parametrize(("factor", "exposed"), [(1, 20.0), (2, 10.0), (10, 2.0), (0.5, 40.0)])
def test_without_overlap_the_exposed_term_scales_with_bandwidth(factor: float, exposed: float) -> None:
    p = on(breakdown(), network_gbps=MEASURED.network_gbps * factor)
    assert p.step.comm_exposed_s == pytest.approx(exposed)
    assert p.step_s == pytest.approx((50.0 - 20.0 + exposed) / 100)
    assert p.step.sync_wait_s == 1.0  # latency and waiting for peers: no bandwidth in it


@pytest.mark.parametrize(("total", "exposed", "factor", "speedup", "predicted"), [
    (20.0, 5.0, 2, 1.0, 0.0),  # total' 10 < hidden 15: fully hidden behind backward
    (20.0, 5.0, 1.25, 1.0, 1.0),  # total' 16 − hidden 15
    (20.0, 12.0, 2, 1.0, 2.0),  # total' 10 − hidden 8
    (20.0, 5.0, 2, 3.0, 5.0),  # 3× faster compute leaves a 5 s window: total' 10 − 5
])
def test_with_overlap_exposed_is_what_the_backward_no_longer_hides(total: float, exposed: float, factor: float,
                                                                   speedup: float, predicted: float) -> None:
    b = breakdown(comm_total_s=total, comm_exposed_s=exposed)
    p = on(b, network_gbps=MEASURED.network_gbps * factor, compute_speedup=speedup)
    assert p.step.comm_exposed_s == pytest.approx(predicted)
    assert p.step.t_compute == pytest.approx(b.t_compute / speedup)


@pytest.mark.parametrize("b", [
    breakdown(),
    breakdown(comm_exposed_s=3.0, comm_total_s=18.0),
    breakdown(data_source="remote", read_latency_s=0.002, data_wait_s=12.0, wall_s=57.0),
    breakdown(ckpt_mode="direct", ckpt_upload_wait_s=3.0),
    breakdown(ckpt_mode="sync"),
    breakdown(data_source="remote", read_latency_s=0.02, data_wait_s=5.0),  # latency mostly hidden by prefetch
], ids=["local-async", "overlap", "remote", "direct", "sync", "prefetch"])
def test_as_measured_reproduces_the_measurement(b: StepBreakdown) -> None:
    p = what_if(b, MEASURED, JOB)[0]
    assert p.label == "as measured"
    assert p.step_s == pytest.approx(b.wall_s / b.steps, rel=1e-9)
    for name, value in b.terms().items():
        assert p.step.terms()[name] == pytest.approx(value, rel=1e-9)
    assert p.speedup == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize(("data_wait", "latency", "store_factor", "request_latency", "predicted"), [
    (12.0, 0.002, 10, None, 2.0 + 1.0),  # latency part 1000 × 2 ms stays, bandwidth part 10 s → 1 s
    (12.0, 0.002, 1, None, 12.0),
    (12.0, 0.002, 0.5, None, 2.0 + 20.0),
    (12.0, 0.002, 10, 0.001, 1.0 + 1.0),  # a target with half the request latency halves the latency part
    (1.5, 0.002, 10, None, 1.5),  # prefetch hid latency: all of the wait is latency, bandwidth buys nothing
])
def test_remote_reads_scale_only_their_bandwidth_part(data_wait: float, latency: float, store_factor: float,
                                                      request_latency: float | None, predicted: float) -> None:
    b = breakdown(data_source="remote", read_latency_s=latency, data_wait_s=data_wait, wall_s=45.0 + data_wait)
    p = on(b, store_gbps=MEASURED.store_gbps * store_factor, request_latency_s=request_latency)
    assert p.step.data_wait_s == pytest.approx(predicted)
    assert p.staging_s == 0.0  # nothing staged: reads stay remote


def test_local_nvme_scenario_stages_reads_locally_and_checkpoints_async() -> None:
    b = breakdown(data_source="remote", ckpt_mode="direct", read_latency_s=0.002, data_wait_s=12.0,
                  ckpt_block_s=10.0, ckpt_upload_wait_s=8.0, wall_s=58.0, world_size=4)
    p = next(p for p in what_if(b, MEASURED, JOB) if p.label == LOCAL_NVME_LABEL)
    # 2 ranks per node share the disk: each rank's bytes take twice a lone rank's time.
    assert p.step.data_wait_s == pytest.approx(1000 * LOCAL_READ_LATENCY_S + 10**9 * 2 / (1000 * MB))
    assert p.step.ckpt_block_s == pytest.approx(2 * 10**9 / 10e9)  # the copy into host memory only
    assert (p.step.data_source, p.step.ckpt_mode) == ("local", "async")
    assert p.staging_s == pytest.approx(JOB.dataset_bytes / (8 * GBIT))
    assert p.flush_s == pytest.approx(2 * 10**9 / 4 / (8 * GBIT))  # one checkpoint's share of the node
    assert p.job_s == pytest.approx(JOB.steps * p.step_s + p.staging_s + p.flush_s)
    measured = what_if(b, MEASURED, JOB)[0]
    assert measured.flush_s == 0.0  # direct: every upload already blocked training
    assert p.speedup > 1


# The bench's netns cluster: store link 0.4 Gbit/s shared by the nodes, node links 2 Gbit/s; 128 MB replicated.
BENCH = Hardware(network_gbps=2.0, store_gbps=2.0, store_egress_gbps=0.4, local_disk_read_mb_s=1000)


@pytest.mark.parametrize(("nodes", "off_s", "on_s"), [
    (1, 2.56, 2.56),  # nothing to exchange
    (2, 5.12, 2.56),  # off: 2 × 128 MB through the store's 50 MB/s; on: once, the exchange (0.5 s) overlaps it
    (4, 10.24, 2.56),
    (64, 163.84, 2.56),
])
def test_staging_time_fan_out_reads_the_shared_store_once(nodes: int, off_s: float, on_s: float) -> None:
    assert staging_time(128 * 10**6, nodes, BENCH, fanout=False) == pytest.approx(off_s)
    assert staging_time(128 * 10**6, nodes, BENCH, fanout=True) == pytest.approx(on_s)


def test_staging_time_fan_out_is_bound_by_the_node_links_when_they_are_slower() -> None:
    slow_nodes = replace(BENCH, network_gbps=0.1, store_egress_gbps=None)  # each node reads the store at 2 Gbit/s
    assert staging_time(128 * 10**6, 4, slow_nodes, fanout=False) == pytest.approx(0.512)
    # Every node takes the whole dataset in over its 0.1 Gbit/s link: slower than each reading the store itself.
    assert staging_time(128 * 10**6, 4, slow_nodes, fanout=True) == pytest.approx(10.24)


def test_fan_out_scenario_stages_faster_on_more_than_one_node() -> None:
    b = breakdown(data_source="remote", nodes=4, world_size=4)
    rows = {p.label: p for p in what_if(b, BENCH, JOB)}
    assert rows[FANOUT_LABEL].staging_s == pytest.approx(JOB.dataset_bytes / (0.4 * GBIT))
    assert rows[LOCAL_NVME_LABEL].staging_s == pytest.approx(4 * JOB.dataset_bytes / (0.4 * GBIT))
    assert rows[FANOUT_LABEL].job_s < rows[LOCAL_NVME_LABEL].job_s
    assert FANOUT_LABEL not in {p.label for p in what_if(breakdown(nodes=1, world_size=1), BENCH, JOB)}


def test_replace_one_fills_the_new_node_from_its_peers_and_reads_only_the_lost_part_from_the_store() -> None:
    b = breakdown(data_source="remote", nodes=4, world_size=4)  # 2 GB of checkpoints in 4 saves: 0.5 GB per node
    rows = {p.label: p for p in what_if(b, BENCH, JOB)}
    whole, fanout, one = rows[LOCAL_NVME_LABEL], rows[FANOUT_LABEL], rows[REPLACE_LABEL]
    needed = JOB.dataset_bytes + 4 * 5 * 10**8  # every node holds the dataset and the whole checkpoint again
    # The whole relaunch: new machines staged and restored through the store's shared 0.4 Gbit/s, per node or once.
    assert whole.recovery_store_bytes == 4 * needed
    assert whole.recovery_s == pytest.approx(4 * needed / (0.4 * GBIT))
    assert fanout.recovery_store_bytes == needed
    assert fanout.recovery_s == pytest.approx(needed / (0.4 * GBIT))
    # Replace-one: the new node's 2 Gbit/s link carries it all from its peers, the lost node's own checkpoint part
    # from its ring neighbour's replica: the store sends nothing.
    assert one.recovery_store_bytes == 0
    assert one.recovery_s == pytest.approx(needed / (2 * GBIT))
    # Without replicas that part (0.5 GB) is the store's only share, read once at the whole 0.4 Gbit/s while the
    # peers send.
    bare = recovery(JOB.dataset_bytes, 5 * 10**8, 4, BENCH, fanout=True, replace_nodes=True, peer_replica=False)
    assert bare.store_bytes == 5 * 10**8
    assert bare.seconds == pytest.approx(needed / (2 * GBIT))
    assert one.recovery_s < fanout.recovery_s / 4
    assert one.job_s == pytest.approx(fanout.job_s), "replacing one node changes recoveries, not training"
    assert REPLACE_LABEL not in {p.label for p in what_if(breakdown(nodes=1, world_size=1), BENCH, JOB)}
    # A measured run reading remotely stages nothing: its recoveries only restore the checkpoint.
    assert rows["as measured"].recovery_store_bytes == 4 * 4 * 5 * 10**8


def test_replace_one_on_a_single_node_is_the_whole_relaunch() -> None:
    assert recovery(10**9, 10**8, 1, BENCH, fanout=True, replace_nodes=True) == recovery(
        10**9, 10**8, 1, BENCH, fanout=False, replace_nodes=False)


def test_staged_data_without_local_disk_reads_remotely() -> None:
    p = on(breakdown(), local_disk_read_mb_s=None, local_disk_write_mb_s=None)
    assert p.step.data_source == "remote"
    assert p.step.data_wait_s == pytest.approx(1000 * 0.02 + 10**9 / (8 * GBIT))
    assert any("no local NVMe" in note for note in p.notes)
    with pytest.raises(ValueError, match="no local disk"):
        on(breakdown(), staged=True, local_disk_read_mb_s=None)


def hand_made(b: StepBreakdown) -> list[Prediction]:
    rows = [("slow-cheap", 10, 5.0), ("mid", 40, 20.0), ("fast-dear", 400, 100.0), ("no-price", 400, None)]
    targets = [Target(replace(MEASURED, network_gbps=gbps, label=label), price) for label, gbps, price in rows]
    return [p for p in what_if(b, MEASURED, JOB, targets=targets) if p.kind == "candidate"]


@pytest.mark.parametrize(("deadline_h", "chosen"), [
    (None, "slow-cheap"), (0.15, "slow-cheap"), (0.12, "mid"), (0.09, "fast-dear"), (0.08, None),
])
def test_cheapest_meeting_the_deadline(deadline_h: float | None, chosen: str | None) -> None:
    predictions = hand_made(breakdown())
    by_label = {p.label: p for p in predictions}
    assert by_label["slow-cheap"].cost_usd == pytest.approx(by_label["slow-cheap"].job_s / 3600 * 5.0)
    assert by_label["no-price"].cost_usd is None
    # Jobs: 1000 steps of 0.5 / 0.35 / 0.305 s + 4 s staging + 0.5 s final flush = 0.140 / 0.098 / 0.086 h.
    choice = cheapest_meeting(predictions, deadline_h * 3600 if deadline_h is not None else float("inf"))
    assert (choice.prediction.label if choice.prediction else None) == chosen
    if chosen is None:
        assert choice.reason.startswith("none meets the deadline 0.08 h: the fastest, fast-dear, takes 0.09 h")
    else:
        assert choice.reason.startswith(f"{chosen}: ")


def test_cheapest_meeting_without_prices_says_so() -> None:
    unpriced = [p for p in hand_made(breakdown()) if p.label == "no-price"]
    assert cheapest_meeting(unpriced, 3600).reason == "none: no candidate has a price (deadline 1.00 h)"


@pytest.mark.parametrize(("spec", "expected"), [
    (ClusterSpec(provider="aws", nodes=2, accelerator="H100", procs_per_node=8), {"aws/p5.48xlarge us-east-1"}),
    (ClusterSpec(provider="gcp", nodes=4, accelerator="A100"), {"gcp/a2-highgpu-8g europe-west4",
                                                                "gcp/a2-ultragpu-8g europe-west4"}),
    (ClusterSpec(provider="aws", nodes=2), {"aws/p4d.24xlarge us-east-1", "aws/g6.12xlarge us-east-1"}),
])
def test_catalog_candidates_are_predicted_and_priced(workspace: Path, spec: ClusterSpec, expected: set[str]) -> None:
    catalog = load_catalog()
    targets = catalog_targets(catalog, spec)
    predictions = [p for p in what_if(breakdown(), MEASURED, JOB, targets=targets) if p.kind == "candidate"]
    assert expected <= {p.label for p in predictions}
    assert len(predictions) == len({p.label.split()[0] for p in predictions})  # one row per instance type
    for p in predictions:
        instance = catalog.get(*p.label.split()[0].split("/"))
        assert instance is not None
        cheapest = min(o.on_demand for o in instance.regions.values() if o.on_demand)
        assert p.price_per_hour == pytest.approx(cheapest * spec.nodes)
        assert p.cost_usd is not None and p.cost_usd > 0
        assert p.hardware.network_gbps == instance.network_gbps
        assert p.hardware.store_gbps == min(instance.network_gbps, 100.0)
        assert "compute assumed as measured (give the target's compute speedup to change it)" in p.notes


def summary(**fields: Any) -> dict[str, Any]:
    b = breakdown(comm_exposed_s=30.0, comm_total_s=30.0, wall_s=50.0, data_wait_s=2.0, ckpt_block_s=1.0)
    bench = {"mode": "warn", "measurement": {
        "nodes": 2, "instance_type": None,
        "links": [{"src": "n0", "dst": "n1", "gbps": 9.5}, {"src": "n1", "dst": "n0", "gbps": 7.5}],
        "disks": [{"node": "n0", "read_mb_per_s": 900.0, "write_mb_per_s": 450.0},
                  {"node": "n1", "read_mb_per_s": 800.0, "write_mb_per_s": 500.0}]}}
    return {"run_id": "r1", "provider": "local", "nodes": 2, "steps": 100, "price_per_hour": 0.0,
            "breakdown": b.summary(), "cluster_bench": bench,
            "stage": {"bytes": 10**9, "skipped_bytes": 0, "mb_per_s": 250.0, "seconds": 4.0}, **fields}


def test_measured_figures_come_from_the_slowest_link_disk_and_staging() -> None:
    facts = facts_from_summary(summary(), "summary.json", steps=5000)
    assert (facts.measured.network_gbps, facts.measured.store_gbps) == (7.5, pytest.approx(2.0))
    assert (facts.measured.local_disk_read_mb_s, facts.measured.local_disk_write_mb_s) == (800.0, 450.0)
    assert facts.job == Job(5000, 10**9)
    bare = facts_from_summary(summary(cluster_bench={"mode": "off"}, stage={}), "summary.json")
    assert bare.measured.network_gbps == 10.0 and bare.measured.store_gbps == 10.0
    assert any("default" in line for line in bare.sources)


def test_cli_prints_the_breakdown_the_table_and_the_cheapest(tmp_path: Path, workspace: Path) -> None:
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary()))
    result = CliRunner().invoke(app, ["predict", str(path), "--deadline-h", "1", "--steps", "10000"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "network-bound: 62% of step time in exposed all-reduce and sync" in out
    for row in ("as measured", "2× network", LOCAL_NVME_LABEL, "aws/p5.48xlarge us-east-1",
                "gcp/a3-highgpu-8g europe-west4"):
        assert f"\n{row} " in out
    assert "step s" in out and "cost $" in out
    assert "compute assumed as measured" in out
    assert "cheapest meeting the deadline: " in out
    run = workspace / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(summary()))
    as_json = CliRunner().invoke(app, ["predict", "r1", "--json", "--provider", "aws"])
    assert as_json.exit_code == 0, as_json.output
    report = json.loads(as_json.stdout)
    assert report["predictions"][0]["label"] == "as measured"
    assert {p["label"].split("/")[0] for p in report["predictions"] if p["kind"] == "candidate"} == {"aws"}
    assert report["cheapest"]["label"] is not None


@pytest.mark.parametrize(("stored", "line"), [
    ({}, "no step breakdown: the run did not finish training with a trainer that reports one; rerun it"),
    ({"steps": 3}, "its step breakdown cannot be read ("),
])
def test_cli_without_a_breakdown_exits_2_with_one_line(tmp_path: Path, stored: dict[str, Any], line: str) -> None:
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary(breakdown=stored)))
    result = CliRunner().invoke(app, ["predict", str(path)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {path}: {line}")
    assert len(result.stderr.strip().splitlines()) == 1


# Two buckets as DDP makes them for a 6.9 MB model at 100 Mbit/s: a small first bucket (launched when the last
# layers' gradients are ready) and the rest 35 ms later, when backward has computed everything.
BUCKETS = ((0.0, 0.089, 1e6), (0.035, 0.525, 5.9e6))


@pytest.mark.parametrize(("factor", "speedup", "residual", "exposed_per_step"), [
    (1, 1.0, 0.0, 0.579),    # as measured: 0.089 + 0.525 − 0.035
    (10, 1.0, 0.0, 0.0525),  # the first bucket now ends before the second is launched: only the second is exposed
    (2, 1.0, 0.0, 0.272),    # the first bucket (44.5 ms) still delays the second: 0.0445 + 0.2625 − 0.035
    (10, 1.0, 0.004, 0.0565),  # the tail the replay does not explain is kept as measured
    (1, 5.0, 0.0, 0.607),    # 5× faster backward: the second bucket is launched at 7 ms, 0.614 − 0.007
])
def test_a_bucket_profile_is_replayed_at_the_target_bandwidth(factor: float, speedup: float, residual: float,
                                                             exposed_per_step: float) -> None:
    b = breakdown(comm_buckets=BUCKETS, comm_exposed_s=100 * (0.579 + residual), comm_total_s=100 * 0.614,
                  wall_s=50.0 + 100 * (0.579 + residual) - 20.0)
    p = on(b, network_gbps=MEASURED.network_gbps * factor, compute_speedup=speedup)
    assert p.step.comm_exposed_s / 100 == pytest.approx(exposed_per_step, abs=1e-9)
    assert p.step.comm_total_s == pytest.approx(100 * 0.614 / factor)
