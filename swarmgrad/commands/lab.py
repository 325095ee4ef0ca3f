"""``swarmgrad lab``: run a swarm on an emulated internet from a TOML scenario; ``lab list``, ``lab clean``.

``swarmgrad lab SCENARIO`` is short for ``swarmgrad lab run SCENARIO``. Hook it into a typer app with
:func:`register`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from swarmgrad.commands.exits import call_reporting_errors

INTERRUPTED = "interrupted: the lab is torn down"



class _DefaultRun(TyperGroup):
    """``lab SCENARIO [OPTIONS]`` runs the scenario: anything that is not a subcommand goes to ``run``."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


lab_app = typer.Typer(
    cls=_DefaultRun,
    name="lab",
    help="Run a swarm on an emulated internet (links, delay, loss, churn) from a TOML scenario; needs root. "
         "`swarmgrad lab SCENARIO` is `swarmgrad lab run SCENARIO`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def register(app: typer.Typer) -> None:
    """Add ``lab`` (with ``run``, ``list`` and ``clean``) to ``app``."""
    app.add_typer(lab_app, name="lab")


@lab_app.command("run")
def run(
    scenario: str = typer.Argument(..., help="Built-in scenario name (swarmgrad lab list) or path to a .toml file."),
    json_output: bool = typer.Option(False, "--json", help="No dashboard: print the summary as JSON on stdout."),
    plot: Path | None = typer.Option(None, "--plot", help="Where to write the loss/accuracy plot "
                                        "(default: swarmgrad-lab-SCENARIO.png)."),
    duration: float | None = typer.Option(None, "--duration", min=1, help="Training seconds per peer "
                                             "(overrides the scenario; churn given in % scales with it)."),
    quick: bool = typer.Option(False, "--quick", help="Shrink for CI: at most 3 peers, the digits task, 30 s, "
                               "no target accuracy."),
) -> None:
    """Run SCENARIO (a built-in name, see `swarmgrad lab list`, or a .toml file): a live dashboard, the churn
    schedule, then a faults table, the time to 85%/88% held-out accuracy, traffic per epoch and a plot.

    Exit codes: 0 done, 1 runtime error (e.g. not root), 2 bad scenario or flags, 130 interrupted
    (the lab is torn down either way; `swarmgrad lab clean` removes what a killed lab left behind)."""
    from swarmgrad.lab.driver import run_lab
    from swarmgrad.lab.scenario import load_scenario

    call_reporting_errors(lambda: run_lab(load_scenario(scenario), json_output=json_output, plot_path=plot,
                                          duration_override=duration, quick=quick), interrupted=INTERRUPTED)


@lab_app.command("list")
def list_scenarios() -> None:
    """The built-in scenarios, one per line with a description."""
    from swarmgrad.lab.scenario import builtin_scenarios

    scenarios = call_reporting_errors(builtin_scenarios)
    width = max(map(len, scenarios), default=0)
    for name, description in scenarios.items():
        typer.echo(f"{name:<{width}}  {description}")


@lab_app.command("clean")
def clean(
    prefix: list[str] | None = typer.Option(None, "--prefix", help="Clean this lab (a namespace prefix) even "
                                                "if it is not recognisably dead; repeatable."),
) -> None:
    """Remove what dead labs left behind (namespaces, links, processes) and print it."""
    from swarmgrad.lab.network import check_requirements, cleanup, stale_prefixes

    def body() -> None:
        check_requirements()
        prefixes = list(prefix or []) or stale_prefixes()
        removed = 0
        for name in prefixes:
            for item in cleanup(name):
                typer.echo(f"removed {name}: {item}")
                removed += 1
        if not removed:
            typer.echo("nothing to clean: no leftovers of dead labs")

    call_reporting_errors(body)


__all__ = ["lab_app", "register"]
