"""Exit codes and the one-line error reporting every ``swarmgrad`` command shares."""

from __future__ import annotations

from typing import Any, Callable

import typer

from swarmgrad.errors import ConfigError, SwarmgradError

EXIT_RUNTIME_ERROR = 1
EXIT_CONFIG_ERROR = 2
EXIT_INTERRUPTED = 130


def call_reporting_errors(function: Callable[[], Any], interrupted: str = "interrupted") -> Any:
    """Run a command body; user-fixable errors become one ``error:`` line and an exit code.

    An interrupt that carries its own ``exit_code`` (the lab's SIGTERM/SIGHUP) exits with it.
    """
    try:
        return function()
    except ConfigError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(EXIT_CONFIG_ERROR) from None
    except SwarmgradError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(EXIT_RUNTIME_ERROR) from None
    except KeyboardInterrupt as interrupt:
        typer.echo(interrupted, err=True)
        raise typer.Exit(getattr(interrupt, "exit_code", EXIT_INTERRUPTED)) from None
