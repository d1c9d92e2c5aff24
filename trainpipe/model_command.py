"""`trainpipe model ls | show | promote | rollback | lineage`: the model registry in the checkpoint store."""

from __future__ import annotations

import getpass
import json
import socket
from typing import TYPE_CHECKING, Annotated

import typer

from trainpipe.errors import exit_2_on

if TYPE_CHECKING:
    from infra.registry import AliasMove
    from infra.registry.chain import Link

model_app = typer.Typer(no_args_is_help=True, help="Model aliases (NAME@alias) over committed checkpoints: list, "
                        "promote, roll back, trace lineage.")
user_errors_exit_2 = exit_2_on("infra.registry.refs:RegistryError", "infra.storage:StorageError",
                               "infra.checkpoints.layout:CheckpointError")
RootOpt = Annotated[str, typer.Option("--root", envvar="TRAINPIPE_REGISTRY",
                                      help="the store root that holds the runs (the job's checkpoints.url)")]
RefArg = Annotated[str, typer.Argument(help="NAME@alias, e.g. gpt@production")]


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
         root: RootOpt) -> None:
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
        if move.target is not None:
            typer.echo(f"  eval: {_eval_line(link(resolve_checkpoint(move.target, root)))}")
        if alias is not None:
            typer.echo("  history:")
            for past in registry.history(model, name):
                typer.echo(f"    {_move_line(past)}")


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
def rollback(ref: RefArg, root: RootOpt) -> None:
    """Move NAME@alias back to where it was before its last move."""
    from infra.registry import Registry

    model, alias = _model_ref(ref)
    move = Registry(root).rollback(model, alias, who=_who())
    typer.echo(f"{ref} -> {move.target or '(nothing)'} (rolled back from {move.previous})")


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
