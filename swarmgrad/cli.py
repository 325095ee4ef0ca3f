"""The ``swarmgrad`` command: bootstrap, status, dashboard, peer, keygen, run, demo and lab.

Logs go to stderr; what scripts read (addresses, JSON) goes to stdout. Errors a user can fix are
printed as one ``error: ...`` line with a non-zero exit code, never as a traceback.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Coroutine, List, Optional

import typer

from swarmgrad.averaging.privacy import Privacy
from swarmgrad.averaging.settings import Moshpit
from swarmgrad.commands.exits import EXIT_CONFIG_ERROR, call_reporting_errors
from swarmgrad.commands.options import BootstrapOptions, PeerOptions
from swarmgrad.commands.run_options import AVERAGINGS, STRATEGIES
from swarmgrad.dashboard.settings import DashboardSettings
from swarmgrad.demo.settings import DemoSettings
from swarmgrad.errors import ConfigError
from swarmgrad.peer.config import DiLoCo, GossipSGD, RunConfig, SyncSGD
from swarmgrad.timing import Timing
from swarmgrad.version import __version__

app = typer.Typer(
    name="swarmgrad",
    help="Decentralized peer-to-peer training: start bootstrap nodes, watch runs, run a local demo swarm.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


INITIAL_PEERS_HELP = ("Multiaddr of a running node, e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...; repeat the flag or "
                      "separate with commas.")
HOST_HELP = "Listen address; 0.0.0.0 to accept peers from other machines"
PORT_HELP = "TCP port to listen on; 0 picks a free one"
InitialPeers = typer.Option(None, "--initial-peers", "-p", envvar="SWARMGRAD_INITIAL_PEERS", metavar="MADDR",
                            help=INITIAL_PEERS_HELP)
RunId = typer.Option(..., "--run-id", "-r", envvar="SWARMGRAD_RUN_ID", help="Name of the training run.")
JsonOutput = typer.Option(False, "--json", help="Print machine-readable JSON on stdout instead of a table.")
# `peer` and `bootstrap` read SWARMGRAD_* variables themselves (commands/options.py): one per option
ConfigFile = typer.Option(None, "--config", "-c", envvar="SWARMGRAD_CONFIG", metavar="FILE.toml",
                          help="TOML file of options (keys: the flag names without --); flags and SWARMGRAD_* "
                               "variables override it.")
PrintConfig = typer.Option(False, "--print-config", help="Print the merged options as TOML (--config reads it back) "
                           "and exit without starting anything.", show_default=False)
_RUN_DEFAULTS = RunConfig()  # the run defaults that help texts show: the model's, never a copy


def _either(names: Any) -> str:
    *most, last = list(names)
    return f"{', '.join(most)} or {last}" if most else last


def _natural_averagings() -> str:
    """Which averaging each strategy gets when none is chosen, as RunConfig decides it."""
    by_kind: dict[str, list[str]] = {}
    for name, strategy in STRATEGIES.items():
        by_kind.setdefault(RunConfig(strategy=strategy()).averaging.kind, []).append(name)
    return ", ".join(f"{kind} for {' and '.join(names)}" for kind, names in by_kind.items())


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


@app.command()
def bootstrap(
    ctx: typer.Context,
    host: Optional[str] = typer.Option(None, "--host", help=f"{HOST_HELP} (default {BootstrapOptions.model_fields['host'].default})."),
    port: Optional[int] = typer.Option(None, "--port", help=f"{PORT_HELP} (default {BootstrapOptions.model_fields['port'].default})."),
    identity: Optional[Path] = typer.Option(
        None, "--identity", "-i", help="Key file (created if missing) so the node keeps its peer id across restarts."
    ),
    run_id: Optional[str] = typer.Option(None, "--run-id", "-r", help="Also list this node as a member of the run."),
    announce: Optional[List[str]] = typer.Option(
        None, "--announce", metavar="MADDR", help="Address to advertise instead of the listen address (port forwarding)."
    ),
    initial_peers: Optional[List[str]] = typer.Option(None, "--initial-peers", "-p", metavar="MADDR", help=INITIAL_PEERS_HELP),
    config_file: Optional[Path] = ConfigFile,
    print_config: bool = PrintConfig,
    json_output: bool = typer.Option(False, "--json", help="With --print-config: print JSON instead of TOML."),
) -> None:
    """Start a long-lived DHT and relay node that others join through.

    Prints its multiaddrs, one per line, on stdout; runs until SIGINT or SIGTERM.

    Precedence: each option is taken from its flag, else from its SWARMGRAD_* environment variable (SWARMGRAD_HOST for --host), else from the --config TOML file (keys are the flag names without --), else its default.
    """
    from swarmgrad.commands.bootstrap import run_bootstrap
    from swarmgrad.commands.options import node_config

    loaded = _load_options(ctx, BootstrapOptions, config_file)
    network = _validated(lambda: node_config(loaded))
    if print_config:
        _print_config(loaded, json_output)
        return
    _run(run_bootstrap(network, loaded.options.run_id))


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


def _local_default(name: str) -> Any:
    return PeerOptions.model_fields[name].default


@app.command()
def peer(
    ctx: typer.Context,
    task: Optional[str] = typer.Argument(
        None, help="Task to train: fashion-mnist, digits, charlm, or module:attribute. Omit to use the run's manifest.",
        show_default=False),
    run_id: Optional[str] = typer.Option(None, "--run-id", "-r", help="Name of the training run (required).", show_default=False),
    initial_peers: Optional[List[str]] = typer.Option(None, "--initial-peers", "-p", metavar="MADDR", help=INITIAL_PEERS_HELP),
    create: bool = typer.Option(False, "--create", help="Publish this run's settings (a signed manifest) for others to join; "
                                "without --initial-peers this peer starts the run as its first peer.", show_default=False),
    strategy: Optional[str] = typer.Option(None, "--strategy", help=f"{_either(STRATEGIES)} (default {_RUN_DEFAULTS.strategy.name}).", rich_help_panel="Run"),
    averaging: Optional[str] = typer.Option(None, "--averaging", help=f"{_either(AVERAGINGS)} (default: {_natural_averagings()}).", rich_help_panel="Run"),
    compression: Optional[str] = typer.Option(None, "--compression", help=f"none, fp16, bf16, int8, topk:F, powersgd:R (default {_RUN_DEFAULTS.compression}).", rich_help_panel="Run"),
    aggregator: Optional[str] = typer.Option(None, "--aggregator", help=f"How contributions are combined: mean, centered-clip (bounds what one liar can do; gossip: clipped pushes) or trimmed-mean (default {_RUN_DEFAULTS.aggregator}).", rich_help_panel="Run"),
    inner_steps: Optional[int] = typer.Option(None, "--inner-steps", help=f"diloco: local steps between averaging (default {DiLoCo().inner_steps}).", rich_help_panel="Run"),
    outer_lr: Optional[float] = typer.Option(None, "--outer-lr", help=f"diloco: outer learning rate (default {DiLoCo().outer_lr}).", rich_help_panel="Run"),
    outer_momentum: Optional[float] = typer.Option(None, "--outer-momentum", help=f"diloco: outer Nesterov momentum, in [0, 1) (default {DiLoCo().outer_momentum}).", rich_help_panel="Run"),
    overlap: Optional[str] = typer.Option(None, "--overlap", help=f"diloco: auto, on or off: a round travels while the next local steps run, its outer step applied when it is back; auto does so where rounds and local steps take times within 1/{Timing().overlap_share:g} of each other (default {DiLoCo().overlap}).", rich_help_panel="Run"),
    target_batch_size: Optional[int] = typer.Option(None, "--target-batch-size", help=f"sync: swarm-wide samples per step (default {SyncSGD().target_batch_size}).", rich_help_panel="Run"),
    gossip_every: Optional[int] = typer.Option(None, "--gossip-every", help=f"gossip: local steps between parameter averaging (default {GossipSGD().every}).", rich_help_panel="Run"),
    group_size: Optional[int] = typer.Option(None, "--group-size", help=f"moshpit: peers per group (default {Moshpit().group_size}).", rich_help_panel="Run"),
    privacy_clip: Optional[float] = typer.Option(None, "--privacy-clip", help="Differential privacy: clip norm (with --privacy-noise, turns privacy on; default off).", rich_help_panel="Run"),
    privacy_noise: Optional[float] = typer.Option(None, "--privacy-noise", help="Differential privacy: noise multiplier.", rich_help_panel="Run"),
    privacy_level: Optional[str] = typer.Option(None, "--privacy-level", help=f"update (each released update) or sample (per-sample DP-SGD) (default {Privacy.model_fields['level'].default}).", rich_help_panel="Run"),
    max_epsilon: Optional[float] = typer.Option(None, "--max-epsilon", help="Stop releasing past this epsilon (default: no limit).", rich_help_panel="Run"),
    lr: Optional[float] = typer.Option(None, "--lr", help="Inner learning rate (default: the task's).", rich_help_panel="Run"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Local batch size (default: the task's).", rich_help_panel="Run"),
    seed: Optional[int] = typer.Option(None, "--seed", help=f"Seed of the model's initial weights (default {_RUN_DEFAULTS.seed}).", rich_help_panel="Run"),
    shard: Optional[int] = typer.Option(None, "--shard", help="This peer's data shard (default: a random one).", rich_help_panel="Local"),
    num_shards: Optional[int] = typer.Option(None, "--num-shards", help=f"How many shards the training set is cut into (default {_local_default('num_shards')}).", rich_help_panel="Local"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="fashion-mnist: directory with the IDX files.", rich_help_panel="Local"),
    max_seconds: Optional[float] = typer.Option(None, "--max-seconds", help="Stop after this many seconds of training (counted from `ready`: joined, --wait-peers met).", rich_help_panel="Local"),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Stop after this many local steps.", rich_help_panel="Local"),
    target_accuracy: Optional[float] = typer.Option(None, "--target-accuracy", help="Stop once a held-out evaluation reaches it.", rich_help_panel="Local"),
    eval_every: Optional[float] = typer.Option(None, "--eval-every", help=f"Seconds between held-out evaluations; 0: only at the end (default {_local_default('eval_every')}).", rich_help_panel="Local"),
    eval_batches: Optional[int] = typer.Option(None, "--eval-batches", help="Evaluate on the first N batches of the held-out set only: quicker, less CPU taken from training (default: all of it).", rich_help_panel="Local"),
    no_final_eval: bool = typer.Option(False, "--no-final-eval", help="Skip the held-out evaluation at the end.", rich_help_panel="Local", show_default=False),
    checkpoint_dir: Optional[Path] = typer.Option(None, "--checkpoint-dir", help="Resume from and save checkpoints to this directory.", rich_help_panel="Local"),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads (default: torch's).", rich_help_panel="Local"),
    slowdown: Optional[float] = typer.Option(None, "--slowdown", help=f"Emulate slower hardware: each step takes this many times longer, up to 100 (the swarm lab's stragglers; default {_local_default('slowdown')}).", rich_help_panel="Local"),
    wait_peers: Optional[int] = typer.Option(None, "--wait-peers", help=f"Start training once this many peers (this one included) are in the run (default {_local_default('wait_peers')}).", rich_help_panel="Local"),
    host: Optional[str] = typer.Option(None, "--host", help=f"{HOST_HELP} (default {_local_default('host')}).", rich_help_panel="Network"),
    port: Optional[int] = typer.Option(None, "--port", help=f"{PORT_HELP} (default {_local_default('port')}).", rich_help_panel="Network"),
    data_port: Optional[int] = typer.Option(None, "--data-port", help="TCP port for direct tensor traffic (0: any free one); open it in firewalls.", rich_help_panel="Network"),
    announce: Optional[List[str]] = typer.Option(None, "--announce", metavar="MADDR", help="Address to advertise (port forwarding).", rich_help_panel="Network"),
    identity: Optional[Path] = typer.Option(None, "--identity", "-i", help="Key file, so the peer keeps its id across restarts.", rich_help_panel="Network"),
    ticket: Optional[Path] = typer.Option(None, "--ticket", metavar="FILE", help="Membership ticket of a private run (`swarmgrad run grant`), for this peer's --identity; with --create it makes the run private, with the key that signed it.", rich_help_panel="Network"),
    client_mode: bool = typer.Option(False, "--client-mode", help="Dial out only (behind NAT, no port open).", rich_help_panel="Network", show_default=False),
    trusted_network: bool = typer.Option(False, "--trusted-network", help="Send tensors unencrypted (trusted LAN only).", rich_help_panel="Network", show_default=False),
    upload_limit_mbps: Optional[float] = typer.Option(None, "--upload-limit-mbps", help="Cap on what this peer sends to the swarm (averaging, gossip, state), in Mbit/s (default: no cap).", rich_help_panel="Network"),
    download_limit_mbps: Optional[float] = typer.Option(None, "--download-limit-mbps", help="Cap on what this peer receives from the swarm, in Mbit/s (default: no cap).", rich_help_panel="Network"),
    ban_threshold: Optional[float] = typer.Option(None, "--ban-threshold", help=f"Misbehaviour score at which another peer is banned here (invalid frame 1, clipped 1, weight cut 2, bad state 3; halves every minute; default {_local_default('ban_threshold')}).", rich_help_panel="Network"),
    ban_seconds: Optional[float] = typer.Option(None, "--ban-seconds", help=f"How long a ban lasts: its streams refused, its records ignored (default {_local_default('ban_seconds')}).", rich_help_panel="Network"),
    wait: Optional[float] = typer.Option(None, "--wait", help=f"Seconds to wait for the run's manifest and peers (default {_local_default('wait')}).", rich_help_panel="Network"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="Serve this peer's Prometheus metrics at http://HOST:PORT/metrics (0: any free port; default off).", rich_help_panel="Monitoring"),
    metrics_host: Optional[str] = typer.Option(None, "--metrics-host", help=f"Listen address of --metrics-port (default {_local_default('metrics_host')}; 0.0.0.0 for a Prometheus elsewhere).", rich_help_panel="Monitoring"),
    config_file: Optional[Path] = ConfigFile,
    print_config: bool = PrintConfig,
    json_output: bool = typer.Option(False, "--json", help="Print progress events as JSON lines on stdout (with --print-config: the options as JSON).", show_default=False),
) -> None:
    """Train TASK as a peer of run RUN_ID; with no TASK, join a public run with the settings in its manifest.

    With --create and no --initial-peers, this peer starts run RUN_ID as its first peer and prints on stderr how others join.

    On a terminal it shows a live panel (step, epoch, peers, loss, samples/s, rounds, traffic, held-out accuracy); on a pipe, a line every few seconds; with --json, events on stdout. Each held-out evaluation is published as a signed record of the run, for its dashboards.

    Stops on Ctrl-C/SIGTERM, --max-seconds, --max-steps or --target-accuracy; leaves the run cleanly. SIGUSR1 pauses the peer (it leaves any round, trains nothing, stays in the run marked paused) and SIGUSR2 resumes it.

    Precedence: each option is taken from its flag, else from its SWARMGRAD_* environment variable (SWARMGRAD_INNER_STEPS for --inner-steps; lists comma or space separated), else from the --config TOML file (flat; keys are the flag names without --, e.g. inner-steps = 20), else its default. Run settings left unset take the run's when joining a run that has a manifest.
    """
    from swarmgrad.commands.options import node_config
    from swarmgrad.commands.peer import run_peer
    from swarmgrad.commands.run_options import run_config_from

    loaded = _load_options(ctx, PeerOptions, config_file)
    options = loaded.options
    config = _validated(lambda: run_config_from(options.run_values(), task=options.task, where=loaded.where))
    network = _validated(lambda: node_config(loaded))
    if print_config:
        _print_config(loaded, json_output, config)
        return

    from swarmgrad.dht.tickets import Ticket
    from swarmgrad.net.accountability import Accountability
    from swarmgrad.peer.runner import LocalOptions

    if options.ticket is not None:  # a bad ticket is an error before anything starts
        _validated(lambda: Ticket.load(options.ticket))
    accountability = _validated(lambda: Accountability(ban_threshold=options.ban_threshold,
                                                       ban_seconds=options.ban_seconds))
    local = LocalOptions(ticket=options.ticket, shard=options.shard, num_shards=options.num_shards, data_dir=options.data_dir,
                         max_seconds=options.max_seconds, max_steps=options.max_steps,
                         target_accuracy=options.target_accuracy, eval_every=options.eval_every,
                         eval_batches=options.eval_batches,
                         final_eval=not options.no_final_eval, checkpoint_dir=options.checkpoint_dir,
                         threads=options.threads, trusted_network=options.trusted_network,
                         wait_peers=options.wait_peers, wait_seconds=options.wait, slowdown=options.slowdown,
                         upload_limit_mbps=options.upload_limit_mbps, download_limit_mbps=options.download_limit_mbps,
                         accountability=accountability)
    call_reporting_errors(lambda: run_peer(network, options.run_id, config, create=options.create, local=local,
                                           json_output=json_output, metrics_port=options.metrics_port,
                                           metrics_host=options.metrics_host))


def _load_options(ctx: typer.Context, model: type[Any], config_file: Optional[Path]) -> Any:
    """The command's options merged by precedence: flags given on the command line, then SWARMGRAD_*
    variables, then the --config file, then defaults (see swarmgrad.commands.options)."""
    from swarmgrad.commands.options import load_options

    flags = {name: value for name, value in ctx.params.items()
             if name in model.model_fields and _on_command_line(ctx, name)}
    return _validated(lambda: load_options(model, flags=flags, config_file=config_file))


def _on_command_line(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _print_config(loaded: Any, json_output: bool, config: Any = None) -> None:
    from swarmgrad.commands.options import render_json, render_toml
    from swarmgrad.commands.run_options import run_values

    if json_output:
        typer.echo(render_json(loaded))
    else:
        typer.echo(render_toml(loaded, None if config is None else run_values(config)), nl=False)


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
    strategy: Optional[str] = typer.Option(None, "--strategy", help=f"{_either(STRATEGIES)} (default {_RUN_DEFAULTS.strategy.name})."),
    averaging: Optional[str] = typer.Option(None, "--averaging", help=f"{_either(AVERAGINGS)} (default: {_natural_averagings()})."),
    compression: Optional[str] = typer.Option(None, "--compression", help=f"Codec for averaging: none, fp16, int8, topk:F, ... (default {_RUN_DEFAULTS.compression})."),
    inner_steps: int = typer.Option(DemoSettings.inner_steps, "--inner-steps", min=1, help=f"diloco: local steps between averaging (the demo's own default; a run's is {DiLoCo().inner_steps})."),
    target_accuracy: float = typer.Option(DemoSettings.target_accuracy, "--target-accuracy", min=0, max=1, help="Stop once reached."),
    max_seconds: float = typer.Option(DemoSettings.max_seconds, "--max-seconds", min=1, help="Training time budget per peer."),
    plot: Path = typer.Option(DemoSettings.plot, "--plot", help="Where to write the loss/accuracy plot."),
    json_output: bool = JsonOutput,
    run_id: str = typer.Option(DemoSettings.run_id, "--run-id", help="Run name used on the local swarm."),
    dashboard: bool = typer.Option(False, "--dashboard", help="Also serve the swarm's web dashboard (see `swarmgrad dashboard`) and print its URL.", show_default=False),
    port: int = typer.Option(DashboardSettings.model_fields["port"].default, "--port", min=0, max=65535, help="HTTP port of the dashboard, with --dashboard; 0 picks a free one."),
) -> None:
    """Train a model with a whole swarm on this machine (loopback only): a bootstrap node and N peer
    processes, live progress, a loss/accuracy plot, and the time to 85% and 88% held-out accuracy."""
    from swarmgrad.demo import run_demo

    settings = DemoSettings(peers=peers, run_id=run_id, task=task, strategy=strategy, averaging=averaging,
                            compression=compression, inner_steps=inner_steps, target_accuracy=target_accuracy,
                            max_seconds=max_seconds, plot=plot)
    _validated(settings.run_config)  # a bad strategy or codec is one line here, not N failing peers
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
