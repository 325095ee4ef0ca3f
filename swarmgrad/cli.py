"""The ``swarmgrad`` command: bootstrap, status, keygen and demo.

Logs go to stderr; what scripts read (addresses, JSON) goes to stdout. Errors a user can fix are
printed as one ``error: ...`` line with a non-zero exit code, never as a traceback.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Coroutine, List, Optional

import typer

from swarmgrad.errors import ConfigError, SwarmgradError
from swarmgrad.version import __version__

app = typer.Typer(
    name="swarmgrad",
    help="Decentralized peer-to-peer training: start bootstrap nodes, watch runs, run a local demo swarm.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

EXIT_RUNTIME_ERROR = 1
EXIT_CONFIG_ERROR = 2
EXIT_INTERRUPTED = 130

InitialPeers = typer.Option(
    None,
    "--initial-peers",
    "-p",
    envvar="SWARMGRAD_INITIAL_PEERS",
    metavar="MADDR",
    help="Multiaddr of a running node, e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...; repeat the flag or separate with commas.",
)
RunId = typer.Option(..., "--run-id", "-r", envvar="SWARMGRAD_RUN_ID", help="Name of the training run.")
JsonOutput = typer.Option(False, "--json", help="Print machine-readable JSON on stdout instead of a table.")
Host = typer.Option("127.0.0.1", "--host", envvar="SWARMGRAD_HOST", help="Listen address; 0.0.0.0 to accept peers from other machines.")
Port = typer.Option(0, "--port", envvar="SWARMGRAD_PORT", help="TCP port to listen on; 0 picks a free one.")


def _split_addresses(values: Optional[List[str]]) -> list[str]:
    """Accept repeated flags, comma- or space-separated lists (the env var form)."""
    return [part for value in values or [] for part in re.split(r"[,\s]+", value) if part]


def _run(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run a command's coroutine, turning user-fixable errors into one line and an exit code."""
    from swarmgrad.runtime import run

    try:
        return run(coroutine)
    except ConfigError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(EXIT_CONFIG_ERROR) from None
    except SwarmgradError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(EXIT_RUNTIME_ERROR) from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"swarmgrad {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="More logs on stderr (-vv for debug)."),
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True, help="Show the version."),
) -> None:
    from swarmgrad.runtime import configure_logging

    configure_logging(logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG)


@app.command()
def bootstrap(
    host: str = Host,
    port: int = Port,
    identity: Optional[Path] = typer.Option(
        None, "--identity", "-i", help="Key file (created if missing) so the node keeps its peer id across restarts."
    ),
    run_id: Optional[str] = typer.Option(None, "--run-id", "-r", help="Also list this node as a member of the run."),
    announce: Optional[List[str]] = typer.Option(
        None, "--announce", metavar="MADDR", help="Address to advertise instead of the listen address (port forwarding)."
    ),
    initial_peers: Optional[List[str]] = InitialPeers,
) -> None:
    """Start a long-lived DHT and relay node that others join through.

    Prints its multiaddrs, one per line, on stdout; runs until SIGINT or SIGTERM.
    """
    from swarmgrad.commands.bootstrap import run_bootstrap
    from swarmgrad.dht.node import NodeConfig

    def config() -> NodeConfig:
        return NodeConfig(
            host=host,
            port=port,
            identity_path=identity,
            announce_maddrs=_split_addresses(announce),
            initial_peers=_split_addresses(initial_peers),
        )

    _run(run_bootstrap(_validated(config), run_id))


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
    from swarmgrad.commands.status import run_status
    from swarmgrad.dht.node import NodeConfig

    peers = _split_addresses(initial_peers)
    if not peers:
        typer.echo("error: status needs --initial-peers (or SWARMGRAD_INITIAL_PEERS) to find the run", err=True)
        raise typer.Exit(EXIT_CONFIG_ERROR)
    config = _validated(lambda: NodeConfig(initial_peers=peers, client_mode=True, bootstrap_timeout=timeout))
    _run(run_status(config, run_id, json_output=json_output, watch=watch, interval=interval))


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
    peers: int = typer.Option(4, "--peers", "-n", min=1, max=64, help="Number of peer processes."),
    json_output: bool = JsonOutput,
    run_id: str = typer.Option("demo", "--run-id", help="Run name used on the local swarm."),
) -> None:
    """Run a whole swarm on this machine (loopback only): a bootstrap node and N peer processes."""
    from swarmgrad.demo import run_demo

    _run(run_demo(peers=peers, run_id=run_id, json_output=json_output))


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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
