"""`trainpipe bench scale`'s arithmetic: which figure grows faster than the nodes (the runs themselves are the
bench's, not the suite's: they take minutes)."""

from __future__ import annotations

import json

import pytest
import typer

from bench.scale import ScaleReport, ScaleRow
from trainpipe.bench_common import node_counts


def row(nodes: int, cpu_s: float, api_calls: int, log_records: int) -> ScaleRow:
    return ScaleRow(nodes=nodes, run_id=f"r{nodes}", cpu_s=cpu_s, peak_threads=10 + 2 * nodes, peak_fds=20 + 3 * nodes,
                    api_calls=api_calls, log_records=log_records, time_to_first_step_s=5.0, wall_s=60.0)


def test_a_figure_growing_with_the_square_of_the_nodes_is_named_and_linear_ones_are_not() -> None:
    report = ScaleReport([row(2, 2.0, 40, 100), row(4, 4.1, 160, 200), row(16, 16.5, 2560, 800)])
    growth = report.growth()
    assert growth["cpu_s"] == pytest.approx(16.5 / 2.0 / 8, rel=1e-3)
    assert growth["api_calls"] == pytest.approx(8.0)  # 64x the calls for 8x the nodes
    assert report.superlinear() == ["api_calls"]
    table = report.table()
    assert "faster than N: api_calls" in table and "   16 " in table
    assert json.loads(report.to_json())["superlinear"] == ["api_calls"]


def test_flat_figures_pass_and_one_run_has_no_growth() -> None:
    assert ScaleReport([row(2, 2.0, 40, 100), row(8, 7.0, 150, 390)]).superlinear() == []
    assert ScaleReport([row(2, 2.0, 40, 100)]).growth() == {}


def test_node_counts_are_checked() -> None:
    assert node_counts("2,4,8,16") == (2, 4, 8, 16)
    for bad in ("2,x", "0,2", ""):
        with pytest.raises(typer.BadParameter, match="node counts of at least 1"):
            node_counts(bad)
