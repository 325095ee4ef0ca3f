"""``swarmgrad run``: manage private runs; ``run grant`` signs a peer's membership ticket.

Hook it into a typer app with :func:`register`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from swarmgrad.commands.exits import call_reporting_errors

run_app = typer.Typer(
    name="run",
    help="Private runs. A run key is an identity key file (`swarmgrad keygen run.key`); a run whose manifest "
         "names it admits only peers holding a ticket it signed: others' records are ignored and their "
         "streams refused. Grant a ticket per peer id (`swarmgrad run grant`); each peer passes its own with "
         "`swarmgrad peer --ticket FILE`, and the creator's ticket (`--create --ticket FILE`) makes the run private.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def register(app: typer.Typer) -> None:
    """Add ``run`` (with ``grant``) to ``app``."""
    app.add_typer(run_app, name="run")


@run_app.command("grant")
def grant(
    peer_id: str = typer.Argument(..., help="Peer id to admit (12D3KooW...; `swarmgrad keygen FILE` prints a key "
                                            "file's; pass the file to `swarmgrad peer --identity`)."),
    run_key: Path = typer.Option(..., "--run-key", "-k", metavar="KEY", help="The run key: an identity key file "
                                 "(`swarmgrad keygen run.key`). Keep it private: it admits anyone."),
    run_id: Optional[str] = typer.Option(None, "--run-id", "-r", help="Admit the peer to this run only "
                                         "(default: to every run whose manifest names this key)."),
    expires: Optional[float] = typer.Option(None, "--expires", min=1, metavar="SECONDS",
                                            help="The ticket expires this many seconds from now (default: never)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", metavar="FILE",
                                          help="Write the ticket here (default: stdout)."),
) -> None:
    """Sign a membership ticket admitting PEER_ID to the private run(s) of --run-key."""
    from swarmgrad.dht.config import check_run_id
    from swarmgrad.dht.tickets import Ticket, load_run_key

    def body() -> None:
        key = load_run_key(run_key)
        ticket = Ticket.issue(key, peer_id, run_id=None if run_id is None else check_run_id(run_id),
                              expires=None if expires is None else time.time() + expires)
        if output is None:
            typer.echo(ticket.to_json())
        else:
            ticket.save(output)
            typer.echo(f"ticket for {peer_id} written to {output} (run key {ticket.run_key})", err=True)

    call_reporting_errors(body)


__all__ = ["register", "run_app"]
