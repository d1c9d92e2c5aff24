"""Everything that can be checked before a cluster is paid for, and what the run will do."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from infra.checkpoints.layout import CheckpointError, CheckpointManifest
from infra.checkpoints.store import CheckpointStore
from infra.compute.catalog import CatalogError, load_catalog
from infra.compute.optimizer import Candidate, NoCandidateError, candidates, render_candidates
from infra.compute.providers import check_site as site_can_hold
from infra.compute.spec import ClusterSpec
from infra.dataset.docs import write_data_docs
from infra.dataset.manifest import DatasetError
from infra.dataset.planning import CarriesValidation, DatasetPlan, ExpectationsFailed, freeze, plan_dataset, plan_input
from infra.dataset.snapshot import input_snapshot_key, load_snapshot
from infra.dataset.spec import InputSpec
from infra.dataset.stagecache import CACHE_DIR, cached_bytes
from infra.job.disk_budget import CheckpointSize, DiskBudget, node_budget, size
from infra.job.parent import ParentError, RunParent, fix_parent, kept_parent, load_parent, resolve_parent
from infra.job.secrets import BlockReader, SecretMissing, resolve_secrets
from infra.job.spec import JobSpec
from infra.job.store_access import azure_account_problem, store_access_problem
from infra.registry import CheckpointTarget, RegistryError, resolve_checkpoint
from infra.storage import ObjectStore, StorageError, open_store
from infra.storage.azure_account import use_job_account
from infra.workload.plan import WorkloadError, WorkloadPlan, plan_workload
from infra.workspace import local_clusters_dir, run_dir

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class PlanError(ValueError):
    """The job cannot run as configured; one line naming the thing and the fix."""


class DatasetCheckFailed(CarriesValidation, PlanError):
    """The dataset's expectation suite failed: the plan's one line, and every expectation's result."""


@dataclass(frozen=True)
class Plan:
    run_id: str
    cluster_name: str
    provider: str
    nodes: int
    world_size: int
    dataset_url: str
    dataset: DatasetPlan
    checkpoint_url: str
    resume_step: int | None
    workload: WorkloadPlan
    candidates: tuple[Candidate, ...] = ()  # cloud providers: where to launch, in the order failover tries
    # training.init_from resolved at the run's first attempt: the weights a fresh start begins from
    parent: RunParent | None = None
    parent_fixed: bool = False  # the run already kept its parent (a rerun of the run id): not resolved again
    inputs: dict[str, DatasetPlan] = field(default_factory=dict)  # name -> its plan (snapshot, files, bytes)
    disk: tuple[DiskBudget, ...] = ()  # what each node will hold on its scratch disk, by rank
    cluster_warnings: tuple[str, ...] = ()  # what the provider's section warns of (e.g. no way to end itself)
    hang_timeout_s: float = 0.0  # training.hang_timeout_s (0: off)

    @property
    def init_from(self) -> CheckpointTarget | None:
        return self.parent.target if self.parent is not None else None

    @property
    def inputs_bytes(self) -> int:
        """What every node holds of the inputs once staged (each input is replicated)."""
        return sum(plan.bytes for plan in self.inputs.values())

    def render(self) -> str:
        resume = f"resume from committed step {self.resume_step}" if self.resume_step is not None else "start at step 0"
        return "\n".join([
            f"run {self.run_id} on {self.provider}: {self.nodes} nodes × {self.world_size // self.nodes} processes "
            f"(cluster {self.cluster_name})",
            *self.dataset.render_lines(),
            *(line for plan in self.inputs.values() for line in plan.render_lines()),
            f"  checkpoints: {self.checkpoint_url} — {resume}",
            *([f"  warm start: {self.parent.url}" + self._parent_note()] if self.parent is not None else []),
            *([f"  disk per node (largest): {max(self.disk, key=lambda b: b.total).render()}"] if self.disk else []),
            self.workload.render(),
            self._render_hang(),
            *(f"  warning: {warning}" for warning in (*self.workload.warnings, *self.cluster_warnings)),
            *self._render_candidates(),
        ])

    def _render_hang(self) -> str:
        if self.hang_timeout_s <= 0:
            return "  hang detection: off (training.hang_timeout_s 0)"
        return (f"  hang detection: no new step and no new checkpoint for {self.hang_timeout_s:g}s → every rank's "
                "stacks, then a restart from the latest commit; armed by the script's first step "
                "(TRAINPIPE_METRICS_FILE or its framework's log lines) or checkpoint: a script that reports neither "
                "is not watched")

    def _parent_note(self) -> str:
        notes = ([f"{self.parent.init_from} at the run's first attempt"] if self.parent_fixed else []) + (
            ["not restored: the run resumes its own checkpoint"] if self.resume_step is not None else [])
        return f" ({'; '.join(notes)})" if notes else ""

    def _render_candidates(self) -> list[str]:
        if not self.candidates:
            return []
        best = self.candidates[0]
        return [f"  candidates: {len(self.candidates)}, cheapest {best.label()} — job ≤ ${best.job_cost:,.2f} "
                f"(${best.cluster_per_hour:,.2f}/h × {best.hours:g} h, training.timeout_s)",
                render_candidates(list(self.candidates))]


def cluster_name_for(run_id: str) -> str:
    """The run's cluster name, in the characters every provider's names take (lowercase, digits, '-'). Where that
    folds the id (Exp_1 and exp-1 would be one name), a short hash of the exact id keeps distinct runs apart."""
    name = f"tp-{run_id}".lower().replace("_", "-").replace(".", "-")
    if name == f"tp-{run_id}":
        return name
    return f"{name}-{hashlib.sha256(run_id.encode()).hexdigest()[:6]}"


def checkpoint_url_for(job: JobSpec, run_id: str) -> str:
    return f"{job.checkpoints.url}/{run_id}"


def check_site(cluster: ClusterSpec) -> None:
    """A provider whose site can say what it has (slurm: sinfo) refuses a cluster it can never hold here, naming
    what it has, before anything is submitted."""
    try:
        site_can_hold(cluster)
    except ValueError as exc:
        raise PlanError(str(exc)) from None


def cluster_candidates(job: JobSpec) -> tuple[Candidate, ...]:
    """Where a cloud cluster can run, cheapest first; a provider the catalog does not list (local) has none."""
    try:
        catalog = load_catalog()
        if not catalog.for_provider(job.cluster.provider):
            return ()
        # The job's length is bounded by its timeout: the estimate is what the job can cost at most.
        return tuple(candidates(job.cluster, catalog, hours=job.training.timeout_s / 3600))
    except (CatalogError, NoCandidateError) as exc:
        raise PlanError(str(exc)) from None


def _local_disk(budgets: tuple[DiskBudget, ...], what: str) -> None:
    """Local nodes share this machine's disk: together they must fit in what is free (cached objects count as
    free: they are reused or evicted)."""
    root = local_clusters_dir()
    existing = next(p for p in (root, *root.parents) if p.exists())
    free = shutil.disk_usage(existing).free + cached_bytes(root.parent / CACHE_DIR)
    need = sum(budget.total for budget in budgets)
    if need > free:
        largest = max(budgets, key=lambda budget: budget.total)
        raise PlanError(f"{what}: the {len(budgets)} local nodes would hold {size(need)} ({size(largest.total)} on "
                        f"the largest) but {existing} has {size(free)} free: free space, use dataset.shard: split, "
                        f"or a smaller selection (dataset.include/exclude) (node {largest.rank}: {largest.render()})")


def disk_budgets(job: JobSpec, held: tuple[int, ...], inputs_bytes: int = 0,
                 checkpoint: CheckpointSize | None = None, warm_start: bool = False) -> tuple[DiskBudget, ...]:
    """Every node's disk budget by rank; held: each node's share of the dataset as staged."""
    if job.dataset.access != "staged":
        held = tuple(0 for _ in held)  # the trainer reads the dataset from the store: only the inputs are staged
    checkpoint = checkpoint or CheckpointSize(None, "no size known: set checkpoints.size_bytes")
    return tuple(node_budget(rank, share, inputs_bytes, checkpoint, nodes=len(held),
                             keep_local=job.checkpoints.keep_local, warm_start=warm_start,
                             peer_replica=job.peer_replica) for rank, share in enumerate(held))


def fit_on_disks(job: JobSpec, held: tuple[int, ...], found: tuple[Candidate, ...], inputs_bytes: int = 0,
                 checkpoint: CheckpointSize | None = None, warm_start: bool = False) -> tuple[Candidate, ...]:
    """The candidates whose local disk holds a node's whole disk budget (its share of the dataset, every input
    (inputs_bytes), its checkpoints and replicas: infra/job/disk_budget.py); an error naming each term when the disk
    is known (catalog NVMe, this machine) and none does. Other disks are measured at verify (the probe)."""
    budgets = disk_budgets(job, held, inputs_bytes, checkpoint, warm_start)
    if not any(budget.total for budget in budgets):
        return found
    largest = max(budgets, key=lambda budget: budget.total)
    what = largest.held
    if found:
        fitting = tuple(c for c in found if not c.local_nvme_bytes or c.local_nvme_bytes >= largest.total)
        if not fitting:
            disk = max(found, key=lambda c: c.local_nvme_bytes)
            raise PlanError(f"{what}: a node would hold {size(largest.total)} but the largest local NVMe among the "
                            f"{len(found)} candidates ({disk.instance_type}) is {size(disk.local_nvme_bytes)}: "
                            "use dataset.shard: split, more nodes, fewer checkpoints.keep_local, or instance types "
                            f"with more NVMe (node {largest.rank}: {largest.render()})")
        return fitting
    if job.cluster.provider in ("local", "netns"):
        _local_disk(budgets, what)
    return found


def checkpoint_size(job: JobSpec, latest: CheckpointManifest | None, init_from: CheckpointTarget | None
                    ) -> CheckpointSize:
    """One whole checkpoint's size for the disk budget: the run's own latest commit (a resume), else the warm start's,
    else the user's estimate."""
    if latest is not None:
        return CheckpointSize(latest.total_bytes, f"the run's committed step {latest.step}")
    if init_from is not None:
        try:
            manifest = CheckpointStore(open_store(init_from.run_url)).manifest(init_from.step)
        except (CheckpointError, StorageError) as exc:
            raise PlanError(f"training.init_from: {exc}") from None
        return CheckpointSize(manifest.total_bytes, "training.init_from's manifest")
    if job.checkpoints.size_bytes is not None:
        return CheckpointSize(job.checkpoints.size_bytes, "checkpoints.size_bytes")
    return CheckpointSize(None, "no size known: set checkpoints.size_bytes")


def resolve_input_url(ref: str, root_url: str) -> str:
    """The URL of the committed checkpoint a '<model>@<alias>' input names, in the registry under root_url (the
    job's checkpoints.url): the prefix holding that step's files, as the script saved them; PlanError when it names
    nothing committed."""
    try:
        target = resolve_checkpoint(ref, root_url)
        manifest = CheckpointStore(open_store(target.run_url)).manifest(target.step)
    except (RegistryError, CheckpointError, StorageError) as exc:
        raise PlanError(f"input {exc}") from None
    return f"{target.url}/{manifest.files_prefix}".rstrip("/")


def alias_input_url(name: str, ref: str, job: JobSpec, checkpoint_url: str, run_id: str) -> str:
    """The prefix of the input a model alias names: the one the run resolved it to at its first attempt (kept in its
    snapshot), else the checkpoint the alias points at now. An alias moves (tonight's promotion may move it to this
    very run's step), and a rerun must stage what its first attempt did."""
    try:
        frozen = load_snapshot(open_store(checkpoint_url), input_snapshot_key(name))
    except (DatasetError, StorageError) as exc:
        raise PlanError(f"inputs.{name}: {exc}") from None
    if frozen is None:
        return resolve_input_url(ref, job.checkpoints.url)
    if frozen.ref != ref:
        raise PlanError(f"inputs.{name} is {ref} but run {run_id} resolved its input from "
                        f"{frozen.ref or frozen.url} at its first attempt: restore it, or start a new run (a new run "
                        "id)")
    return frozen.url


def _dataset(job: JobSpec, checkpoint_url: str, run_id: str) -> DatasetPlan:
    return _prefix(lambda: plan_dataset(job.dataset, job.cluster.nodes, checkpoint_url, run_id), run_id)


def _inputs(job: JobSpec, checkpoint_url: str, run_id: str) -> dict[str, DatasetPlan]:
    def planned(name: str, entry: InputSpec | str) -> DatasetPlan:
        if isinstance(entry, InputSpec):
            return plan_input(name, entry, job.cluster.nodes, checkpoint_url, run_id)
        spec = InputSpec(url=alias_input_url(name, entry, job, checkpoint_url, run_id))
        return plan_input(name, spec, job.cluster.nodes, checkpoint_url, run_id, ref=entry)

    return {name: _prefix(lambda name=name, entry=entry: planned(name, entry), run_id)
            for name, entry in job.inputs.items()}


def _prefix(plan: Callable[[], DatasetPlan], run_id: str) -> DatasetPlan:
    try:
        return plan()
    except ExpectationsFailed as failed:
        docs = write_data_docs(failed.validation, run_dir(run_id), run_id)
        raise DatasetCheckFailed(f"{failed} (Data Docs: {_shown(docs)})", failed.validation) from None
    except (DatasetError, StorageError) as exc:
        raise PlanError(str(exc)) from None


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _parent(job: JobSpec, run_store: ObjectStore, run_id: str, resumes: bool) -> tuple[RunParent | None, bool]:
    """The committed checkpoint the run begins from, and whether the run had already fixed it: the one kept with the
    run when an earlier attempt fixed it (init_from is not resolved again), else training.init_from resolved now,
    checked now: a missing one costs no cluster."""
    try:
        kept = load_parent(run_store)
        if kept is not None:
            return kept_parent(kept, job.training.init_from, run_id, warm_start=not resumes), True
        if job.training.init_from is None:
            return None, False
        return resolve_parent(job.training.init_from, job.checkpoints.url), False
    except (ParentError, StorageError) as exc:
        raise PlanError(str(exc)) from None


def check_secrets(job: JobSpec, secret_blocks: BlockReader | None) -> dict[str, str]:
    """That each secret the job names is there: their values, for plan's own checks only (never kept); without
    secret_blocks, Prefect's blocks are left to the flow's plan."""
    try:
        return resolve_secrets(job.training.secrets, secret_blocks)
    except SecretMissing as exc:
        raise PlanError(str(exc)) from None


# A check of the job's experiment tracker (infra.tracking.check.check_tracking, a room above this one): raises
# PlanError. Handed in by the callers, so that a job without tracking never loads the tracker's client.
TrackingCheck = Callable[[JobSpec, BlockReader | None], None]


def plan_job(job: JobSpec, run_id: str, secret_blocks: BlockReader | None = None,
             check_tracking: TrackingCheck | None = None) -> Plan:
    """secret_blocks reads Prefect Secret blocks (the flow's plan has one); without it those the job names are
    checked by the flow's plan, still before anything is launched."""
    if not RUN_ID.match(run_id):
        raise PlanError(f"run id '{run_id}': use letters, digits, '.', '_' or '-' (at most 64)")
    secret_values = check_secrets(job, secret_blocks)
    if check_tracking is not None:
        check_tracking(job, secret_blocks)
    if (problem := store_access_problem(job)) is not None:
        raise PlanError(problem)
    if (problem := azure_account_problem(job, os.environ, secret_values)) is not None:
        raise PlanError(problem)
    use_job_account(job.storage.azure)  # every store the run opens here on reaches the config's account
    found = cluster_candidates(job)
    check_site(job.cluster)
    try:
        workload = plan_workload(job.training.code, job.training.setup, job.training.command)
    except WorkloadError as exc:
        raise PlanError(str(exc)) from None
    checkpoint_url = checkpoint_url_for(job, run_id)
    try:
        checkpoints = open_store(checkpoint_url)
        checkpoints.check_writable()
    except StorageError as exc:
        raise PlanError(f"checkpoints.url: {exc}") from None
    dataset = _dataset(job, checkpoint_url, run_id)
    inputs = _inputs(job, checkpoint_url, run_id)
    latest = CheckpointStore(checkpoints).latest()
    parent, parent_fixed = _parent(job, checkpoints, run_id, resumes=latest is not None)
    init_from = parent.target if parent is not None else None
    inputs_bytes = sum(plan.bytes for plan in inputs.values())
    checkpoint = checkpoint_size(job, latest, init_from)
    warm_start = init_from is not None and latest is None
    found = fit_on_disks(job, dataset.node_bytes, found, inputs_bytes, checkpoint, warm_start)
    if dataset.validation is not None:
        write_data_docs(dataset.validation, run_dir(run_id), run_id)
    return Plan(
        run_id=run_id, cluster_name=cluster_name_for(run_id), provider=job.cluster.provider,
        nodes=job.cluster.nodes, world_size=job.cluster.nodes * job.cluster.procs_per_node,
        dataset_url=job.dataset.url, dataset=dataset,
        checkpoint_url=checkpoint_url, resume_step=latest.step if latest else None, workload=workload,
        candidates=found, parent=parent, parent_fixed=parent_fixed, inputs=inputs,
        disk=disk_budgets(job, dataset.node_bytes, inputs_bytes, checkpoint, warm_start),
        cluster_warnings=job.cluster.plan_warnings(), hang_timeout_s=job.training.hang_timeout_s,
    )


def keep_with_run(plan: Plan) -> None:
    """Store beside the run's checkpoints what its first attempt fixed: the dataset and input snapshots and the parent.
    From here on every node, recovery and rerun of this run id stages exactly these objects and starts from (and
    names in its lineage) exactly this parent."""
    for prefix in (plan.dataset, *plan.inputs.values()):
        freeze(prefix, plan.checkpoint_url)
    if plan.parent is not None and not plan.parent_fixed:
        fix_parent(open_store(plan.checkpoint_url), plan.parent)
