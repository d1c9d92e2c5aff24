"""`bench staging` at its smallest, for real: a 2-node netns cluster, the store in its own namespace behind a
shaped link, fan-out off then on. The store's interface counts what it sent: N× the dataset off, once on (plus
requests and headers). Wall times are printed, not bounded: a few MB on loaded cores say nothing about them.
Namespaces need root: skips without it, fails in CI (CI=true), which runs as root."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import cannot_run_here

from bench.staging import StagingBenchConfig, run_staging_benchmark
from infra.compute.providers.netns import emulation as netns


def test_fanout_on_the_store_sends_the_dataset_once_off_once_per_node(tmp_path: Path) -> None:
    if (problem := netns.problem()) is not None:
        cannot_run_here(problem)
    report = run_staging_benchmark(StagingBenchConfig(nodes=(2,), size_mb=4, workdir=tmp_path))
    ratios = report.ratios(2)
    off, on = report.run(2, False), report.run(2, True)
    assert 1.9 <= ratios["store_x_off"] <= 2.2, report.table()
    assert ratios["store_x_on"] <= 1.05, report.table()
    assert on.node_peer_bytes == report.dataset_bytes and on.fallback_files == 0, on.fallbacks
    assert off.node_peer_bytes == 0
    figures = json.loads(report.to_json())
    assert figures["ratios"]["2"]["store_x_on"] == ratios["store_x_on"]
    assert not list(tmp_path.iterdir()), "the bench left its scratch dir behind"
