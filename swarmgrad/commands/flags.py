"""The options of swarmgrad/peer/options.py as typer parameters of a command.

``@with_options(OPTIONS)`` adds one parameter per option to the command's signature (typer reads
signatures), each in the help panel of its section, and hands the command the options given on
the command line as ``flags``. Every flag is read as text and checked by the models, like a
variable or a file value, so a wrong value is the same one-line error wherever it was given.
"""

from __future__ import annotations

import functools
import inspect
import typing
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from swarmgrad.peer.options import Given, Option, OptionSet

_METAVARS = {int: "INT", float: "FLOAT", Path: "PATH", str: "TEXT"}


def with_options(options: OptionSet) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give the command (which takes ``ctx: typer.Context`` and ``flags``) a parameter per option."""

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(function, include_extras=True)
        own = [parameter.replace(annotation=hints.get(name, parameter.annotation))
               for name, parameter in inspect.signature(function).parameters.items() if name != "flags"]
        names = {_name(option): option for option in options.options}

        @functools.wraps(function)
        def command(**values: Any) -> Any:
            ctx: typer.Context = values["ctx"]
            flags = {option: Given(_plain(values.pop(name)), option.flag) for name, option in names.items()
                     if _on_command_line(ctx, name)}
            for name in names:
                values.pop(name, None)
            return function(**values, flags=flags)

        generated = [inspect.Parameter(_name(option), inspect.Parameter.KEYWORD_ONLY, default=default,
                                       annotation=annotation)
                     for option in options.options for annotation, default in [_parameter(option)]]
        parameters = [*own, *generated]
        command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        command.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
        return command

    return decorate


def _name(option: Option) -> str:
    return option.key.replace("-", "_")


def _panel(option: Option) -> str:
    """Run settings apart from the peer's own: they are the run's, shared by all its peers."""
    if option.root == "run":
        return f"Run: {option.section}" if option.section else "Run"
    return (option.section or option.root).capitalize()


def _parameter(option: Option) -> tuple[Any, Any]:
    """The parameter's annotation and typer default: text, repeatable text, or an on/off flag."""
    common = dict(help=option.help or None, show_default=False, rich_help_panel=_panel(option))
    if option.argument is not None:
        return Optional[str], typer.Argument(None, metavar=option.argument, help=option.help, show_default=False)
    names = [option.flag, *([option.short] if option.short else [])]
    if option.shape == "bool":
        return Optional[bool], typer.Option(None, f"{option.flag}/--no-{option.flag_name}", **common)
    if option.shape in ("list", "table"):
        metavar = option.metavar or ("KEY=VALUE" if option.shape == "table" else "TEXT")
        return Optional[List[str]], typer.Option(None, *names, metavar=metavar, **common)
    metavar = option.metavar or _METAVARS.get(option.annotation, "TEXT")
    return Optional[str], typer.Option(None, *names, metavar=metavar, **common)


def _on_command_line(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
