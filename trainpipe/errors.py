"""How the command line reports a mistake in what the user gave it: one line on stderr and exit code 2."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])
# An error class, or "module:Name" for one whose module is slow to import (pandas, torch, pydantic behind it).
ErrorRef = type[Exception] | str


def resolve_errors(*errors: ErrorRef) -> tuple[type[Exception], ...]:
    """The classes the references name, importing the modules of those given as "module:Name"."""
    classes = []
    for error in errors:
        if isinstance(error, str):
            module, _, name = error.partition(":")
            error = getattr(importlib.import_module(module), name)
        classes.append(error)
    return tuple(classes)


def exit_on(code: int, *errors: ErrorRef) -> Callable[[F], F]:
    """A command decorator: the errors become `error: <message>` and exit `code`, never a traceback.

    Errors named "module:Name" are imported only once an exception comes through, so `trainpipe --help` and the
    light commands never pay for the imports of the heavy ones.
    """

    def decorate(command: F) -> F:
        @wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return command(*args, **kwargs)
            except Exception as exc:
                if isinstance(exc, typer.Exit) or not isinstance(exc, resolve_errors(*errors)):
                    raise
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(code) from None

        return wrapper  # type: ignore[return-value]

    return decorate


def exit_2_on(*errors: ErrorRef) -> Callable[[F], F]:
    """exit_on(2, …): the exit code of every mistake in what the user gave."""
    return exit_on(2, *errors)
