"""How the command line reports a mistake in what the user gave it: one line on stderr and exit code 2."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])


def exit_2_on(*errors: type[Exception]) -> Callable[[F], F]:
    """A command decorator: the given errors become `error: <message>` and exit 2, never a traceback."""

    def decorate(command: F) -> F:
        @wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return command(*args, **kwargs)
            except errors as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(2) from None

        return wrapper  # type: ignore[return-value]

    return decorate
