"""The ``swarmgrad`` command: bootstrap, status, dashboard, peer, keygen, run, demo, lab and doctor.

Logs go to stderr; what scripts read (addresses, JSON) goes to stdout. Errors a user can fix are
printed as one ``error: ...`` line with a non-zero exit code, never as a traceback.
"""

from __future__ import annotations

import atexit
import gc
import logging
import re
from pathlib import Path
from typing import Any, Coroutine, List, Optional

import typer

from swarmgrad.commands.exits import EXIT_CONFIG_ERROR, call_reporting_errors
from swarmgrad.commands.flags import with_options
from swarmgrad.dashboard.settings import DashboardSettings
from swarmgrad.demo.settings import TASK_INNER_STEPS, DemoSettings
from swarmgrad.demo.settings import peer_config as demo_peer_config
from swarmgrad.errors import ConfigError
from swarmgrad.peer.options import BOOTSTRAP_OPTIONS, PEER_OPTIONS, Given, Option, OptionSet
from swarmgrad.peer.strategies.diloco import DiLoCo
from swarmgrad.version import __version__

app = typer.Typer(
    name="swarmgrad",
    help="Decentralized peer-to-peer training: start bootstrap nodes, watch runs, run a local demo swarm.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _help(key: str) -> str:
    """A peer option's help, for the other commands that take it: written once, on its field."""
    option = PEER_OPTIONS.by_key(key)
    assert option is not None, key
    return option.help


InitialPeers = typer.Option(None, "--initial-peers", "-p", envvar="SWARMGRAD_INITIAL_PEERS", metavar="MADDR",
                            help=_help("initial-peers"))
RunId = typer.Option(..., "--run-id", "-r", envvar="SWARMGRAD_RUN_ID", help=_help("run-id"))
JsonOutput = typer.Option(False, "--json", help="Print machine-readable JSON on stdout instead of a table.")
# `peer` and `bootstrap` read their SWARMGRAD_* variables themselves (peer/config_file.py): one per option
ConfigFile = typer.Option(None, "--config", "-c", envvar="SWARMGRAD_CONFIG", metavar="FILE.toml",
                          help="TOML file of options (keys: the flag names without --; FILE.json: JSON); flags and "
                               "SWARMGRAD_* variables override it.")
PrintConfig = typer.Option(False, "--print-config", help="Print the merged options as TOML (--config reads it back) "
                           "and exit without starting anything.", show_default=False)
PRECEDENCE = ("Precedence: each option is taken from its flag, else from its SWARMGRAD_* environment variable "
              "(SWARMGRAD_INNER_STEPS for --inner-steps; lists comma or space separated), else from the --config "
              "TOML file (flat; keys are the flag names without --, e.g. inner-steps = 20), else its default.")


def _split_addresses(values: Optional[List[str]]) -> list[str]:
    """Accept repeated flags, comma- or space-separated lists (the env var form)."""
    return [part for value in values or [] for part in re.split(r"[,\s]+", value) if part]


def _run(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run a command's coroutine, turning user-fixable errors into one line and an exit code."""
    from swarmgrad.eventloop import run

    return call_reporting_errors(lambda: run(coroutine))


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"swarmgrad {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="More logs on stderr (-vv for debug)."),
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True, help="Show the version."),
) -> None:
    from swarmgrad.eventloop import configure_logging

    configure_logging(logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG)


@app.command(epilog=PRECEDENCE)
@with_options(BOOTSTRAP_OPTIONS)
def bootstrap(
    ctx: typer.Context,
    config_file: Optional[Path] = ConfigFile,
    print_config: bool = PrintConfig,
    json_output: bool = typer.Option(False, "--json", help="With --print-config: print JSON instead of TOML."),
    *,
    flags: dict[Option, Given],
) -> None:
    """Start a long-lived DHT and relay node that others join through.

    Prints its multiaddrs, one per line, on stdout; runs until SIGINT or SIGTERM.
    """
    from swarmgrad.commands.bootstrap import run_bootstrap

    models = _load(BOOTSTRAP_OPTIONS, flags, config_file)
    if print_config:
        _print_config(BOOTSTRAP_OPTIONS, models, json_output)
        return
    config = models["bootstrap"]
    _run(run_bootstrap(config.network, config.run_id))


@app.command()
def status(
    run_id: str = RunId,
    initial_peers: Optional[List[str]] = InitialPeers,
    json_output: bool = JsonOutput,
    watch: bool = typer.Option(False, "--watch", "-w", help="Keep refreshing until Ctrl-C."),
    interval: float = typer.Option(2.0, "--interval", min=0.2, help="Seconds between refreshes with --watch."),
    timeout: float = typer.Option(10.0, "--timeout", min=0.5, help="Seconds to keep trying the initial peers."),
) -> None:
    """Show the live members of a run: id, address, role, step, samples/s, last seen."""
    from swarmgrad.dht.config import NodeConfig

    peers = _split_addresses(initial_peers)
    if not peers:
        typer.echo("error: status needs --initial-peers (or SWARMGRAD_INITIAL_PEERS) to find the run", err=True)
        raise typer.Exit(EXIT_CONFIG_ERROR)
    config = _validated(lambda: NodeConfig(initial_peers=peers, client_mode=True, bootstrap_timeout=timeout))
    from swarmgrad.commands.status import run_status  # after the checks: it loads hivemind and torch

    _run(run_status(config, run_id, json_output=json_output, watch=watch, interval=interval))


@app.command()
def dashboard(
    run_id: str = RunId,
    initial_peers: Optional[List[str]] = InitialPeers,
    host: str = typer.Option(DashboardSettings.model_fields["host"].default, "--host", help="Address to serve the page on; 0.0.0.0 to open it from other machines."),
    port: int = typer.Option(DashboardSettings.model_fields["port"].default, "--port", min=0, max=65535, help="HTTP port; 0 picks a free one."),
    timeout: float = typer.Option(10.0, "--timeout", min=0.5, help="Seconds to keep trying the initial peers."),
) -> None:
    """Serve a live web dashboard of a run: its members, its loss, speed, rounds and held-out accuracy.

    Prints the page's URL on stdout. JSON is under /api/ (run, members, history, evaluations) and Prometheus metrics at /metrics. The dashboard is a client-mode node of the run (listed as a monitor); it reads the DHT on a fixed schedule and answers every page from that, so watching costs the swarm the same however many pages are open. Runs until SIGINT or SIGTERM.
    """
    from swarmgrad.commands.dashboard import run_dashboard
    from swarmgrad.dht.node import NodeConfig

    peers = _split_addresses(initial_peers)
    if not peers:
        typer.echo("error: dashboard needs --initial-peers (or SWARMGRAD_INITIAL_PEERS) to find the run", err=True)
        raise typer.Exit(EXIT_CONFIG_ERROR)
    settings = _validated(lambda: DashboardSettings(host=host, port=port))
    config = _validated(lambda: NodeConfig(initial_peers=peers, client_mode=True, bootstrap_timeout=timeout))
    _run(run_dashboard(config, run_id, settings))


@app.command(epilog=f"{PRECEDENCE} Run settings left unset take the run's when joining a run that has a manifest.")
@with_options(PEER_OPTIONS)
def peer(
    ctx: typer.Context,
    config_file: Optional[Path] = ConfigFile,
    print_config: bool = PrintConfig,
    json_output: bool = typer.Option(False, "--json", help="Print progress events as JSON lines on stdout (with "
                                     "--print-config: the options as JSON).", show_default=False),
    *,
    flags: dict[Option, Given],
) -> None:
    """Train TASK as a peer of run RUN_ID; with no TASK, join a public run with the settings in its manifest.

    With --create and no --initial-peers, this peer starts run RUN_ID as its first peer and prints on stderr how others join.

    On a terminal it shows a live panel (step, epoch, peers, loss, samples/s, rounds, traffic, held-out accuracy); on a pipe, a line every few seconds; with --json, events on stdout. Each held-out evaluation is published as a signed record of the run, for its dashboards.

    Stops on Ctrl-C/SIGTERM, --max-seconds, --max-steps or --target-accuracy; leaves the run cleanly. SIGUSR1 pauses the peer (it leaves any round, trains nothing, stays in the run marked paused) and SIGUSR2 resumes it.
    """
    models = _load(PEER_OPTIONS, flags, config_file)
    if print_config:
        _print_config(PEER_OPTIONS, models, json_output)
        return
    from swarmgrad.commands.peer import run_peer

    ticket = models["peer"].connection.ticket
    if ticket is not None:  # a bad ticket is an error before anything starts
        from swarmgrad.dht.tickets import Ticket

        _validated(lambda: Ticket.load(ticket))
    call_reporting_errors(lambda: run_peer(models["run"], models["peer"], json_output=json_output))


def _load(options: OptionSet, flags: dict[Option, Given], config_file: Optional[Path]) -> dict[str, Any]:
    """The command's models: flags given on the command line, then SWARMGRAD_* variables, then the
    --config file, then defaults (see swarmgrad.peer.options)."""
    from swarmgrad.peer.config_file import load_config

    return _validated(lambda: load_config(options, flags=flags, config_file=config_file))


def _print_config(options: OptionSet, models: dict[str, Any], json_output: bool) -> None:
    from swarmgrad.peer.config_file import render_json, render_toml

    if json_output:
        typer.echo(render_json(options, models))
    else:
        typer.echo(render_toml(options, models), nl=False)


@app.command()
def keygen(path: Path = typer.Argument(..., help="Where to write the new key (must not exist).")) -> None:
    """Create an identity key file; prints the peer id it gives."""
    from swarmgrad.dht.identity import Identity

    identity = Identity.generate()
    try:
        identity.save(path)
    except ConfigError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(EXIT_CONFIG_ERROR) from None
    typer.echo(identity.peer_id)


@app.command()
def demo(
    peers: int = typer.Option(DemoSettings.peers, "--peers", "-n", min=1, max=64, help="Number of peer processes."),
    task: str = typer.Option(DemoSettings.task, "--task", help="Task the swarm trains."),
    strategy: Optional[str] = typer.Option(None, "--strategy", help=_help("strategy")),
    averaging: Optional[str] = typer.Option(None, "--averaging", help=_help("averaging")),
    compression: Optional[str] = typer.Option(None, "--compression", help=_help("compression")),
    inner_steps: Optional[int] = typer.Option(None, "--inner-steps", min=1, help=f"diloco: local steps between averaging (the demo's own default: {DemoSettings.inner_steps}, lm {TASK_INNER_STEPS['lm']}; a run's is {DiLoCo().inner_steps})."),
    target_accuracy: float = typer.Option(DemoSettings.target_accuracy, "--target-accuracy", min=0, max=1, help="Stop once reached."),
    max_seconds: float = typer.Option(DemoSettings.max_seconds, "--max-seconds", min=1, help="Training time budget per peer."),
    plot: Path = typer.Option(DemoSettings.plot, "--plot", help="Where to write the loss/accuracy plot."),
    device: str = typer.Option(DemoSettings.device, "--device", help=_help("device") + " Every peer uses it."),
    json_output: bool = JsonOutput,
    run_id: str = typer.Option(DemoSettings.run_id, "--run-id", help="Run name used on the local swarm."),
    dashboard: bool = typer.Option(False, "--dashboard", help="Also serve the swarm's web dashboard (see `swarmgrad dashboard`) and print its URL.", show_default=False),
    port: int = typer.Option(DashboardSettings.model_fields["port"].default, "--port", min=0, max=65535, help="HTTP port of the dashboard, with --dashboard; 0 picks a free one."),
) -> None:
    """Train a model with a whole swarm on this machine (loopback only): a bootstrap node and N peer
    processes, live progress, a loss/accuracy plot, and the time to 85% and 88% held-out accuracy."""
    from swarmgrad.demo import run_demo

    settings = DemoSettings(peers=peers, run_id=run_id, task=task, strategy=strategy, averaging=averaging,
                            compression=compression,
                            inner_steps=inner_steps or TASK_INNER_STEPS.get(task, DemoSettings.inner_steps),
                            target_accuracy=target_accuracy, max_seconds=max_seconds, plot=plot, device=device)
    _validated(settings.run_config)  # a bad strategy or codec is one line here, not N failing peers
    _validated(lambda: demo_peer_config(settings, 0, []))  # a bad --device is one line here too

    from swarmgrad.device.placement import resolve_device  # torch: only once the options are good

    _validated(lambda: resolve_device(device))  # one unusable GPU: one line, not N failing peers
    board = _validated(lambda: DashboardSettings(port=port)) if dashboard else None
    _run(run_demo(settings, json_output=json_output, dashboard=board))


def _validated(make_config):
    """Build a pydantic config, printing its first problem as one line."""
    import pydantic

    try:
        return make_config()
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        cause = first.get("ctx", {}).get("error")
        message = str(cause) if isinstance(cause, ConfigError) else f"{'.'.join(map(str, first['loc']))}: {first['msg']}"
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(EXIT_CONFIG_ERROR) from None
    except ConfigError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(EXIT_CONFIG_ERROR) from None


from swarmgrad.commands.lab import register as _register_lab  # noqa: E402  (after the other commands)

_register_lab(app)

from swarmgrad.commands.run import register as _register_run  # noqa: E402

_register_run(app)

from swarmgrad.commands.doctor import register as _register_doctor  # noqa: E402

_register_doctor(app)


def main() -> None:
    # Freeze the heap as the interpreter shuts down: its last collections would otherwise walk the
    # ~380k objects torch and hivemind leave, 1-2 s each on a busy 2-core machine (a peer's exit
    # took 3-26 s after its last event; 1-2.5 s frozen), past the demo's 10 s grace for its peers.
    atexit.register(gc.freeze)  # registered first: runs after every other exit handler
    app()


if __name__ == "__main__":
    main()
