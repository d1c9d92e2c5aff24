"""Does a launched cluster deliver what the job pays for? Measure the network, the collectives and the disks, then
compare the figures with the job's floors and the catalog.

Measurements (each node runs `python -m infra.node ...` through its provider's runner):

* TCP: `netbench` with `verify.tcp_streams` parallel streams, between every pair of nodes (i → j, i < j, one
  link at a time) when there are at most 4, else around the ring (i → i+1 mod n, all links at once: each node then
  sends on one link and receives on another, as a ring all-reduce does).
* all-reduce: `allreduce-bench` under torchrun on every node with the training shape (procs_per_node processes
  per node, nccl on GPUs, gloo on CPU), a static rendezvous on the head node: nccl-tests' algbw and busbw per size.
* disk: `diskbench` with O_DIRECT on every node's data dir, all nodes at once.

What each figure is held to (`compare`); a figure below min_fraction × expected misses:

* The network floor (cluster.min_network_gbps) and the catalog's network_gbps describe the fabric the job's
  collectives use. On an RDMA-class fabric (EFA, InfiniBand, GPUDirect-TCPX/O) that is what the all-reduce runs
  over, so the busbw of the largest message is held to them (the catalog figure is the whole node's, reached with
  all its GPUs: it is scaled by procs_per_node / GPUs). TCP does not use that fabric and is reported only.
* On ethernet, and where the catalog does not know the instance type (local, ssh), the network is TCP: every
  link is held to them. The all-reduce there is reported only: gloo's figure includes its CPU reductions.
* cluster.local_nvme: every node's disk must reach NVME_WRITE_FLOOR_MB_S / NVME_READ_FLOOR_MB_S. Without it the
  disk figures are reported only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from infra.compute.access.agent import NodeAgent
from infra.compute.access.events import EventTap
from infra.compute.access.remote import LineSink, Process, RemoteError, last_error, wait_all
from infra.compute.catalog import InstanceType, load_catalog
from infra.compute.providers import Cluster, Node, Provider, provider_of
from infra.compute.spec import ClusterSpec
from infra.node.events import Event, NodeEvent
from infra.node.protocol import (
    AllreduceBenchRequest,
    DiskbenchRequest,
    NetbenchRequest,
    NodeRequest,
    ProbeRequest,
    TorchrunRequest,
    TrainingEnvironment,
)

log = logging.getLogger(__name__)

# The slowest local NVMe the clouds sell, one GCP local SSD (375 GB, NVMe), does about 350 MB/s sequential write
# and 660 MB/s read; network block storage at its defaults (gp3 125 MB/s, pd-balanced 140-240 MB/s) stays well
# below. A data dir under these is not on local NVMe, or that NVMe is failing.
NVME_WRITE_FLOOR_MB_S = 300.0
NVME_READ_FLOOR_MB_S = 600.0
RDMA_KINDS = frozenset({"efa", "infiniband", "gpudirect-tcpx", "gpudirect-tcpxo"})
ALL_PAIRS_UP_TO = 4
# A fresh interpreter on a busy node takes seconds to start; beyond this the node is not answering.
START_TIMEOUT_S = 120.0
# After the sending time: connecting, draining the socket buffers and the acknowledgements.
TCP_GRACE_S = 60.0
COLLECTIVE_TIMEOUT_S = 120.0
ALLREDUCE_SECONDS_PER_SIZE = 2.0
ALLREDUCE_DEADLINE_S = 600.0
DISK_TIMEOUT_S = 900.0

SinkFactory = Callable[[str], LineSink]


class BenchError(RuntimeError):
    """A measurement could not be taken; the message names the node and what it printed."""


# -- figures ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkFigure:
    src: str
    dst: str
    gbps: float  # the sender's clock, stopped when the receiver acknowledged every byte
    streams: int
    bytes: int
    seconds: float
    receiver_gbps: float


@dataclass(frozen=True)
class AllReduceFigure:
    size_bytes: int
    world_size: int
    backend: str
    iters: int
    time_ms: float
    algbw_gb_per_s: float  # GB/s, as nccl-tests prints it
    busbw_gb_per_s: float

    @property
    def busbw_gbit_per_s(self) -> float:
        return self.busbw_gb_per_s * 8


@dataclass(frozen=True)
class DiskFigure:
    node: str
    write_mb_per_s: float
    read_mb_per_s: float
    bytes: int
    direct: bool
    note: str | None


@dataclass(frozen=True)
class ClusterMeasurement:
    nodes: int
    instance_type: str | None
    links: tuple[LinkFigure, ...]
    allreduce: tuple[AllReduceFigure, ...]
    disks: tuple[DiskFigure, ...]
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def rows(self) -> list[dict[str, Any]]:
        """One row per figure: what the table artifact and the command line show."""
        rows = [{"figure": f"tcp {link.src} → {link.dst}", "value": link.gbps, "unit": "Gbit/s",
                 "detail": f"{link.streams} streams, {link.bytes / 1e9:.2f} GB in {link.seconds:.2f}s"}
                for link in self.links]
        rows += [{"figure": f"all-reduce {a.size_bytes / 2**20:g} MB busbw", "value": round(a.busbw_gbit_per_s, 2),
                  "unit": "Gbit/s", "detail": f"{a.backend}, {a.world_size} ranks: algbw {a.algbw_gb_per_s:g} GB/s, "
                  f"busbw {a.busbw_gb_per_s:g} GB/s, {a.time_ms:g} ms"} for a in self.allreduce]
        for disk in self.disks:
            how = "O_DIRECT" if disk.direct else "buffered + fsync"
            rows += [{"figure": f"disk write {disk.node}", "value": disk.write_mb_per_s, "unit": "MB/s", "detail": how},
                     {"figure": f"disk read {disk.node}", "value": disk.read_mb_per_s, "unit": "MB/s", "detail": how}]
        return rows


# -- the verdict --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    figure: str
    measured: float
    expected: float
    unit: str
    source: str  # where the expectation comes from: a job floor or the catalog
    fraction: float
    fix: str

    @property
    def passed(self) -> bool:
        return self.measured >= self.fraction * self.expected

    def line(self) -> str:
        verdict = "ok" if self.passed else f"below {self.fraction:.0%} of it: {self.fix}"
        return (f"{self.figure}: {self.measured:.4g} {self.unit} measured vs {self.expected:.4g} {self.unit} "
                f"expected ({self.source}): {verdict}")


@dataclass(frozen=True)
class Verdict:
    checks: tuple[Check, ...]
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(check for check in self.checks if not check.passed)

    def lines(self) -> list[str]:
        return [check.line() for check in self.checks] + [f"note: {note}" for note in self.notes]

    def render(self) -> str:
        if not self.checks:
            head = "verdict: ok: no figure has an expectation to meet here (see the notes)"
        elif self.ok:
            head = f"verdict: ok: {len(self.checks)} figures checked"
        else:
            head = f"verdict: FAILED: {len(self.failures)} of {len(self.checks)} figures missed"
        return "\n".join([head, *(f"  {line}" for line in self.lines())])

    def failure_message(self) -> str:
        """One line per missed figure, measured vs expected and the fix; then the way to train anyway."""
        return "\n".join([f"cluster bench: {len(self.failures)} figure(s) below what the job pays for:",
                          *(check.line() for check in self.failures),
                          "or set cluster.verify.bench: warn to train on this cluster anyway"])

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checks": [{**asdict(c), "passed": c.passed} for c in self.checks],
                "notes": list(self.notes)}


NETWORK_FIX = ("pick another instance type or zone (cluster.instance_type, cluster.zones) or lower "
               "cluster.min_network_gbps")
CATALOG_FIX = ("pick another instance type or zone (cluster.instance_type, cluster.zones) or lower "
               "cluster.verify.min_fraction")
DISK_FIX = "pick an instance type with local NVMe for the data dir, or set cluster.local_nvme: false"


def _network_expectations(spec: ClusterSpec, entry: InstanceType | None, scale: bool) -> list[tuple[str, float, str]]:
    expected = []
    if spec.min_network_gbps > 0:
        expected.append(("job floor cluster.min_network_gbps", spec.min_network_gbps, NETWORK_FIX))
    if entry is not None:
        share = min(1.0, spec.procs_per_node / entry.gpus) if scale and entry.gpus else 1.0
        scaled = f" × {spec.procs_per_node}/{entry.gpus} GPUs used" if share < 1 else ""
        expected.append((f"catalog {entry.key}: {entry.network_gbps:g} Gbps {entry.network_kind}{scaled}",
                         entry.network_gbps * share, CATALOG_FIX))
    return expected


def compare(measured: ClusterMeasurement, spec: ClusterSpec, catalog_entry: InstanceType | None,
            fraction: float) -> Verdict:
    """Hold each figure to what is expected of it (see the module's docstring); nothing expected, nothing checked."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction {fraction}: use 0 < fraction ≤ 1")
    checks: list[Check] = []
    notes: list[str] = []
    fabric = catalog_entry.network_kind if catalog_entry is not None else None
    rdma = fabric in RDMA_KINDS
    if measured.nodes < 2:
        notes.append("one node: there is no node-to-node network to measure")
    if measured.links:
        if rdma:
            notes.append(f"TCP figures are reported only: the collectives run over {fabric}, which TCP does not use")
        for source, expected, fix in ([] if rdma else _network_expectations(spec, catalog_entry, scale=False)):
            checks += [Check(f"tcp {link.src} → {link.dst}", link.gbps, expected, "Gbit/s", source, fraction, fix)
                       for link in measured.links]
    if measured.allreduce:
        largest = max(measured.allreduce, key=lambda a: a.size_bytes)
        if rdma:
            figure = f"all-reduce busbw ({largest.size_bytes / 2**20:g} MB, {largest.backend})"
            checks += [Check(figure, largest.busbw_gbit_per_s, expected, "Gbit/s", source, fraction, fix)
                       for source, expected, fix in _network_expectations(spec, catalog_entry, scale=True)]
        else:
            notes.append(f"all-reduce figures are reported only: over TCP, {largest.backend}'s figure includes the "
                         "backend's own cost, the TCP links stand for the network")
    if spec.local_nvme:
        for disk in measured.disks:
            source = "local NVMe floor, cluster.local_nvme"
            checks += [Check(f"disk write {disk.node}", disk.write_mb_per_s, NVME_WRITE_FLOOR_MB_S, "MB/s", source,
                             fraction, DISK_FIX),
                       Check(f"disk read {disk.node}", disk.read_mb_per_s, NVME_READ_FLOOR_MB_S, "MB/s", source,
                             fraction, DISK_FIX)]
    elif measured.disks:
        notes.append("disk figures are reported only: cluster.local_nvme is off")
    notes += [f"{disk.node}: {disk.note}" for disk in measured.disks if not disk.direct and disk.note]
    return Verdict(tuple(checks), tuple(notes))


def lookup_catalog_entry(cluster: Cluster) -> InstanceType | None:
    """The catalog's figures for the cluster's instance type; None where the catalog does not list it (local, ssh)."""
    if cluster.instance_type is None:
        return None
    return load_catalog().get(cluster.provider, cluster.instance_type)


# -- running node commands ----------------------------------------------------------------------------------


def node_label(cluster: Cluster, node: Node) -> str:
    """The node's name without the cluster's, which every figure of one bench shares: `node-0` for `tp-x-node-0`."""
    return node.name.removeprefix(f"{cluster.name}-")


def _log_sink(label: str) -> LineSink:
    return lambda line: log.debug("[%s] %s", label, line)


_ERROR_MARKERS = ("netbench ", "allreduce-bench:", "benchmark failed")  # the bench commands' own error lines


def _tap(sink: LineSink) -> EventTap:
    """A tap whose failed waits are the bench's errors, naming the node command's own error line."""
    return EventTap(sink, error=BenchError, markers=_ERROR_MARKERS)


def _last_error(process: Process) -> str:
    return last_error(process, _ERROR_MARKERS, lines=200)


def _run(provider: Provider, cluster: Cluster, node: Node, request: NodeRequest, timeout_s: float,
         label: str, sink_for: SinkFactory) -> EventTap:
    tap = _tap(sink_for(f"{node.name} {label}"))
    try:
        _agent(provider, cluster, node).run(request, timeout=timeout_s, on_line=tap)
    except RemoteError as exc:
        raise BenchError(f"{label}: {exc}") from None
    return tap


def _agent(provider: Provider, cluster: Cluster, node: Node) -> NodeAgent:
    return NodeAgent(provider.runner(cluster, node), node.python)


# -- TCP ----------------------------------------------------------------------------------------------------


def link_batches(nodes: int) -> list[list[tuple[int, int]]]:
    """Links to measure as (sender, receiver) ranks, in batches that run at the same time."""
    if nodes < 2:
        return []
    if nodes <= ALL_PAIRS_UP_TO:
        return [[(i, j)] for i in range(nodes) for j in range(i + 1, nodes)]
    return [[(i, (i + 1) % nodes) for i in range(nodes)]]


def _client(provider: Provider, cluster: Cluster, src: Node, dst: Node, port: int, spec: ClusterSpec,
            sink_for: SinkFactory) -> Event:
    verify = spec.verify
    request = NetbenchRequest(mode="client", host=dst.cluster_address, port=port, streams=verify.tcp_streams,
                              seconds=verify.tcp_seconds, timeout_s=TCP_GRACE_S)
    tap = _run(provider, cluster, src, request, verify.tcp_seconds + TCP_GRACE_S, f"netbench → {dst.name}", sink_for)
    return tap.last(NodeEvent.NETBENCH, f"{src.name}: netbench client")


def _measure_links(provider: Provider, cluster: Cluster, spec: ClusterSpec, batch: list[tuple[int, int]],
                   sink_for: SinkFactory) -> list[LinkFigure]:
    streams = spec.verify.tcp_streams
    servers: list[tuple[Process, EventTap]] = []
    try:
        for _, dst_rank in batch:
            dst = cluster.nodes[dst_rank]
            tap = _tap(sink_for(f"{dst.name} netbench server"))
            request = NetbenchRequest(mode="server", streams=streams, timeout_s=START_TIMEOUT_S + TCP_GRACE_S)
            servers.append((_agent(provider, cluster, dst).start(request, on_line=tap), tap))
        ports = [tap.wait_for(NodeEvent.NETBENCH_LISTENING, process, START_TIMEOUT_S,
                              f"{cluster.nodes[dst_rank].name}: netbench server")["port"]
                 for (process, tap), (_, dst_rank) in zip(servers, batch, strict=True)]
        with ThreadPoolExecutor(max_workers=len(batch)) as pool:
            futures = [pool.submit(_client, provider, cluster, cluster.nodes[src], cluster.nodes[dst], port, spec,
                                   sink_for) for (src, dst), port in zip(batch, ports, strict=True)]
            sent = [future.result() for future in futures]
        received = [tap.wait_for(NodeEvent.NETBENCH_SERVER, process, TCP_GRACE_S, "netbench server")
                    for process, tap in servers]
    finally:
        for process, _ in servers:
            if process.poll() is None:
                process.terminate(grace_s=5)
    return [LinkFigure(src=node_label(cluster, cluster.nodes[src]), dst=node_label(cluster, cluster.nodes[dst]),
                       gbps=client["gbps"],
                       streams=client["streams"], bytes=client["bytes"], seconds=client["seconds"],
                       receiver_gbps=server["gbps"])
            for (src, dst), client, server in zip(batch, sent, received, strict=True)]


def measure_links(cluster: Cluster, spec: ClusterSpec, sink_for: SinkFactory = _log_sink) -> tuple[LinkFigure, ...]:
    provider = provider_of(cluster)
    return tuple(figure for batch in link_batches(len(cluster.nodes))
                 for figure in _measure_links(provider, cluster, spec, batch, sink_for))


# -- all-reduce ---------------------------------------------------------------------------------------------


# Where a node's all-reduce bench runs: the job's training environment (infra.job.environment), which has the
# torch (and NCCL) the training will use; without a job, the node's own Python.
EnvironmentFor = Callable[[Node], TrainingEnvironment]


def node_environment(node: Node) -> TrainingEnvironment:
    return TrainingEnvironment(python=node.node_python, node_dir=node.workdir)


def torchrun_request(cluster: Cluster, node: Node, procs_per_node: int, port: int,
                     worker: AllreduceBenchRequest, environment: EnvironmentFor = node_environment) -> TorchrunRequest:
    """torchrun with a static rendezvous on the head node: every node knows its rank, nobody waits for a store."""
    return TorchrunRequest(training_env=environment(node), nnodes=len(cluster.nodes), nproc_per_node=procs_per_node,
                           node_rank=node.rank, master_addr=cluster.head.cluster_address, master_port=port,
                           max_restarts=0, worker=worker)


def free_port(cluster: Cluster, node: Node, sink_for: SinkFactory = _log_sink) -> int:
    """A port free on that node now (the node's own probe finds it)."""
    provider = provider_of(cluster)
    tap = _run(provider, cluster, node, ProbeRequest(), START_TIMEOUT_S, "probe", sink_for)
    return int(tap.last(NodeEvent.PROBE, f"{node.name}: probe")["free_port"])


def _wait_all(processes: dict[str, Process], deadline_s: float, what: str) -> None:
    """Wait for every node's process; the first that fails (or the deadline) raises, and the caller stops the rest."""
    wait_all(processes, time.monotonic() + deadline_s, interval_s=0.2,
             failed=lambda name, code, process: BenchError(f"{name}: {what} exited {code}: {_last_error(process)}"),
             overdue=lambda pending: BenchError(f"{what} still running after {deadline_s:.0f}s on "
                                                f"{', '.join(pending)}: check the nodes"))


def measure_allreduce(cluster: Cluster, spec: ClusterSpec, sink_for: SinkFactory = _log_sink,
                      environment: EnvironmentFor = node_environment) -> tuple[AllReduceFigure, ...]:
    if len(cluster.nodes) < 2:
        return ()
    provider = provider_of(cluster)
    port = free_port(cluster, cluster.head, sink_for)
    sizes = spec.verify.allreduce_sizes_mb
    worker = AllreduceBenchRequest(sizes_mb=tuple(sizes), timeout_s=COLLECTIVE_TIMEOUT_S,
                                   seconds_per_size=ALLREDUCE_SECONDS_PER_SIZE)
    processes: dict[str, Process] = {}
    head_tap = _tap(sink_for(f"{cluster.head.name} allreduce"))
    try:
        for node in cluster.nodes:
            tap = head_tap if node == cluster.head else _tap(sink_for(f"{node.name} allreduce"))
            processes[node.name] = _agent(provider, cluster, node).start(
                torchrun_request(cluster, node, spec.procs_per_node, port, worker, environment), on_line=tap)
        _wait_all(processes, ALLREDUCE_DEADLINE_S, "all-reduce bench")
        processes[cluster.head.name].wait(5)  # the head's last lines are through the pump before they are read
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.terminate(grace_s=5)
    events = head_tap.all(NodeEvent.ALLREDUCE)
    if len(events) != len(sizes):
        raise BenchError(f"{cluster.head.name}: all-reduce bench reported {len(events)} of {len(sizes)} sizes: "
                         f"{_last_error(processes[cluster.head.name])}")
    return tuple(AllReduceFigure(size_bytes=e["size_bytes"], world_size=e["world_size"], backend=e["backend"],
                                 iters=e["iters"], time_ms=e["time_ms"], algbw_gb_per_s=e["algbw_gb_per_s"],
                                 busbw_gb_per_s=e["busbw_gb_per_s"]) for e in events)


# -- disk ---------------------------------------------------------------------------------------------------


def _disk(provider: Provider, cluster: Cluster, node: Node, megabytes: int, sink_for: SinkFactory) -> DiskFigure:
    request = DiskbenchRequest(dir=node.data_dir, megabytes=megabytes)
    event = _run(provider, cluster, node, request, DISK_TIMEOUT_S, "diskbench", sink_for).last(
        NodeEvent.DISKBENCH, f"{node.name}: diskbench")
    return DiskFigure(node=node_label(cluster, node), write_mb_per_s=event["write_mb_per_s"],
                      read_mb_per_s=event["read_mb_per_s"], bytes=event["bytes"], direct=event["direct"],
                      note=event["note"])


def measure_disks(cluster: Cluster, spec: ClusterSpec, sink_for: SinkFactory = _log_sink) -> tuple[DiskFigure, ...]:
    provider = provider_of(cluster)
    with ThreadPoolExecutor(max_workers=len(cluster.nodes)) as pool:
        futures = [pool.submit(_disk, provider, cluster, node, spec.verify.disk_bytes_mb, sink_for)
                   for node in cluster.nodes]
        return tuple(future.result() for future in futures)


# -- all of it ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchResult:
    measurement: ClusterMeasurement
    verdict: Verdict
    catalog_key: str | None  # the catalog entry the figures were held to, if the catalog lists the type

    def to_dict(self) -> dict[str, Any]:
        return {"measurement": self.measurement.to_dict(), "verdict": self.verdict.to_dict(),
                "catalog": self.catalog_key}


@dataclass(frozen=True)
class VerifyBench:
    """The verify stage's bench of a run's cluster: cluster.verify.bench, and what it measured unless that is off."""

    mode: str
    result: BenchResult | None = None

    @property
    def slowest_link_gbps(self) -> float | None:
        """The slowest node-to-node TCP link measured; None when no link was (the bench off, or TCP not measured)."""
        links = self.result.measurement.links if self.result is not None else ()
        return min((link.gbps for link in links), default=None)

    def to_dict(self) -> dict[str, Any]:
        """The run summary's cluster_bench section."""
        return {"mode": self.mode, **(self.result.to_dict() if self.result is not None else {})}


@dataclass(frozen=True)
class Figures:
    """Which figures a bench measures: those something holds the cluster to, or all of them when asked."""

    tcp: bool
    allreduce: bool
    disk: bool

    @property
    def any(self) -> bool:
        return self.tcp or self.allreduce or self.disk

    def skipped(self) -> list[str]:
        return [name for name, wanted in (("tcp", self.tcp), ("all-reduce", self.allreduce), ("disk", self.disk))
                if not wanted]


ALL_FIGURES = Figures(tcp=True, allreduce=True, disk=True)


def figures_to_measure(spec: ClusterSpec, entry: InstanceType | None) -> Figures:
    """What `compare` would hold to anything (see the module's docstring): a figure reported only is not worth the
    seconds it takes to measure before every run (cluster.verify.measure: all measures it anyway)."""
    if spec.verify.measure == "all":
        return ALL_FIGURES
    rdma = entry is not None and entry.network_kind in RDMA_KINDS
    network = bool(_network_expectations(spec, entry, scale=False))
    return Figures(tcp=network and not rdma, allreduce=network and rdma, disk=spec.local_nvme)


def measure_cluster(cluster: Cluster, spec: ClusterSpec, sink_for: SinkFactory = _log_sink,
                    say: Callable[[str], None] = log.info, figures: Figures = ALL_FIGURES,
                    environment: EnvironmentFor = node_environment) -> ClusterMeasurement:
    """The network figures one at a time (TCP, then the collectives), so neither slows the other; the disks meanwhile,
    which neither uses."""
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="diskbench") as pool:
        if figures.disk:
            say(f"disk: {spec.verify.disk_bytes_mb} MB written and read back on every node's data dir")
        disks = pool.submit(measure_disks, cluster, spec, sink_for) if figures.disk else None
        links: tuple[LinkFigure, ...] = ()
        if figures.tcp:
            say(f"tcp: {sum(len(b) for b in link_batches(len(cluster.nodes)))} links, {spec.verify.tcp_streams} "
                f"streams, {spec.verify.tcp_seconds:g}s each")
            links = measure_links(cluster, spec, sink_for)
        allreduce: tuple[AllReduceFigure, ...] = ()
        if figures.allreduce:
            say(f"all-reduce: sizes {', '.join(f'{s} MB' for s in spec.verify.allreduce_sizes_mb)} on "
                f"{len(cluster.nodes)} nodes × {spec.procs_per_node} processes")
            allreduce = measure_allreduce(cluster, spec, sink_for, environment)
        disk_figures = disks.result() if disks is not None else ()
    return ClusterMeasurement(nodes=len(cluster.nodes), instance_type=cluster.instance_type, links=links,
                              allreduce=allreduce, disks=disk_figures, seconds=round(time.monotonic() - started, 2))


def bench_cluster(cluster: Cluster, spec: ClusterSpec, sink_for: SinkFactory = _log_sink,
                  say: Callable[[str], None] = log.info, everything: bool = False,
                  environment: EnvironmentFor = node_environment) -> BenchResult:
    """Measure the cluster and hold the figures to the job's floors and the catalog (spec.verify.min_fraction).

    everything: measure every figure (a bench asked for as such), not only the ones something holds to."""
    entry = lookup_catalog_entry(cluster)
    figures = ALL_FIGURES if everything else figures_to_measure(spec, entry)
    if figures.skipped():
        say(f"not measured, nothing holds them to a figure: {', '.join(figures.skipped())} "
            "(cluster.verify.measure: all measures them anyway)")
    measurement = (measure_cluster(cluster, spec, sink_for, say, figures, environment) if figures.any else
                   ClusterMeasurement(nodes=len(cluster.nodes), instance_type=cluster.instance_type, links=(),
                                      allreduce=(), disks=()))
    verdict = compare(measurement, spec, entry, spec.verify.min_fraction)
    return BenchResult(measurement, verdict, entry.key if entry else None)


def render_table(measurement: ClusterMeasurement) -> str:
    rows = measurement.rows()
    width = max([len("figure"), *(len(row["figure"]) for row in rows)])
    lines = [f"{'figure':<{width}}  {'value':>10}  {'unit':<7} detail"]
    lines += [f"{row['figure']:<{width}}  {row['value']:>10.2f}  {row['unit']:<7} {row['detail']}" for row in rows]
    return "\n".join(lines)
