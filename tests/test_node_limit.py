"""The global node limit (`trainpipe serve --max-nodes N` creates Prefect's global concurrency limit trainpipe-nodes)
holds across runs of every flow that launches nodes: two retrain runs and a cluster-bench run, started together,
whose clusters (2 nodes each) do not fit under a limit of 3 at once, run one after another.

Shown by what was observed, not by sleeps: each cluster's lifetime is the time its directory (its nodes' "local
disks") existed, sampled every 50 ms while the three flows ran in processes of their own against the session's real
Prefect server; no two lifetimes overlap.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO
from jobs import job_config, make_dataset, write_config

from infra.job.plan import cluster_name_for
from tasks.capacity import NODE_LIMIT

LIMIT = 3  # nodes; every cluster here has 2
RETRAIN = "import sys; from infra.job.spec import load_job; from flows.retrain import retrain; " \
          "retrain(load_job(sys.argv[1]), sys.argv[2])"
BENCH = "import sys; from infra.job.spec import load_job; from flows.cluster_bench import cluster_bench; " \
        "cluster_bench(load_job(sys.argv[1]).cluster, bench_id=sys.argv[2])"


def test_runs_and_a_cluster_bench_over_the_node_limit_take_turns(prefect_server: None, workspace: Path,
                                                                  tmp_path: Path) -> None:
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL

    config = job_config(tmp_path, make_dataset(tmp_path / "dataset", tokens=200_000), steps=20, ckpt_every=10)
    config["cluster"]["verify"] = {"bench": "warn", "tcp_seconds": 0.3, "tcp_streams": 1, "allreduce_sizes_mb": [1],
                                   "disk_bytes_mb": 4}
    config_path = write_config(tmp_path / "job.yaml", config)
    env = {**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    flows = {"retrain-a": RETRAIN, "retrain-b": RETRAIN, "bench-c": BENCH}
    clusters = {name: workspace / "clusters" / cluster_name_for(name) for name in flows}
    seen: dict[str, list[float]] = {name: [] for name in flows}

    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(NODE_LIMIT, LIMIT)
    try:
        processes = {name: subprocess.Popen([sys.executable, "-c", code, str(config_path), name], cwd=REPO, env=env,
                                            stdout=(tmp_path / f"{name}.log").open("w"), stderr=subprocess.STDOUT)
                     for name, code in flows.items()}
        deadline = time.monotonic() + 600
        while any(p.poll() is None for p in processes.values()):
            assert time.monotonic() < deadline, "the three flows did not finish within 600 s"
            now = time.monotonic()
            for name, directory in clusters.items():
                if directory.exists():
                    seen[name].append(now)
            time.sleep(0.05)
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(NODE_LIMIT)

    for name, process in processes.items():
        assert process.returncode == 0, f"{name}:\n" + (tmp_path / f"{name}.log").read_text()[-3000:]
    lifetimes = sorted((times[0], times[-1], name) for name, times in seen.items() if times)
    assert [name for *_, name in lifetimes] and len(lifetimes) == 3, f"clusters seen: {seen.keys()}"
    start = lifetimes[0][0]
    print("\nnode limit 3, clusters of 2: " + "; ".join(f"{name} {first - start:.1f}–{last - start:.1f}s"
                                                         for first, last, name in lifetimes))
    for (_, ended, first), (began, _, second) in itertools.pairwise(lifetimes):
        assert began > ended, f"{second}'s nodes came up at {began - start:.1f}s, before {first}'s went at " \
                              f"{ended - start:.1f}s"
