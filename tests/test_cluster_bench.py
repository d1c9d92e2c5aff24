"""The verify stage's cluster bench, for real on 2 local nodes: TCP between them, all-reduce over gloo, O_DIRECT disk,
the verdict against the job's floors and the catalog, and `trainpipe bench cluster` leaving nothing behind."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, TRAINPIPE
from jobs import job_config, write_config
from test_pipeline_e2e import tagged_processes

import tasks.verify
from infra.analysis import clusterbench
from infra.analysis.clusterbench import (
    AllReduceFigure,
    BenchResult,
    ClusterMeasurement,
    DiskFigure,
    LinkFigure,
    Verdict,
    VerifyBench,
    compare,
    link_batches,
)
from infra.compute.access.remote import LocalRunner
from infra.compute.catalog import shipped_catalog
from infra.compute.providers import Cluster, Provider, get_provider
from infra.compute.spec import ClusterSpec
from infra.job.plan import cluster_candidates
from infra.job.spec import JobSpec, parse_job
from infra.job.summary import RunSummary
from infra.node import diskbench

QUICK = {"tcp_seconds": 1, "tcp_streams": 2, "allreduce_sizes_mb": [1, 4], "disk_bytes_mb": 16}
IMPOSSIBLE_GBPS = 100000


def bench_config(tmp: Path, **cluster: Any) -> dict[str, Any]:
    config = job_config(tmp, f"file://{tmp}/dataset")
    config["cluster"].update(cluster)
    return config


# -- the measurements and the task's error path, on 2 local nodes --------------------------------------------


def bench_task_failure(job: JobSpec, provider: Provider, cluster: Cluster,
                       monkeypatch: pytest.MonkeyPatch) -> tasks.verify.ClusterBenchError:
    """The verify task's bench on a launched cluster, which must fail; the cluster is torn down either way."""
    monkeypatch.setattr(tasks.verify, "get_run_logger", lambda: logging.getLogger("test.verify"))
    try:
        with pytest.raises(tasks.verify.ClusterBenchError) as caught:
            tasks.verify.bench_cluster.fn(job, cluster)
    finally:
        provider.terminate(cluster.name)
    return caught.value


def test_bench_fail_with_an_unreachable_floor_names_each_missed_figure(
        workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = parse_job(bench_config(tmp_path, min_network_gbps=IMPOSSIBLE_GBPS,
                                 verify={**QUICK, "bench": "fail", "measure": "all"}))
    assert cluster_candidates(job) == (), "the local provider is not planned from the catalog: the floor passes plan"
    provider = get_provider("local")
    cluster = provider.launch("tp-bench-fail", job.cluster, "bench-fail")
    results: list[clusterbench.BenchResult] = []
    measure = clusterbench.bench_cluster

    def keep(*args: Any, **kwargs: Any) -> clusterbench.BenchResult:
        results.append(measure(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(clusterbench, "bench_cluster", keep)
    error = bench_task_failure(job, provider, cluster, monkeypatch)

    measured = results[0].measurement
    [link] = measured.links
    assert (link.src, link.dst, link.streams) == ("node-0", "node-1", 2)
    assert link.gbps > 0 and link.receiver_gbps > 0 and link.bytes > 0
    assert [a.size_bytes for a in measured.allreduce] == [2**20, 4 * 2**20]
    for figure in measured.allreduce:
        assert (figure.backend, figure.world_size) == ("gloo", 2) and figure.iters >= 3
        assert figure.busbw_gb_per_s > 0 and figure.busbw_gb_per_s == pytest.approx(figure.algbw_gb_per_s, rel=1e-3)
    assert [d.node for d in measured.disks] == ["node-0", "node-1"]
    assert all(d.write_mb_per_s > 0 and d.read_mb_per_s > 0 and d.bytes == 16 * 2**20 for d in measured.disks)

    lines = str(error).splitlines()
    assert len(lines) == 3, lines  # the heading, the one missed figure (the only link), the way to train anyway
    assert lines[1].startswith(f"tcp node-0 → node-1: {link.gbps:.4g} Gbit/s measured vs 1e+05 Gbit/s expected "
                               "(job floor cluster.min_network_gbps): below 80% of it: pick another instance type")
    assert "cluster.verify.bench: warn" in lines[2]
    assert not tagged_processes(workspace), "bench processes outlived the cluster"


def _recording(method: Any, commands: list[list[str]]) -> Any:
    def record(self: LocalRunner, argv: list[str], *args: Any, **kwargs: Any) -> Any:
        commands.append(list(argv))
        return method(self, argv, *args, **kwargs)
    return record


def test_a_local_job_without_floors_spends_no_time_on_the_bench(
        workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = parse_job(bench_config(tmp_path, verify={**QUICK, "bench": "fail"}))
    monkeypatch.setattr(tasks.verify, "get_run_logger", lambda: logging.getLogger("test.verify"))
    provider = get_provider("local")
    # Every command the bench would run on a node goes through the node's runner: count them (they still run).
    commands: list[list[str]] = []
    for method in ("start", "run"):
        monkeypatch.setattr(LocalRunner, method, _recording(getattr(LocalRunner, method), commands))
    cluster = provider.launch("tp-bench-none", job.cluster, "bench-none")
    try:
        result = tasks.verify.bench_cluster.fn(job, cluster).to_dict()
    finally:
        provider.terminate(cluster.name)
    measured = result["measurement"]
    assert not (measured["links"] or measured["allreduce"] or measured["disks"])
    assert result["verdict"]["ok"] and commands == [], "figures reported only were measured"


def test_bench_off_measures_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = parse_job(bench_config(tmp_path, verify={"bench": "off"}))
    monkeypatch.setattr(tasks.verify, "get_run_logger", lambda: logging.getLogger("test.verify"))
    never_launched = Cluster(name="tp-never", provider="local", run_id="never", nodes=(), created_at=0.0)
    assert tasks.verify.bench_cluster.fn(job, never_launched).to_dict() == {"mode": "off"}


def test_the_summary_writes_the_bench_record_as_its_cluster_bench_section_and_reads_it_back() -> None:
    links = (LinkFigure("node-0", "node-1", 9.5, 4, 10**9, 1.0, 9.4),
             LinkFigure("node-1", "node-2", 3.5, 4, 10**9, 1.0, 3.4))
    measured = ClusterMeasurement(nodes=3, instance_type=None, links=links, allreduce=(), disks=())
    result = BenchResult(measured, Verdict(checks=()), catalog_key=None)
    for bench, section in ((None, {}), (VerifyBench("off"), {"mode": "off"}),
                           (VerifyBench("warn", result), {"mode": "warn", **result.to_dict()})):
        summary = RunSummary(run_id="r", job="j", provider="local", nodes=3, cluster_bench=bench)
        written = json.loads(json.dumps(summary.to_dict()))
        assert written["cluster_bench"] == json.loads(json.dumps(section))
        back = RunSummary.from_dict(written)
        assert json.loads(json.dumps(back.to_dict())) == written
        expected = None if bench is None or bench.result is None else 3.5
        assert (bench.slowest_link_gbps if bench else None) == expected
        assert (back.cluster_bench.slowest_link_gbps if back.cluster_bench else None) == expected


# -- compare: what each figure is held to ---------------------------------------------------------------------


def _measured(tcp_gbps: float = 10.0, busbw_gb_per_s: float = 5.0, write: float = 1000.0,
              read: float = 2000.0) -> ClusterMeasurement:
    return ClusterMeasurement(
        nodes=2, instance_type="t",
        links=(LinkFigure("node-0", "node-1", tcp_gbps, 4, 10**9, 1.0, tcp_gbps),),
        allreduce=(AllReduceFigure(2**20, 2, "nccl", 20, 1.0, 1.0, 1.0),
                   AllReduceFigure(64 * 2**20, 2, "nccl", 20, 1.0, busbw_gb_per_s, busbw_gb_per_s)),
        disks=(DiskFigure("node-0", write, read, 2**28, True, None),))


G5 = shipped_catalog().get("aws", "g5.12xlarge")  # 40 Gbps ethernet
P4D = shipped_catalog().get("aws", "p4d.24xlarge")  # 400 Gbps EFA, 8 GPUs


@pytest.mark.parametrize(("cluster", "entry", "expected"), [
    ({}, None, clusterbench.Figures(tcp=False, allreduce=False, disk=False)),
    ({"min_network_gbps": 10}, None, clusterbench.Figures(tcp=True, allreduce=False, disk=False)),
    ({"local_nvme": True}, None, clusterbench.Figures(tcp=False, allreduce=False, disk=True)),
    ({}, G5, clusterbench.Figures(tcp=True, allreduce=False, disk=False)),
    ({}, P4D, clusterbench.Figures(tcp=False, allreduce=True, disk=False)),
    ({"verify": {"measure": "all"}}, None, clusterbench.ALL_FIGURES),
], ids=["local-no-floor", "floor", "nvme", "ethernet-catalog", "rdma-catalog", "asked-for-all"])
def test_only_figures_something_holds_are_measured(cluster: dict[str, Any], entry: Any,
                                                   expected: clusterbench.Figures) -> None:
    assert clusterbench.figures_to_measure(ClusterSpec.model_validate(cluster), entry) == expected




@pytest.mark.parametrize(("case", "measured", "spec", "entry", "fraction", "expected"), [
    ("floor met", _measured(tcp_gbps=10), {"min_network_gbps": 10}, None, 0.8,
     [("tcp node-0 → node-1", 10, True)]),
    ("floor missed within the fraction", _measured(tcp_gbps=8.0), {"min_network_gbps": 10}, None, 0.8,
     [("tcp node-0 → node-1", 10, True)]),
    ("floor missed below the fraction", _measured(tcp_gbps=7.9), {"min_network_gbps": 10}, None, 0.8,
     [("tcp node-0 → node-1", 10, False)]),
    ("no catalog entry, no floor: nothing to hold", _measured(), {}, None, 0.8, []),
    ("ethernet: TCP held to the floor and the catalog", _measured(tcp_gbps=20), {"min_network_gbps": 10}, G5, 0.8,
     [("tcp node-0 → node-1", 10, True), ("tcp node-0 → node-1", 40, False)]),
    ("efa: the all-reduce is held, scaled to the GPUs used", _measured(tcp_gbps=1, busbw_gb_per_s=5.5),
     {"procs_per_node": 1}, P4D, 0.8, [("all-reduce busbw (64 MB, nccl)", 50, True)]),
    ("efa with every GPU: the catalog's whole figure", _measured(busbw_gb_per_s=46),
     {"procs_per_node": 8, "min_network_gbps": 400}, P4D, 0.9,
     [("all-reduce busbw (64 MB, nccl)", 400, True), ("all-reduce busbw (64 MB, nccl)", 400, True)]),
    ("local NVMe floor", _measured(write=200, read=2000), {"local_nvme": True}, None, 0.8,
     [("disk write node-0", clusterbench.NVME_WRITE_FLOOR_MB_S, False),
      ("disk read node-0", clusterbench.NVME_READ_FLOOR_MB_S, True)]),
])
def test_compare(case: str, measured: ClusterMeasurement, spec: dict[str, Any], entry: Any, fraction: float,
                 expected: list[tuple[str, float, bool]]) -> None:
    verdict = compare(measured, ClusterSpec(**spec), entry, fraction)
    assert [(c.figure, c.expected, c.passed) for c in verdict.checks] == expected, case
    assert verdict.ok == all(passed for _, _, passed in expected)
    for check in verdict.failures:
        assert "measured vs" in check.line() and f"below {fraction:.0%}" in check.line()


def test_link_batches() -> None:
    assert link_batches(1) == []
    assert link_batches(2) == [[(0, 1)]]
    assert link_batches(4) == [[(0, 1)], [(0, 2)], [(0, 3)], [(1, 2)], [(1, 3)], [(2, 3)]]
    assert link_batches(5) == [[(0, 1), (1, 2), (2, 3), (3, 4), (4, 0)]]


# -- diskbench: O_DIRECT, and the fallback where the filesystem refuses it ---------------------------------------


def test_diskbench_falls_back_to_buffered_when_o_direct_is_refused(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    direct = diskbench.measure(tmp_path / "direct", 8 * 2**20, direct=True)
    assert direct["bytes"] == 8 * 2**20 and direct["write_mb_per_s"] > 0 and direct["read_mb_per_s"] > 0
    assert direct["direct"] or "refused O_DIRECT" in str(direct["note"])

    real_open = os.open

    def tmpfs_open(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(diskbench.os, "open", tmpfs_open)
    refused = diskbench.measure(tmp_path / "refused", 8 * 2**20, direct=True)
    assert refused["direct"] is False and refused["bytes"] == 8 * 2**20
    assert str(refused["note"]).startswith("the filesystem refused O_DIRECT (open with O_DIRECT: Invalid argument)")


# -- the command line ------------------------------------------------------------------------------------------


def test_cli_prints_the_table_and_verdict_and_tears_down(workspace: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "job.yaml", bench_config(
        tmp_path, min_network_gbps=IMPOSSIBLE_GBPS, verify={**QUICK, "bench": "fail"}))
    env = {**os.environ, "TRAINPIPE_HOME": str(workspace)}
    done = subprocess.run([TRAINPIPE, "bench", "cluster", str(config), "--json", str(tmp_path / "bench.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    for row in ("tcp node-0 → node-1", "all-reduce 1 MB busbw", "all-reduce 4 MB busbw", "disk write node-1",
                "disk read node-0"):
        assert row in output, output
    assert "verdict: FAILED: 1 of 1 figures missed" in output and "measured vs 1e+05 Gbit/s expected" in output
    assert ": 0 nodes left running" in output, output
    assert (tmp_path / "bench.json").is_file()
    assert not tagged_processes(workspace), "bench processes outlived the command"
    assert not any((workspace / "clusters").iterdir()), "node directories outlived the command"
