"""`trainpipe`: the command line. Bad input exits 2 with one line; commands that need no Prefect never import it."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from trainpipe import bench_command, catalog_command, cp_command, model_command, predict_command, serve_command
from trainpipe.errors import exit_2_on, resolve_errors

if TYPE_CHECKING:
    from infra.checkpoints.layout import CheckpointManifest
    from infra.checkpoints.store import CheckpointStore
    from infra.compute.providers import ClusterRecord
    from infra.job.spec import JobSpec

# The infra modules are imported inside the commands that use them, never here: infra.dataset and infra.job.plan bring
# pandas, infra.job.spec pydantic, and `trainpipe --help` or `trainpipe down` should not wait ~0.5 s for them.

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
dataset_app = typer.Typer(no_args_is_help=True, help="Inspect any dataset prefix; create and check token datasets.")
ckpt_app = typer.Typer(no_args_is_help=True, help="List and verify committed checkpoints.")
app.add_typer(dataset_app, name="dataset")
app.add_typer(ckpt_app, name="ckpt")

# By name: imported only once an exception comes through (see trainpipe.errors.exit_on).
USER_ERRORS = ("infra.job.spec:ConfigError", "infra.job.plan:PlanError", "infra.dataset.manifest:DatasetError",
               "infra.storage:StorageError", "infra.checkpoints.layout:CheckpointError",
               "infra.compute.providers:LaunchError", "infra.registry.refs:RegistryError",
               "infra.lifecycle.ownership:ClusterInUse")
user_errors_exit_2 = exit_2_on(*USER_ERRORS)

ConfigArg = Annotated[Path, typer.Argument(help="job config YAML (see examples/local.yaml)")]
RunIdOpt = Annotated[str | None, typer.Option("--run-id", help="reuse a run id to resume its checkpoints")]
# What `trainpipe run` prints as the committed checkpoint: <checkpoints.url>/<run-id>/step-00001000.


def new_run_id(job: JobSpec) -> str:
    return f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


@app.command()
@user_errors_exit_2
def plan(config: ConfigArg, run_id: RunIdOpt = None) -> None:
    """Validate the config, the dataset and the checkpoint store; print what would run. Launches nothing."""
    from infra.job.plan import plan_job
    from infra.job.spec import load_job
    from infra.tracking.check import check_tracking

    job = load_job(config)
    blocks = None
    if any(ref.prefect_secret for ref in job.training.secrets.values()):
        from tasks.secrets import read_secret_block as blocks  # Prefect only for a job that names its blocks
    typer.echo(plan_job(job, run_id or new_run_id(job), secret_blocks=blocks, check_tracking=check_tracking).render())


@app.command()
@user_errors_exit_2
def run(config: ConfigArg, run_id: RunIdOpt = None) -> None:
    """Run the whole pipeline as a Prefect flow and print its summary."""
    import psutil

    from infra.compute.providers import provider_for
    from infra.job.handoff import hand_over
    from infra.job.plan import cluster_name_for, plan_job
    from infra.job.spec import load_job
    from infra.job.summary import LAUNCHED_AT_VAR, RunSummary, load_summary
    from infra.lifecycle.ownership import refuse_live_owner
    from infra.tracking.check import check_tracking
    from infra.workspace import runs_dir
    from trainpipe.prefect_server import BackgroundServer, ServerStartError

    # The run's overhead counts from this command's start (the interpreter and its imports included).
    os.environ.setdefault(LAUNCHED_AT_VAR, str(psutil.Process().create_time()))
    job = load_job(config)
    resuming = run_id is not None
    run_id = run_id or new_run_id(job)
    # Before and after the flow Ctrl-C and SIGTERM end the command at once; within it they cancel the run (flush,
    # commit, teardown: flows.retrain). Prefect re-sends its SIGTERM here once the flow has unwound.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _exit_on_signal)
    server = BackgroundServer().start()
    try:
        if resuming:  # another live orchestrator of this run id: one line, nothing touched (not even its plan)
            refuse_live_owner(provider_for(job.cluster), cluster_name_for(run_id))
        # Fail on bad input before the flow starts, so the user sees one line rather than a flow traceback; the flow's
        # plan task takes this plan rather than list and check the dataset again.
        hand_over(job, plan_job(job, run_id, check_tracking=check_tracking))
    except resolve_errors(*USER_ERRORS) as exc:
        typer.echo(f"error: {exc}", err=True)
        server.stop()  # after the line: the user need not wait for it
        raise typer.Exit(2) from None
    try:
        server.wait()
    except ServerStartError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    from flows.retrain import retrain
    from infra.cancel import CANCEL

    failure: BaseException | None = None
    summary: RunSummary | None = None
    try:
        retrain(job, run_id)
    except resolve_errors(*USER_ERRORS):
        raise
    except (Exception, SystemExit) as exc:  # the flow already logged the traceback; the user gets the summary and
        # one line. SystemExit: the cancelling signal, re-sent by Prefect once the flow unwound.
        if isinstance(exc, SystemExit) and not CANCEL.cancelled:
            raise
        failure = exc
    finally:
        summary_path = runs_dir() / run_id / "summary.json"
        if summary_path.is_file():
            summary = RunSummary.from_dict(load_summary(summary_path))
            typer.echo(summary.render())
            typer.echo(f"summary: {summary_path}")
    if failure is None:
        return
    if summary is not None and summary.status in ("failed", "cancelled"):
        what = (f"cancelled ({summary.error})" if summary.status == "cancelled"
                else f"failed: {type(failure).__name__}: {failure}")
        typer.echo(f"error: run {run_id} {what}; latest committed checkpoint: {summary.checkpoint or 'none'}; "
                   f"resume: {summary.resume_hint(str(config))}", err=True)
    else:
        typer.echo(f"error: run {run_id} failed: {type(failure).__name__}: {failure}", err=True)
    raise typer.Exit(128 + (CANCEL.signum or signal.SIGTERM) if CANCEL.cancelled else 1)


def _exit_on_signal(signum: int, frame: object) -> None:
    """Outside the flow (planning, the server's start; Prefect's re-sent SIGTERM after it): end the command. Python's
    default handler for SIGTERM would end the process without atexit, leaking Prefect's temporary server."""
    from infra.cancel import CANCEL

    CANCEL.cancel(f"{signal.Signals(signum).name} received", signum)
    raise SystemExit(128 + (CANCEL.signum or signum))


@app.command()
@user_errors_exit_2
def up(config: ConfigArg, run_id: RunIdOpt = None) -> None:
    """Launch the cluster only and print its nodes (tear it down with `trainpipe down NAME`)."""
    from infra.compute.providers import launch_cluster
    from infra.job.plan import cluster_name_for
    from infra.job.spec import load_job

    job = load_job(config)
    run_id = run_id or new_run_id(job)
    cluster = launch_cluster(job.cluster, cluster_name_for(run_id), run_id)
    typer.echo(f"cluster {cluster.name} ({cluster.provider}) is up:")
    for node in cluster.nodes:
        typer.echo(f"  {node.name}  rank {node.rank}  {node.address}  {node.workdir}")


@app.command()
@user_errors_exit_2
def down(name: Annotated[str, typer.Argument(help="cluster name, as `trainpipe status` shows it")]) -> None:
    """Tear down a cluster (idempotent)."""
    from infra.compute.providers import all_providers

    removed = [p.name for p in all_providers() if p.terminate(name)]
    typer.echo(f"{name}: torn down on {', '.join(removed)}" if removed else f"{name}: nothing was running")


@app.command()
def status() -> None:
    """Clusters trainpipe launched that still exist, and the latest runs."""
    from infra.compute.providers import all_providers
    from infra.job.summary import load_summary
    from infra.workspace import runs_dir

    records = [r for provider in all_providers() for r in provider.list_clusters()]
    typer.echo(f"{len(records)} clusters")
    for r in records:
        owner = "run alive" if r.owner_alive else "ORPHANED (its run is gone: `trainpipe sweep`)"
        typer.echo(f"  {r.name}  {r.provider}  run {r.run_id}  {r.nodes} nodes  {r.processes} processes  {owner}")
    summaries = sorted(runs_dir().glob("*/summary.json"), key=lambda p: p.stat().st_mtime)[-5:]
    for path in summaries:
        s = load_summary(path)
        typer.echo(f"run {s['run_id']}: {s['status']}, steps {s['steps']}, checkpoint {s['checkpoint']}")


@app.command()
def sweep(
    all_clusters: Annotated[bool, typer.Option("--all", help="also clusters whose run is still alive")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="only say what would be torn down")] = False,
) -> None:
    """Tear down clusters whose run is no longer running (what a killed orchestrator left behind)."""
    from infra.lifecycle.sweep import sweep_clusters

    def say(record: ClusterRecord) -> None:
        typer.echo(f"{'would tear down' if dry_run else 'tearing down'} {record.name} ({record.provider}, "
                   f"run {record.run_id}, {record.processes} processes)")

    swept = len(sweep_clusters(include_alive=all_clusters, dry_run=dry_run, on_cluster=say))
    typer.echo(f"swept {swept} clusters" if not dry_run else f"{swept} clusters would be swept")


@dataset_app.command("synth")
@user_errors_exit_2
def dataset_synth(
    url: Annotated[str, typer.Argument(help="dataset root URL or path")],
    tokens: Annotated[int, typer.Option(help="total tokens")] = 20_000_000,
    vocab_size: Annotated[int, typer.Option(help="vocabulary size")] = 256,
    shard_tokens: Annotated[int, typer.Option(help="tokens per shard (2 bytes each)")] = 16_000_000,
    seed: Annotated[int, typer.Option(help="generator seed")] = 0,
) -> None:
    """Write a synthetic Markov token dataset whose loss floor is known exactly."""
    from infra.dataset.synth import synthesize
    from infra.storage import open_store

    store = open_store(url)
    started = time.perf_counter()
    manifest = synthesize(store, tokens, vocab_size=vocab_size, shard_tokens=shard_tokens, seed=seed)
    typer.echo(f"{store.url}: {len(manifest.shards)} shards, {manifest.total_tokens:,} tokens, vocab "
               f"{manifest.vocab_size}, loss floor {manifest.loss_floor:.4f} nats "
               f"({time.perf_counter() - started:.1f}s)")


@dataset_app.command("validate")
@user_errors_exit_2
def dataset_validate(
    url: Annotated[str, typer.Argument(help="dataset root URL or path")],
    vocab_size: Annotated[int | None, typer.Option(help="the model's vocab size, if it must match")] = None,
    shallow: Annotated[bool, typer.Option("--shallow", help="sizes only: skip checksums and token ranges")] = False,
) -> None:
    """Check the manifest and every shard (schema, counts, token range, checksums) with Great Expectations."""
    from infra.dataset.validate import validate_dataset
    from infra.storage import open_store

    report = validate_dataset(open_store(url), deep=not shallow, expected_vocab=vocab_size)
    typer.echo(report.summary())
    if not report.ok:
        raise typer.Exit(1)


@dataset_app.command("inspect")
@user_errors_exit_2
def dataset_inspect(
    url: Annotated[str, typer.Argument(help="dataset prefix URL or path (any format)")],
    expectations: Annotated[str | None, typer.Option(help="an ExpectationSuite JSON file to run on the tabular "
                                                     "files")] = None,
    include: Annotated[list[str] | None, typer.Option(help="glob of files to look at (repeatable)")] = None,
    exclude: Annotated[list[str] | None, typer.Option(help="glob of files to leave out (repeatable)")] = None,
    validation: Annotated[str, typer.Option(help="full: every row; sample: --sample-rows rows per file")] = "full",
    sample_rows: Annotated[int, typer.Option(help="rows per file that --validation sample reads")] = 1000,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object, for scripts")] = False,
) -> None:
    """Files, bytes and formats under a prefix; row counts and schemas of its Parquet, CSV, JSONL and token files;
    the expectation suite's result (exit 1 when an expectation fails)."""
    from infra.dataset.inspect import inspect_dataset, render
    from infra.dataset.manifest import DatasetError

    if validation not in ("full", "sample"):
        raise DatasetError(f"--validation {validation}: use full or sample")
    report = inspect_dataset(url, include=include or (), exclude=exclude or (), expectations=expectations,
                             validation=validation, sample_rows=sample_rows)
    typer.echo(json.dumps(report, indent=2, default=str) if as_json else render(report))
    if report["validation"] is not None and not all(r["success"] for r in report["validation"]["results"]):
        raise typer.Exit(1)


def split_step_url(url: str, step: int | None = None) -> tuple[str, int | None]:
    """(the run's checkpoint root, the step) from a run's root URL or a step's URL; a step given both ways must
    agree."""
    from infra.checkpoints.layout import CheckpointError
    from infra.checkpoints.steps import PATTERN

    found = re.match(rf"^(?P<root>.+)/{PATTERN}/?$", url)
    if found is None:
        return url, step
    in_url = int(found["step"])
    if step is not None and step != in_url:
        raise CheckpointError(f"{url} names step {in_url} but STEP is {step}: give one of them")
    return found["root"], in_url


@ckpt_app.command("ls")
@user_errors_exit_2
def ckpt_ls(url: Annotated[str, typer.Argument(help="a run's checkpoint root URL, or one of its step URLs")]) -> None:
    """List committed and uncommitted steps."""
    from infra.checkpoints.store import CheckpointStore
    from infra.storage import open_store

    root, _ = split_step_url(url)
    checkpoints = CheckpointStore(open_store(root))
    latest = checkpoints.latest()
    steps = checkpoints.list_steps()
    if not steps:
        typer.echo(f"{checkpoints.store.url}: no checkpoints (committed or not)")
    for step in steps:
        mark = "committed" if step.committed else "uncommitted"
        star = "  <- latest" if latest and step.step == latest.step else ""
        typer.echo(f"step {step.step:>8}  {mark:<11}  {step.files:>3} files  {step.bytes / 1e6:9.2f} MB{star}")
    for note in checkpoints.set_aside_notes():
        typer.echo(f"step {note.step:>8}  set aside   {len(note.keys):>3} files  (attempt {note.attempt}, "
                   f"{note.set_aside_at}): {note.reason}")


@ckpt_app.command("verify")
@user_errors_exit_2
def ckpt_verify(
    url: Annotated[str, typer.Argument(help="a run's checkpoint root URL, or a step's URL as `trainpipe run` prints "
                                            "it (.../<run-id>/step-00001000)")],
    step: Annotated[int | None, typer.Argument(help="default: the step in the URL, else the latest committed")] = None,
) -> None:
    """Check every file against the manifest, then open the checkpoint as its framework would."""
    from infra.analysis.loadable import check_loadable
    from infra.checkpoints.layout import CheckpointError
    from infra.checkpoints.store import CheckpointStore
    from infra.storage import open_store

    root, step = split_step_url(url, step)
    checkpoints = CheckpointStore(open_store(root))
    manifest = checkpoints.verify(step, deep=True)
    with tempfile.TemporaryDirectory(prefix="trainpipe-verify-") as scratch:
        try:
            loaded = check_loadable(checkpoints.restore(Path(scratch), manifest.step))
        except ValueError as exc:
            raise CheckpointError(f"step {manifest.step}: {exc}") from None
    typer.echo(json.dumps({"step": manifest.step, "name": manifest.ref.name, "files": len(manifest.files),
                           "loaded": loaded, "eval": _eval_of(checkpoints, manifest.step),
                           "ancestors": _ancestors(checkpoints.store.url, manifest)}))


def _eval_of(checkpoints: CheckpointStore, step: int) -> dict[str, float] | None:
    record = checkpoints.eval(step)
    return record.metrics if record else None


def _ancestors(run_url: str, manifest: CheckpointManifest) -> list[str]:
    """The step URLs the manifest's lineage descends from, nearest first; RegistryError naming one that is gone."""
    if manifest.lineage is None or manifest.lineage.parent is None:
        return []
    from infra.checkpoints.steps import step_name
    from infra.registry import registry_root_of
    from infra.registry.chain import lineage_chain

    chain = lineage_chain(f"{run_url}/{step_name(manifest.step)}", registry_root_of(run_url))
    return [found.target.url for found in reversed(chain[:-1])]


app.command("serve")(serve_command.serve)
app.command("submit")(user_errors_exit_2(serve_command.submit))


@app.command("cp", help=cp_command.DOC)
@user_errors_exit_2
def cp(
    src: Annotated[str, typer.Argument(help=cp_command.HELP["src"])],
    dst: Annotated[str, typer.Argument(help=cp_command.HELP["dst"])],
    recursive: Annotated[bool, typer.Option("--recursive", "-r", help=cp_command.HELP["recursive"])] = False,
    workers: Annotated[int, typer.Option(min=1, help=cp_command.HELP["workers"])] = cp_command.DEFAULT_CONFIG.workers,
    part_size_mb: Annotated[int, typer.Option(min=1, help=cp_command.HELP["part_size_mb"])] = (
        cp_command.DEFAULT_CONFIG.part_size >> 20
    ),
    engine: Annotated[str, typer.Option(help=cp_command.HELP["engine"])] = cp_command.DEFAULT_CONFIG.engine,
) -> None:
    """`trainpipe cp` as the whole command line lists it (the installed command runs cp_command.main)."""
    cp_command.copy(src, dst, recursive, workers, part_size_mb, engine)


app.command("predict")(predict_command.predict)
app.add_typer(bench_command.bench_app, name="bench")
app.add_typer(catalog_command.catalog_app, name="catalog")
app.add_typer(model_command.model_app, name="model")


def main() -> None:
    sys.exit(app())
