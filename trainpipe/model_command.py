"""`trainpipe model ls | show | promote | rollback | lineage | sync`: the model registry in the checkpoint store, and
its mirror in MLflow's model registry (--mlflow URI)."""

from __future__ import annotations

import getpass
import json
import socket
from typing import TYPE_CHECKING, Annotated

import typer

from trainpipe.errors import exit_2_on

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from infra.job.tracking_spec import MlflowSpec
    from infra.registry import AliasMove
    from infra.registry.chain import Link

model_app = typer.Typer(no_args_is_help=True, help="Model aliases (NAME@alias) over committed checkpoints: list, "
                        "promote, roll back, trace lineage.")
user_errors_exit_2 = exit_2_on("infra.registry.refs:RegistryError", "infra.storage:StorageError",
                               "infra.checkpoints.layout:CheckpointError")
RootOpt = Annotated[str, typer.Option("--root", envvar="TRAINPIPE_REGISTRY",
                                      help="the store root that holds the runs (the job's checkpoints.url)")]
RefArg = Annotated[str, typer.Argument(help="NAME@alias, e.g. gpt@production")]
# The MLflow server whose registry mirrors the store's (its credentials: MLFLOW_TRACKING_TOKEN, or
# MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, in the environment as MLflow reads them).
MlflowOpt = Annotated[str | None, typer.Option("--mlflow", help="an MLflow tracking server (http://host:port) whose "
                                               "model registry mirrors the store's")]


def _mlflow_client(uri: str) -> tuple[MlflowSpec, MlflowClient]:
    """MLflow's client, imported only when --mlflow is given."""
    from infra.job.tracking_spec import MlflowSpec
    from infra.tracking.mlflow_run import client_for, use_credentials

    spec = MlflowSpec(uri=uri)
    use_credentials(spec, {})
    return spec, client_for(spec)


def _mirror(uri: str, root: str, model: str, alias: str) -> None:
    """The MLflow alias brought in line with the store's; a failure is said (exit 1), the store's move stands."""
    from infra.tracking.mlflow_registry import mirror_alias
    from infra.tracking.mlflow_run import describe_failure

    spec, client = _mlflow_client(uri)
    try:
        mirrored = mirror_alias(client, root, model, alias)
    except Exception as exc:  # MLflow's own errors, and a server that does not answer: one line, exit 1
        typer.echo(f"error: {model}@{alias} not mirrored in MLflow ({describe_failure(spec, exc)}): `trainpipe model "
                   f"sync --mlflow {uri} --root {root}` repairs it", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"mlflow: {model}@{alias} -> version {mirrored.version or '(nothing)'}"
               + (f" ({mirrored.created} version(s) created)" if mirrored.created else ""))


def _who() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}"


def _model_ref(text: str) -> tuple[str, str]:
    from infra.registry import RegistryError, parse_model_ref

    parsed = parse_model_ref(text)
    if parsed is None:
        raise RegistryError(f"{text!r}: not NAME@alias: give the model and its alias, e.g. gpt@production")
    return parsed


def _metrics(metrics: dict[str, float]) -> str:
    return ", ".join(f"{name}={value:.6g}" for name, value in sorted(metrics.items())) or "-"


def _move_line(move: AliasMove) -> str:
    return (f"#{move.seq} {move.at} {move.who}: {move.previous or '(nothing)'} -> {move.target or '(nothing)'}  "
            f"[{_metrics(move.metrics)}] {move.reason}")


@model_app.command("ls")
@user_errors_exit_2
def ls(root: RootOpt) -> None:
    """Every model and alias with the checkpoint it points at."""
    from infra.registry import Registry

    registry = Registry(root)
    models = registry.models()
    if not models:
        typer.echo(f"{registry.url}: no models yet (trainpipe model promote NAME@alias CKPT)")
    for model, aliases in models.items():
        for alias, move in aliases.items():
            typer.echo(f"{model}@{alias}  {move.target or '(nothing)'}  move #{move.seq} at {move.at} by {move.who}")


@model_app.command("show")
@user_errors_exit_2
def show(ref: Annotated[str, typer.Argument(help="NAME (every alias) or NAME@alias (its history too)")],
         root: RootOpt, mlflow: MlflowOpt = None) -> None:
    """Where the model's aliases point, the checkpoint's evaluation, and (for NAME@alias) every move."""
    from infra.registry import Registry, RegistryError, resolve_checkpoint
    from infra.registry.chain import link

    registry = Registry(root)
    model, alias = _model_ref(ref) if "@" in ref else (ref, None)
    aliases = registry.models().get(model, {})
    if alias is not None:
        aliases = {alias: aliases[alias]} if alias in aliases else {}
    if not aliases:
        raise RegistryError(f"{ref}: no such model or alias in {registry.url}: see trainpipe model ls")
    for name, move in aliases.items():
        typer.echo(f"{model}@{name} -> {move.target or '(nothing)'}")
        if mlflow is not None:
            typer.echo(f"  mlflow: {_mlflow_version(mlflow, model, name)}")
        if move.target is not None:
            typer.echo(f"  eval: {_eval_line(link(resolve_checkpoint(move.target, root)))}")
        if alias is not None:
            typer.echo("  history:")
            for past in registry.history(model, name):
                typer.echo(f"    {_move_line(past)}")


def _mlflow_version(uri: str, model: str, alias: str) -> str:
    """The MLflow version the mirror's alias names, with its source, or why there is none."""
    from mlflow.exceptions import MlflowException

    from infra.tracking.mlflow_run import describe_failure

    spec, client = _mlflow_client(uri)
    missing = f"no version has {model}@{alias} in {uri}: `trainpipe model sync --mlflow {uri}` mirrors it"
    try:
        number = client.get_registered_model(model).aliases.get(alias)
        if number is None:
            return missing
        version = client.get_model_version(model, str(number))
    except MlflowException as exc:
        return missing if exc.error_code == "RESOURCE_DOES_NOT_EXIST" else f"unknown ({describe_failure(spec, exc)})"
    except Exception as exc:  # a server that does not answer: show says so and goes on with the store's facts
        return f"unknown ({describe_failure(spec, exc)})"
    return f"{model} version {version.version} ({version.source}) in {uri}"


def _eval_line(found: Link) -> str:
    return _metrics(found.eval.metrics) if found.eval else "(not evaluated)"


@model_app.command("promote")
@user_errors_exit_2
def promote(
    ref: RefArg,
    checkpoint: Annotated[str, typer.Argument(help="a step URL as `trainpipe run` prints it, a run's root (its "
                                                   "latest commit) or another NAME@alias")],
    root: RootOpt,
    reason: Annotated[str, typer.Option(help="why, recorded in the history")] = "promoted by hand",
    expect: Annotated[str | None, typer.Option(help="refuse unless the alias points here now (a step URL, or "
                                                    "'none' for an alias that names nothing)")] = None,
) -> None:
    """Point NAME@alias at a committed checkpoint (its recorded evaluation goes into the history)."""
    from infra.registry import ANY, Registry, resolve_checkpoint
    from infra.registry.chain import link

    model, alias = _model_ref(ref)
    target = link(resolve_checkpoint(checkpoint, root))
    expected = ANY if expect is None else (None if expect.lower() == "none" else expect)
    move = Registry(root).promote(model, alias, target.target.url, metrics=target.eval.metrics if target.eval else {},
                                  reason=reason, who=_who(), expected_previous=expected)
    first = " (its first promotion)" if move.previous is None else f" (was {move.previous})"
    typer.echo(f"{ref} -> {move.target}{first}")


@model_app.command("rollback")
@user_errors_exit_2
def rollback(ref: RefArg, root: RootOpt, mlflow: MlflowOpt = None) -> None:
    """Move NAME@alias back to where it was before its last move (and, with --mlflow, the MLflow alias after it)."""
    from infra.registry import Registry

    model, alias = _model_ref(ref)
    move = Registry(root).rollback(model, alias, who=_who())
    typer.echo(f"{ref} -> {move.target or '(nothing)'} (rolled back from {move.previous})")
    if mlflow is not None:
        _mirror(mlflow, root, model, alias)


@model_app.command("sync")
@user_errors_exit_2
def sync(root: RootOpt, mlflow: Annotated[str, typer.Option("--mlflow", help="the MLflow tracking server to bring "
                                                            "in line (http://host:port)")]) -> None:
    """Bring MLflow's model registry in line with the store's: a version for every checkpoint an alias has named
    (its URL as source, its lineage as tags), each alias on the version the store's alias names. Idempotent."""
    from infra.registry import Registry

    models = Registry(root).models()
    for model, aliases in models.items():
        for alias in aliases:
            _mirror(mlflow, root, model, alias)
    if not models:
        typer.echo(f"{root}: no models to mirror")


@model_app.command("lineage")
@user_errors_exit_2
def lineage(ref: Annotated[str, typer.Argument(help="NAME@alias, or a checkpoint's step URL")], root: RootOpt,
            as_json: Annotated[bool, typer.Option("--json", help="one JSON list, root first")] = False) -> None:
    """The checkpoint's chain back to its root (trained from scratch), root first: each one's run, data, code,
    parent and evaluation."""
    from infra.registry.chain import lineage_chain

    chain = lineage_chain(ref, root)
    if as_json:
        typer.echo(json.dumps([{"url": found.target.url,
                                "lineage": found.manifest.lineage.model_dump() if found.manifest.lineage else None,
                                "eval": found.eval.metrics if found.eval else None} for found in chain], indent=1))
        return
    for depth, found in enumerate(chain):
        typer.echo(f"{'  ' * depth}{'-> ' if depth else ''}{found.target.url}")
        pad = "  " * depth + "   "
        record = found.manifest.lineage
        if record is None:
            typer.echo(f"{pad}(no lineage recorded)")
        else:
            dataset = f"{record.dataset.url} @ {record.dataset.snapshot_digest or '?'}"
            typer.echo(f"{pad}run {record.run_id} (attempt {record.attempt}), dataset {dataset}")
            for name, snapshot in sorted(record.inputs.items()):
                typer.echo(f"{pad}input {name}: {snapshot.url} @ {snapshot.snapshot_digest or '?'}")
            typer.echo(f"{pad}code {record.code_sha256 or '-'}, config {record.config_hash}, cluster "
                       f"{record.cluster.provider} {record.cluster.instance_type or ''} x{record.cluster.nodes}")
        typer.echo(f"{pad}eval: {_eval_line(found)}")
