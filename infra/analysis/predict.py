"""What-if predictor: a measured step breakdown replayed on other hardware, with job time and cost.

The model is the design's T_total = T_compute + T_network + T_io, term by term, each scaled by the one figure of
the hardware that bounds it. Inputs: the run's StepBreakdown (totals over its steps), the Hardware it was measured
on, a target Hardware, and the job (its total steps, the bytes each node stages, the target's price per hour).
Throughputs are per node; a node's ranks share its store link, disk and memory (ranks_per_node = world / nodes).

    compute    T_compute / compute_speedup. Compute is assumed as measured (speedup 1) unless the user says how much
               faster the target computes: a CPU run says nothing about a GPU's step.
    gradients  total' = comm_total × measured.network_gbps / target.network_gbps (= the network ratio r)
               exposed', with the trainer's bucket profile (comm_buckets: launch offset, service time, bytes per
                 bucket): replay the buckets through one link, service times × r, launch offsets / compute_speedup;
                 exposed per step = when the last finishes − when the last was launched, plus the residual that
                 the replay at r = 1 leaves against the measurement (kept as measured). Without a profile:
                 hidden = (comm_total − comm_exposed) / compute_speedup (overlap needs backward compute to hide
                 behind), exposed' = max(0, total' − hidden).
               Either way, without overlap 2× bandwidth halves the exposed term; with overlap it can reach 0.
    sync wait  unchanged: tiny all-reduces cost latency and waiting for peers, not bandwidth.
    data       remote → remote: latency part L = min(data_wait, requests × read_latency) stays (scaled by the
                 latency ratio when the target gives a request latency); bandwidth part (data_wait − L) × store ratio.
               remote → local (staged): requests × LOCAL_READ_LATENCY_S + read_bytes × ranks_per_node / disk read.
               local → local: data_wait × measured disk read / target disk read (1 when either is unknown).
               local → remote (the target has no local NVMe): requests × request latency (REMOTE_REQUEST_LATENCY_S
                 unless given) + read_bytes × ranks_per_node / store.
               Staging (target reads locally), once per job, every node holding the whole (replicated) dataset D:
                 each node reads the store at s = min(store, store_egress / nodes) (the store's egress is shared;
                 without an egress figure each node gets its own store link);
                 fan-out off: D / s (every node reads every byte from the store: nodes × D of egress);
                 fan-out on: max(D / nodes / s, D / network): the store is read once, each node its 1/nodes share,
                 the rest arrives from the peers over the node links while the shares arrive (pieces flow on), and
                 a node's link carries its whole D either way (its share from the store, the rest from peers).
    recovery   one node of the cluster lost (recovery_s: the data it moves until training can resume; provisioning
               and start-up are left out, as they are from job_s). D: the dataset a node stages (0 when it reads
               remotely), c: one checkpoint's bytes per node (ckpt_bytes / ckpt_saves), C = c × nodes the whole
               checkpoint every node restores.
               whole relaunch (today): new machines, every node staged and restored again, as staging above:
                 staging_time(D + C); store bytes nodes × (D + C), or D + C with fan-out.
               replace-one (recovery.replace: nodes, on more than one node): the survivors keep their data and
                 their own checkpoint parts, and each a replica of its ring neighbour's (checkpoints.peer_replica,
                 on by default); the new node takes D + C in over its link from its peers: (D + C) / network, store
                 bytes 0. Without replicas the lost node's part c is read from the store, once:
                 max((D + C) / network, c / s); store bytes c.
    checkpoint same mode: local part (ckpt_block − upload_wait) × memory-copy ratio (async) or disk-write ratio
                 (sync, direct); upload part upload_wait × store ratio (direct only: it blocks on the store).
               to async (local NVMe scenario): ckpt_bytes / memory_copy, the copy into host memory; the upload then
                 overlaps training.
               Background uploads (async, sync) add one final flush of one checkpoint per job:
                 (ckpt_bytes / ckpt_saves) / store. Every node flushes its own share at once over its own store link
                 (store throughput is per node, and a measured figure was taken with every node busy).

    step_s = Σ terms / steps;  job_s = job steps × step_s + staging + flush;  cost = job_s / 3600 × price per hour

Catalog candidates keep the measured run's data path and checkpoint mode (a staged run falls back to remote reads on
a type without local NVMe). Their store and disk figures are estimates, not measurements: STORE_GBPS_PER_NODE and
the NVME_*_PER_DRIVE constants below.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from infra.analysis.breakdown import StepBreakdown
from infra.compute.catalog import Catalog, InstanceType
from infra.compute.optimizer import candidates
from infra.compute.spec import ClusterSpec

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
MB = 1e6
GB = 1e9
# Estimates (no provider publishes one figure): one NVMe read that misses the page cache takes tens of µs; an
# object-store GET's first byte 10–30 ms (S3, GCS).
LOCAL_READ_LATENCY_S = 20e-6
REMOTE_REQUEST_LATENCY_S = 0.02
# Estimate: object store ↔ one node with many parallel connections, the ceiling S3's and GCS's performance guides
# quote for 100 Gbit/s instances; a node never gets more than its own network link.
STORE_GBPS_PER_NODE = 100.0
# Estimate per data-center NVMe drive (sequential, striped across drives): slower than the newest, faster than
# cloud local SSD's slowest (see infra.analysis.clusterbench's floors).
NVME_READ_MB_S_PER_DRIVE = 2000.0
NVME_WRITE_MB_S_PER_DRIVE = 1000.0
# Host memory copy into a (pinned) staging buffer: what an async checkpoint stalls training for.
MEMORY_COPY_GB_S = 10.0

Kind = Literal["measured", "scenario", "candidate"]
BOUND_NAMES = {"T_compute": "compute", "T_network": "network", "T_io": "I/O"}


@dataclass(frozen=True)
class Hardware:
    network_gbps: float  # node-to-node link, Gbit/s
    store_gbps: float  # node ↔ object store / network storage, Gbit/s per node
    # The store's own egress, shared by every node reading it at once (a bucket across regions, a NAS's link);
    # None: unbounded, each node reads at store_gbps.
    store_egress_gbps: float | None = None
    local_disk_read_mb_s: float | None = None  # node-local NVMe; None: no local disk to stage to
    local_disk_write_mb_s: float | None = None
    memory_copy_gb_s: float = MEMORY_COPY_GB_S
    request_latency_s: float | None = None  # per store request; None: the breakdown's probed read latency
    compute_speedup: float = 1.0  # how much faster than the measured hardware this one computes (user-given)
    instance_type: str | None = None
    label: str = ""

    def __post_init__(self) -> None:
        positive = {"network_gbps": self.network_gbps, "store_gbps": self.store_gbps,
                    "store_egress_gbps": self.store_egress_gbps,
                    "memory_copy_gb_s": self.memory_copy_gb_s, "compute_speedup": self.compute_speedup,
                    "local_disk_read_mb_s": self.local_disk_read_mb_s,
                    "local_disk_write_mb_s": self.local_disk_write_mb_s}
        bad = [f"{name} {value}" for name, value in positive.items() if value is not None and not value > 0]
        if bad:
            raise ValueError(f"hardware {self.label or '(unnamed)'}: {', '.join(bad)}: must be > 0")


@dataclass(frozen=True)
class Job:
    steps: int  # steps of the whole job (not only those measured)
    dataset_bytes: int = 0  # what one node stages from the store when it reads locally


@dataclass(frozen=True)
class Target:
    hardware: Hardware
    price_per_hour: float | None  # the whole cluster, USD; None: unknown
    kind: Kind = "candidate"
    staged: bool = False  # stage the data to local NVMe and checkpoint async, whatever the measured run did
    fanout: bool = False  # staging reads the store once per cluster and the nodes fill each other (dataset.fanout)
    replace_nodes: bool = False  # a preemption replaces the lost node alone, filled from its peers (recovery.replace)
    peer_replica: bool = True  # each node keeps its ring neighbour's checkpoint part (checkpoints.peer_replica)


@dataclass(frozen=True)
class Prediction:
    label: str
    kind: Kind
    hardware: Hardware
    step: StepBreakdown  # the measured steps as the target would run them: same steps and bytes, predicted times
    job_steps: int
    staging_s: float
    flush_s: float
    price_per_hour: float | None
    speedup: float  # measured step time / predicted step time
    notes: tuple[str, ...] = ()
    recovery_s: float = 0.0  # one node lost: the data moved until training resumes (see the module's docstring)
    recovery_store_bytes: int = 0  # ... and what the store serves for it

    @property
    def step_s(self) -> float:
        return self.step.wall_s / self.step.steps

    @property
    def job_s(self) -> float:
        return self.job_steps * self.step_s + self.staging_s + self.flush_s

    @property
    def cost_usd(self) -> float | None:
        return None if self.price_per_hour is None else self.job_s / 3600 * self.price_per_hour

    def dominant(self) -> str:
        return self.step.dominant()

    def bound(self) -> str:
        """The dominant term in a few characters, for a table column: 'network 62%'."""
        shares = self.step.shares()
        name = max(shares, key=lambda key: shares[key])
        return f"{BOUND_NAMES[name]} {shares[name]:.0%}"

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "kind": self.kind, "hardware": asdict(self.hardware),
                "data_source": self.step.data_source, "ckpt_mode": self.step.ckpt_mode,
                "per_step_s": self.step.per_step(), "shares": self.step.shares(), "step_s": self.step_s,
                "job_steps": self.job_steps, "staging_s": self.staging_s, "flush_s": self.flush_s,
                "job_s": self.job_s, "price_per_hour": self.price_per_hour, "cost_usd": self.cost_usd,
                "speedup": self.speedup, "dominant": self.dominant(), "notes": list(self.notes),
                "recovery_s": self.recovery_s, "recovery_store_bytes": self.recovery_store_bytes}


def _ratio(measured: float | None, target: float | None) -> float:
    """How much longer a throughput-bound part takes on the target; 1 when either figure is unknown."""
    return measured / target if measured and target else 1.0


def ranks_per_node(b: StepBreakdown) -> int:
    return max(1, b.world_size // max(1, b.nodes))


def request_latency_part(b: StepBreakdown) -> float:
    """The part of a remote run's data wait spent on request latency; prefetching can hide some, so it is at most
    what was waited."""
    return min(b.data_wait_s, b.read_requests * b.read_latency_s)


def _data_time(b: StepBreakdown, measured: Hardware, target: Hardware, source: str) -> float:
    if b.data_source == "remote" and source == "remote":
        latency = request_latency_part(b)
        bandwidth = (b.data_wait_s - latency) * _ratio(measured.store_gbps, target.store_gbps)
        if target.request_latency_s is not None and b.read_latency_s > 0:
            latency *= target.request_latency_s / b.read_latency_s
        return latency + bandwidth
    if source == "local":
        if b.data_source == "local":
            return b.data_wait_s * _ratio(measured.local_disk_read_mb_s, target.local_disk_read_mb_s)
        assert target.local_disk_read_mb_s is not None  # predict() never stages to a target without a disk
        return b.read_requests * LOCAL_READ_LATENCY_S + b.read_bytes * ranks_per_node(b) / (
            target.local_disk_read_mb_s * MB)
    latency = target.request_latency_s if target.request_latency_s is not None else REMOTE_REQUEST_LATENCY_S
    return b.read_requests * latency + b.read_bytes * ranks_per_node(b) / (target.store_gbps * GBIT)


def _store_rate(hw: Hardware, readers: int) -> float:
    """Bytes per second each of `readers` nodes reading the store at once gets."""
    per_node = hw.store_gbps * GBIT
    if hw.store_egress_gbps is not None:
        per_node = min(per_node, hw.store_egress_gbps * GBIT / readers)
    return per_node


def staging_time(dataset_bytes: int, nodes: int, hw: Hardware, fanout: bool) -> float:
    """Seconds until every node holds the whole dataset (see the module's docstring)."""
    nodes = max(1, nodes)
    per_node = _store_rate(hw, nodes)
    if not fanout or nodes == 1:
        return dataset_bytes / per_node
    return max(dataset_bytes / nodes / per_node, dataset_bytes / (hw.network_gbps * GBIT))


@dataclass(frozen=True)
class Recovery:
    seconds: float  # data moved until training resumes
    store_bytes: int


def recovery(dataset_bytes: int, node_ckpt_bytes: int, nodes: int, hw: Hardware, fanout: bool,
             replace_nodes: bool, peer_replica: bool = True) -> Recovery:
    """One node of `nodes` lost: the whole relaunch, or replace-one (see the module's docstring)."""
    nodes = max(1, nodes)
    needed = dataset_bytes + node_ckpt_bytes * nodes  # what every node must hold again: the dataset, the checkpoint
    if not replace_nodes or nodes == 1:  # a cluster of one has no peers to fill a replacement from
        return Recovery(staging_time(needed, nodes, hw, fanout), needed * (1 if fanout and nodes > 1 else nodes))
    from_peers = needed / (hw.network_gbps * GBIT)
    if peer_replica:  # the lost node's part is on its ring neighbour too
        return Recovery(from_peers, 0)
    return Recovery(max(from_peers, node_ckpt_bytes / _store_rate(hw, 1)), node_ckpt_bytes)


def replay_buckets(buckets: Sequence[Sequence[float]], network_ratio: float, compute_speedup: float) -> float:
    """One step's exposed all-reduce when its buckets' service times scale by network_ratio and backward by
    1 / compute_speedup: the buckets go over the link one after another, and what is left after the last one is
    launched (all gradients computed) is exposed."""
    finished = 0.0
    for launched, service, _ in buckets:
        finished = max(launched / compute_speedup, finished) + service * network_ratio
    return max(finished - buckets[-1][0] / compute_speedup, 0.0)


def _exposed_comm(b: StepBreakdown, network_ratio: float, compute_speedup: float) -> float:
    """Exposed gradient all-reduce over the measured steps on the target.

    With the step's bucket profile: the buckets replayed at the target's bandwidth, plus what the replay of the
    measurement leaves unexplained (the tail after the last all-reduce: waking the training thread, copying the
    averaged buckets back), kept as measured. Without one: the overlapped part stays as capacity to hide behind,
    exposed' = max(0, total × ratio − hidden)."""
    if b.comm_buckets:
        residual = b.comm_exposed_s / b.steps - replay_buckets(b.comm_buckets, 1.0, 1.0)
        return b.steps * max(replay_buckets(b.comm_buckets, network_ratio, compute_speedup) + residual, 0.0)
    hidden = (b.comm_total_s - b.comm_exposed_s) / compute_speedup
    return max(0.0, b.comm_total_s * network_ratio - hidden)


def _checkpoint_time(b: StepBreakdown, measured: Hardware, target: Hardware, mode: str) -> tuple[float, float]:
    """(training blocked on checkpoints, the part of it waiting on the store) over the measured steps."""
    if mode != b.ckpt_mode:  # only ever to async: the staged scenario
        return b.ckpt_bytes / (target.memory_copy_gb_s * GB), 0.0
    local = b.ckpt_block_s - b.ckpt_upload_wait_s
    if mode == "async":
        local *= _ratio(measured.memory_copy_gb_s, target.memory_copy_gb_s)
    else:
        local *= _ratio(measured.local_disk_write_mb_s, target.local_disk_write_mb_s)
    upload = b.ckpt_upload_wait_s * _ratio(measured.store_gbps, target.store_gbps)
    return local + upload, upload


def predict(breakdown: StepBreakdown, measured: Hardware, target: Target, job: Job) -> Prediction:
    """The measured steps replayed on target.hardware (see the module's docstring for every formula)."""
    b, hw = breakdown, target.hardware
    if b.steps < 1 or b.wall_s <= 0:
        raise ValueError(f"breakdown of {b.steps} steps in {b.wall_s}s: nothing measured to predict from")
    notes = []
    if hw.compute_speedup == 1.0 and hw.instance_type != measured.instance_type:
        notes.append("compute assumed as measured (give the target's compute speedup to change it)")
    source = "local" if target.staged else b.data_source
    if source == "local" and hw.local_disk_read_mb_s is None:
        if target.staged:
            raise ValueError(f"{hw.label}: no local disk to stage to: give its local_disk_read_mb_s")
        source = "remote"
        notes.append("no local NVMe: reads every batch from the store")
    mode = "async" if target.staged else b.ckpt_mode

    network_ratio = measured.network_gbps / hw.network_gbps
    comm_total = b.comm_total_s * network_ratio
    exposed = _exposed_comm(b, network_ratio, hw.compute_speedup)
    data = _data_time(b, measured, hw, source)
    block, upload = _checkpoint_time(b, measured, hw, mode)
    compute = b.t_compute / hw.compute_speedup
    step = replace(b, wall_s=compute + exposed + b.sync_wait_s + data + block, comm_exposed_s=exposed,
                   comm_total_s=comm_total, data_wait_s=data, ckpt_block_s=block, ckpt_upload_wait_s=upload,
                   data_source=source, ckpt_mode=mode)
    staging = staging_time(job.dataset_bytes, b.nodes, hw, target.fanout) if source == "local" else 0.0
    flush = (b.ckpt_bytes / b.ckpt_saves / (hw.store_gbps * GBIT)
             if mode != "direct" and b.ckpt_saves > 0 else 0.0)
    lost = recovery(job.dataset_bytes if source == "local" else 0,
                    b.ckpt_bytes // b.ckpt_saves if b.ckpt_saves > 0 else 0, b.nodes, hw, target.fanout,
                    target.replace_nodes, target.peer_replica)
    return Prediction(label=hw.label, kind=target.kind, hardware=hw, step=step, job_steps=job.steps,
                      staging_s=staging, flush_s=flush, price_per_hour=target.price_per_hour,
                      speedup=b.wall_s / step.wall_s if step.wall_s > 0 else math.inf, notes=tuple(notes),
                      recovery_s=lost.seconds, recovery_store_bytes=lost.store_bytes)


LOCAL_NVME_LABEL = "local NVMe instead of network storage"
FANOUT_LABEL = "local NVMe, fan-out staging"
REPLACE_LABEL = "local NVMe, fan-out, replace-one"


def scenarios(measured: Hardware, price_per_hour: float | None, nodes: int = 1) -> list[Target]:
    """As measured (the sanity row: it reproduces the measurement), 2× network, and local NVMe + async checkpoints
    (omitted when the measured hardware has no local disk figure to stage to), that staged with fan-out too, and
    that with a lost node replaced alone (both on more than one node)."""
    rows = [Target(replace(measured, label="as measured"), price_per_hour, "measured"),
            Target(replace(measured, network_gbps=measured.network_gbps * 2, label="2× network"), price_per_hour,
                   "scenario")]
    if measured.local_disk_read_mb_s is not None:
        rows.append(Target(replace(measured, label=LOCAL_NVME_LABEL), price_per_hour, "scenario", staged=True))
        if nodes > 1:
            rows.append(Target(replace(measured, label=FANOUT_LABEL), price_per_hour, "scenario", staged=True,
                               fanout=True))
            rows.append(Target(replace(measured, label=REPLACE_LABEL), price_per_hour, "scenario", staged=True,
                               fanout=True, replace_nodes=True))
    return rows


def what_if(breakdown: StepBreakdown, measured: Hardware, job: Job, price_per_hour: float | None = None,
            targets: Iterable[Target] = ()) -> list[Prediction]:
    """The scenarios on the measured hardware, then every target (e.g. catalog_targets), in that order."""
    rows = [*scenarios(measured, price_per_hour, breakdown.nodes), *targets]
    return [predict(breakdown, measured, target, job) for target in rows]


def instance_hardware(instance: InstanceType) -> Hardware:
    """The catalog's network figure; the store and disk figures are this module's estimates."""
    drives = instance.local_nvme_count
    return Hardware(network_gbps=instance.network_gbps, store_gbps=min(instance.network_gbps, STORE_GBPS_PER_NODE),
                    local_disk_read_mb_s=drives * NVME_READ_MB_S_PER_DRIVE if drives else None,
                    local_disk_write_mb_s=drives * NVME_WRITE_MB_S_PER_DRIVE if drives else None,
                    instance_type=instance.name, label=instance.key)


def catalog_targets(catalog: Catalog, spec: ClusterSpec, compute_speedup: float = 1.0) -> list[Target]:
    """One target per instance type the optimizer finds for spec, at its cheapest region's on-demand price × nodes
    (spot is left out: its price buys no promise of finishing). Raises NoCandidateError like the optimizer."""
    found: dict[str, Target] = {}
    # candidates() sorts cheapest first, so the first offer of a type is its cheapest region.
    for offer in candidates(spec.model_copy(update={"spot": "never"}), catalog, hours=1.0):
        instance = catalog.get(offer.provider, offer.instance_type)
        if instance is None or instance.key in found:
            continue
        hardware = replace(instance_hardware(instance), compute_speedup=compute_speedup,
                           label=f"{instance.key} {offer.region}")
        found[instance.key] = Target(hardware, offer.cluster_per_hour)
    return list(found.values())


@dataclass(frozen=True)
class Choice:
    prediction: Prediction | None
    reason: str  # one line: what was chosen and why, or why nothing was


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def cheapest_meeting(predictions: Sequence[Prediction], deadline_s: float = math.inf) -> Choice:
    """The cheapest priced prediction whose job ends within deadline_s (ties: the faster); None with the reason."""
    deadline = "no deadline" if math.isinf(deadline_s) else f"deadline {_hours(deadline_s)}"
    priced = [p for p in predictions if p.cost_usd is not None]
    if not priced:
        return Choice(None, f"none: no candidate has a price ({deadline})")
    meeting = [p for p in priced if p.job_s <= deadline_s]
    if not meeting:
        fastest = min(priced, key=lambda p: p.job_s)
        return Choice(None, f"none meets the {deadline}: the fastest, {fastest.label}, takes {_hours(fastest.job_s)} "
                            f"(${fastest.cost_usd:,.2f})")
    best = min(meeting, key=lambda p: (p.cost_usd, p.job_s))
    return Choice(best, f"{best.label}: {_hours(best.job_s)}, ${best.cost_usd:,.2f} ({deadline})")
