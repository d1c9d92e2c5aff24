"""Everything that can be checked before a cluster is paid for, and what the run will do."""

from __future__ import annotations

import re
from dataclasses import dataclass

from infra.catalog import CatalogError, load_catalog
from infra.checkpoints import CheckpointStore
from infra.dataset.manifest import DatasetError, load_manifest
from infra.dataset.validate import validate_dataset
from infra.optimizer import Candidate, NoCandidateError, candidates, render_candidates
from infra.providers import get_provider
from infra.spec import JobSpec
from infra.storage import StorageError, open_store
from infra.workload.plan import WorkloadError, WorkloadPlan, plan_workload

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class PlanError(ValueError):
    """The job cannot run as configured; one line naming the thing and the fix."""


@dataclass(frozen=True)
class Plan:
    run_id: str
    cluster_name: str
    provider: str
    nodes: int
    world_size: int
    dataset_url: str
    dataset_bytes: int
    dataset_shards: int
    dataset_tokens: int
    loss_floor: float
    checkpoint_url: str
    resume_step: int | None
    workload: WorkloadPlan
    candidates: tuple[Candidate, ...] = ()  # cloud providers: where to launch, in the order failover tries

    def render(self) -> str:
        resume = f"resume from committed step {self.resume_step}" if self.resume_step is not None else "start at step 0"
        return "\n".join([
            f"run {self.run_id} on {self.provider}: {self.nodes} nodes × {self.world_size // self.nodes} processes "
            f"(cluster {self.cluster_name})",
            f"  dataset: {self.dataset_url} — {self.dataset_shards} shards, {self.dataset_tokens:,} tokens, "
            f"{self.dataset_bytes / 1e6:.1f} MB, loss floor {self.loss_floor:.4f} nats",
            f"  checkpoints: {self.checkpoint_url} — {resume}",
            self.workload.render(),
            *(f"  warning: {warning}" for warning in self.workload.warnings),
            *self._render_candidates(),
        ])

    def _render_candidates(self) -> list[str]:
        if not self.candidates:
            return []
        best = self.candidates[0]
        return [f"  candidates: {len(self.candidates)}, cheapest {best.label()} — job ≤ ${best.job_cost:,.2f} "
                f"(${best.cluster_per_hour:,.2f}/h × {best.hours:g} h, training.timeout_s)",
                render_candidates(list(self.candidates))]


def cluster_name_for(run_id: str) -> str:
    return f"tp-{run_id}".lower().replace("_", "-").replace(".", "-")


def checkpoint_url_for(job: JobSpec, run_id: str) -> str:
    return f"{job.checkpoints.url}/{run_id}"


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


def plan_job(job: JobSpec, run_id: str) -> Plan:
    if not RUN_ID.match(run_id):
        raise PlanError(f"run id '{run_id}': use letters, digits, '.', '_' or '-' (at most 64)")
    get_provider(job.cluster.provider)
    found = cluster_candidates(job)
    try:
        dataset = open_store(job.dataset.url)
        manifest = load_manifest(dataset)
    except (DatasetError, StorageError) as exc:
        raise PlanError(str(exc)) from None
    report = validate_dataset(dataset, deep=job.dataset.validation == "full")
    if not report.ok:
        raise PlanError(f"dataset {job.dataset.url} is not usable: " + "; ".join(report.problems))

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
    latest = CheckpointStore(checkpoints).latest()
    return Plan(
        run_id=run_id, cluster_name=cluster_name_for(run_id), provider=job.cluster.provider,
        nodes=job.cluster.nodes, world_size=job.cluster.nodes * job.cluster.procs_per_node,
        dataset_url=job.dataset.url, dataset_bytes=sum(s.bytes for s in manifest.shards),
        dataset_shards=len(manifest.shards), dataset_tokens=manifest.total_tokens, loss_floor=manifest.loss_floor,
        checkpoint_url=checkpoint_url, resume_step=latest.step if latest else None, workload=workload,
        candidates=found,
    )
