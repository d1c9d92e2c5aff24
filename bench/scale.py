"""`trainpipe bench scale`: how the orchestrator's own cost grows with the number of nodes.

One light job (the bundled GPT, a few dozen steps, checkpoints synced) runs on N local nodes for each N asked, in this
process, as `trainpipe run` runs its flow. For each run the orchestrator itself is measured, never its nodes: its CPU
seconds (this process only: node processes and the Prefect server are other processes), its peak threads and open
file descriptors (sampled), the Prefect API requests it sent and the log records it handed to Prefect, and the run's
time to first step and wall time. (Prefect 3 reports task states as events over a websocket: those are not HTTP
requests and are not in the API calls.) Each figure is also given per node, and its growth from the smallest N to the
largest against the growth of N: a figure that grows faster than N is what breaks first at 64 or 256 nodes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from infra.dataset.synth import synthesize
from infra.job.spec import JobSpec
from infra.storage import open_store

SAMPLE_S = 0.1
# The light job: a tiny GPT, so the orchestrator's own cost is not lost in training time.
STEPS = 60
CKPT_EVERY = 20
TOKENS = 400_000
VOCAB = 64
MODEL = ["--vocab-size", str(VOCAB), "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32"]
# A figure counts as growing faster than the nodes when its growth exceeds theirs by this factor.
SUPERLINEAR = 1.25


class ScaleBenchError(RuntimeError):
    """A run of the bench did not complete: the message names the node count, the run and why."""


@dataclass(frozen=True)
class ScaleRow:
    nodes: int
    run_id: str
    cpu_s: float  # the orchestrator process's user + system CPU during the run
    peak_threads: int
    peak_fds: int
    api_calls: int  # HTTP requests to the Prefect API
    log_records: int  # records handed to Prefect's API log handler
    time_to_first_step_s: float | None
    wall_s: float

    def per_node(self, name: str) -> float:
        return float(getattr(self, name)) / self.nodes


FIGURES = ("cpu_s", "peak_threads", "peak_fds", "api_calls", "log_records", "wall_s")


@dataclass
class ScaleReport:
    rows: list[ScaleRow] = field(default_factory=list)

    def growth(self) -> dict[str, float]:
        """Each figure's growth from the smallest N to the largest, divided by the growth of N: above 1, the
        figure grows faster than the nodes."""
        if len(self.rows) < 2:
            return {}
        first, last = self.rows[0], self.rows[-1]
        nodes = last.nodes / first.nodes
        return {name: round((float(getattr(last, name)) / max(float(getattr(first, name)), 1e-9)) / nodes, 3)
                for name in FIGURES}

    def superlinear(self) -> list[str]:
        return [name for name, ratio in self.growth().items() if ratio > SUPERLINEAR]

    def table(self) -> str:
        head = (f"{'nodes':>5} {'CPU s':>7} {'threads':>7} {'fds':>5} {'API calls':>9} {'log recs':>8} "
                f"{'1st step s':>10} {'wall s':>7}   per node: CPU s, API calls, log recs")
        lines = [head]
        for row in self.rows:
            first = f"{row.time_to_first_step_s:.1f}" if row.time_to_first_step_s is not None else "-"
            lines.append(f"{row.nodes:>5} {row.cpu_s:>7.1f} {row.peak_threads:>7} {row.peak_fds:>5} "
                         f"{row.api_calls:>9} {row.log_records:>8} {first:>10} {row.wall_s:>7.1f}   "
                         f"{row.per_node('cpu_s'):.2f}, {row.per_node('api_calls'):.0f}, "
                         f"{row.per_node('log_records'):.0f}")
        growth = self.growth()
        if growth:
            lines.append(f"growth / node growth ({self.rows[0].nodes} -> {self.rows[-1].nodes} nodes; above "
                         f"{SUPERLINEAR:g}: faster than N): " + ", ".join(f"{k} {v:.2f}" for k, v in growth.items()))
            worse = self.superlinear()
            lines.append(f"faster than N: {', '.join(worse)}" if worse else "nothing grows faster than N")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"rows": [asdict(row) for row in self.rows], "growth": self.growth(),
                           "superlinear": self.superlinear()}, indent=2)


class _Peaks:
    """This process's threads and open fds, sampled on a thread of its own until stopped."""

    def __init__(self) -> None:
        self.threads = self.fds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-scale-peaks", daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            with contextlib.suppress(psutil.Error):
                self.threads = max(self.threads, me.num_threads())
                self.fds = max(self.fds, me.num_fds())
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> _Peaks:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@contextlib.contextmanager
def _counting() -> Iterator[dict[str, int]]:
    """Counts the Prefect API requests (every httpx request to PREFECT_API_URL's host, sync or async) and the log
    records Prefect's API handler is given, for as long as the context lasts."""
    import httpx
    from prefect.logging.handlers import APILogHandler

    counts = {"api_calls": 0, "log_records": 0}
    send, async_send, emit = httpx.Client.send, httpx.AsyncClient.send, APILogHandler.emit

    def counted_send(self: httpx.Client, request: httpx.Request, *args: Any, **kwargs: Any) -> httpx.Response:
        counts["api_calls"] += "/api/" in request.url.path
        return send(self, request, *args, **kwargs)

    async def counted_async_send(self: httpx.AsyncClient, request: httpx.Request, *args: Any,
                                 **kwargs: Any) -> httpx.Response:
        counts["api_calls"] += "/api/" in request.url.path
        return await async_send(self, request, *args, **kwargs)

    def counted_emit(self: APILogHandler, record: logging.LogRecord) -> None:
        counts["log_records"] += 1
        emit(self, record)

    httpx.Client.send, httpx.AsyncClient.send, APILogHandler.emit = (  # type: ignore[method-assign]
        counted_send, counted_async_send, counted_emit)
    try:
        yield counts
    finally:
        httpx.Client.send, httpx.AsyncClient.send, APILogHandler.emit = (  # type: ignore[method-assign]
            send, async_send, emit)


def job_for(nodes: int, dataset: str, checkpoints: str) -> JobSpec:
    return JobSpec.model_validate({
        "name": f"bench-scale-{nodes}",
        "cluster": {"provider": "local", "nodes": nodes, "verify": {"bench": "off"}},
        "dataset": {"url": dataset, "validation": "sample"},
        "checkpoints": {"url": checkpoints, "keep": 2},
        "training": {"command": ["-m", "trainer.train", "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY),
                                 "--batch-size", "4", "--warmup-steps", "5", "--lr", "3e-3", *MODEL]},
    })


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(nodes: int, job: JobSpec, run_id: str, run_job: Callable[[JobSpec, str], dict[str, Any]]) -> ScaleRow:
    started, cpu = time.monotonic(), _cpu_s()
    with _Peaks() as peaks, _counting() as counts:
        summary = run_job(job, run_id)
    if summary.get("status") != "completed":
        raise ScaleBenchError(f"{nodes} nodes: run {run_id} {summary.get('status')}: {summary.get('error')}")
    return ScaleRow(nodes=nodes, run_id=run_id, cpu_s=round(_cpu_s() - cpu, 2), peak_threads=peaks.threads,
                    peak_fds=peaks.fds, api_calls=counts["api_calls"], log_records=counts["log_records"],
                    time_to_first_step_s=summary.get("time_to_first_step_s"),
                    wall_s=round(time.monotonic() - started, 2))


def run_scale_benchmark(node_counts: Sequence[int], run_job: Callable[[JobSpec, str], dict[str, Any]],
                        workdir: Path | None = None, echo: Callable[[str], None] = print) -> ScaleReport:
    """One run per node count, smallest first, on one dataset; run_job runs the retrain flow in this process."""
    report = ScaleReport()
    with tempfile.TemporaryDirectory(prefix="trainpipe-bench-scale-", dir=workdir) as temp:
        dataset = str(Path(temp) / "dataset")
        synthesize(open_store(dataset), TOKENS, vocab_size=VOCAB, shard_tokens=TOKENS // 32)
        counts = sorted(set(node_counts))
        # The first run of a process pays for the imports and the Prefect server's start: a warm-up on the smallest
        # cluster, unreported, so every reported run costs what a run in a warm orchestrator (serve) costs.
        for warm_up, nodes in [(True, counts[0]), *((False, n) for n in counts)]:
            run_id = f"bench-scale-{nodes}{'-warm-up' if warm_up else ''}-{time.strftime('%Y%m%d%H%M%S')}"
            echo(f"{nodes} nodes: run {run_id}{' (warm-up, not reported)' if warm_up else ''} ...")
            row = measure(nodes, job_for(nodes, dataset, str(Path(temp) / "checkpoints")), run_id, run_job)
            if warm_up:
                continue
            report.rows.append(row)
            echo(f"{nodes} nodes: CPU {row.cpu_s:.1f} s, {row.api_calls} API calls, {row.log_records} log records, "
                 f"wall {row.wall_s:.1f} s")
    return report
