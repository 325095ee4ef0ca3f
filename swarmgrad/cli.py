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

from swarmgrad.commands.exits import EXIT_CONFIG_ERROR, call_reporting_errors
from swarmgrad.errors import ConfigError
from swarmgrad.version import __version__

app = typer.Typer(
    name="swarmgrad",
    help="Decentralized peer-to-peer training: start bootstrap nodes, watch runs, run a local demo swarm.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


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
def peer(
    task: Optional[str] = typer.Argument(
        None, help="Task to train: fashion-mnist, digits, charlm, or module:attribute. Omit to use the run's manifest."
    ),
    run_id: str = RunId,
    initial_peers: Optional[List[str]] = InitialPeers,
    create: bool = typer.Option(False, "--create", help="Publish this run's settings (a signed manifest) for others to join."),
    strategy: Optional[str] = typer.Option(None, "--strategy", help="diloco (default), sync or gossip.", rich_help_panel="Run"),
    averaging: Optional[str] = typer.Option(None, "--averaging", help="moshpit (default) or gossip.", rich_help_panel="Run"),
    compression: Optional[str] = typer.Option(None, "--compression", help="none, fp16, bf16, int8 (default), topk:F, powersgd:R.", rich_help_panel="Run"),
    inner_steps: Optional[int] = typer.Option(None, "--inner-steps", min=1, help="diloco: local steps between averaging (default 50).", rich_help_panel="Run"),
    outer_lr: Optional[float] = typer.Option(None, "--outer-lr", help="diloco: outer learning rate (default 0.7).", rich_help_panel="Run"),
    target_batch_size: Optional[int] = typer.Option(None, "--target-batch-size", min=1, help="sync: swarm-wide samples per step (default 4096).", rich_help_panel="Run"),
    every: Optional[int] = typer.Option(None, "--gossip-every", min=1, help="gossip: local steps between parameter averaging (default 4).", rich_help_panel="Run"),
    group_size: Optional[int] = typer.Option(None, "--group-size", min=2, help="moshpit: peers per group (default 16).", rich_help_panel="Run"),
    privacy_clip: Optional[float] = typer.Option(None, "--privacy-clip", help="Differential privacy: clip norm (turns privacy on).", rich_help_panel="Run"),
    privacy_noise: Optional[float] = typer.Option(None, "--privacy-noise", help="Differential privacy: noise multiplier.", rich_help_panel="Run"),
    privacy_level: str = typer.Option("sample", "--privacy-level", help="sample (per-sample DP-SGD) or update (each released update).", rich_help_panel="Run"),
    max_epsilon: Optional[float] = typer.Option(None, "--max-epsilon", help="Stop releasing past this epsilon.", rich_help_panel="Run"),
    lr: Optional[float] = typer.Option(None, "--lr", help="Inner learning rate (default: the task's).", rich_help_panel="Run"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, help="Local batch size (default: the task's).", rich_help_panel="Run"),
    shard: Optional[int] = typer.Option(None, "--shard", min=0, help="This peer's data shard (default: a random one).", rich_help_panel="Local"),
    num_shards: int = typer.Option(1, "--num-shards", min=1, help="How many shards the training set is cut into.", rich_help_panel="Local"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="fashion-mnist: directory with the IDX files.", rich_help_panel="Local"),
    max_seconds: Optional[float] = typer.Option(None, "--max-seconds", min=0, help="Stop after this many seconds.", rich_help_panel="Local"),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1, help="Stop after this many local steps.", rich_help_panel="Local"),
    target_accuracy: Optional[float] = typer.Option(None, "--target-accuracy", min=0, max=1, help="Stop once a held-out evaluation reaches it.", rich_help_panel="Local"),
    eval_every: float = typer.Option(10.0, "--eval-every", min=0, help="Seconds between held-out evaluations (0: only at the end).", rich_help_panel="Local"),
    no_final_eval: bool = typer.Option(False, "--no-final-eval", help="Skip the held-out evaluation at the end.", rich_help_panel="Local"),
    checkpoint_dir: Optional[Path] = typer.Option(None, "--checkpoint-dir", help="Resume from and save checkpoints to this directory.", rich_help_panel="Local"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch threads (default: torch's).", rich_help_panel="Local"),
    slowdown: float = typer.Option(1.0, "--slowdown", min=1.0, max=100.0, help="Emulate slower hardware: each step takes this many times longer (the swarm lab's stragglers).", rich_help_panel="Local"),
    host: str = Host,
    port: int = Port,
    data_port: int = typer.Option(0, "--data-port", min=0, max=65535, help="TCP port for direct tensor traffic (0: any free one); open it in firewalls."),
    announce: Optional[List[str]] = typer.Option(None, "--announce", metavar="MADDR", help="Address to advertise (port forwarding)."),
    identity: Optional[Path] = typer.Option(None, "--identity", "-i", help="Key file, so the peer keeps its id across restarts."),
    client_mode: bool = typer.Option(False, "--client-mode", help="Dial out only (behind NAT, no port open)."),
    trusted_network: bool = typer.Option(False, "--trusted-network", help="Send tensors unencrypted (trusted LAN only)."),
    wait: float = typer.Option(30.0, "--wait", min=1, help="Seconds to wait for the run's manifest and peers."),
    wait_peers: int = typer.Option(1, "--wait-peers", min=1, help="Start training once this many peers (this one included) are in the run.", rich_help_panel="Local"),
    json_output: bool = typer.Option(False, "--json", help="Print progress events as JSON lines on stdout."),
) -> None:
    """Train TASK as a peer of run RUN_ID; with no TASK, join a public run with the settings in its manifest.

    Stops on Ctrl-C/SIGTERM, --max-seconds, --max-steps or --target-accuracy; leaves the run cleanly.
    """
    from swarmgrad.commands.peer import run_peer
    from swarmgrad.dht.node import NodeConfig
    from swarmgrad.peer.runner import LocalOptions

    peers = _split_addresses(initial_peers)
    explicit = _run_options(strategy, averaging, compression, inner_steps, outer_lr, target_batch_size, every,
                            group_size, privacy_clip, privacy_noise, privacy_level, max_epsilon, lr, batch_size)
    if data_dir is not None:
        explicit["_data_dir"] = data_dir
    config = _validated(lambda: NodeConfig(host=host, port=port, identity_path=identity, initial_peers=peers,
                                           announce_maddrs=_split_addresses(announce), client_mode=client_mode,
                                           bootstrap_timeout=wait, data_port=data_port))
    local = LocalOptions(shard=shard, num_shards=num_shards, data_dir=data_dir, max_seconds=max_seconds,
                         max_steps=max_steps, target_accuracy=target_accuracy, eval_every=eval_every,
                         final_eval=not no_final_eval, checkpoint_dir=checkpoint_dir, threads=threads,
                         trusted_network=trusted_network, wait_peers=wait_peers, wait_seconds=wait, slowdown=slowdown)
    if target_accuracy is not None and eval_every == 0:
        typer.echo("error: --target-accuracy needs evaluations: set --eval-every > 0", err=True)
        raise typer.Exit(EXIT_CONFIG_ERROR)
    call_reporting_errors(lambda: run_peer(config, run_id, task, create, explicit, local, json_output, wait))


def _run_options(strategy, averaging, compression, inner_steps, outer_lr, target_batch_size, every, group_size,
                 privacy_clip, privacy_noise, privacy_level, max_epsilon, lr, batch_size) -> dict:
    """Only the run options given on the command line, in the manifest's shape."""
    from swarmgrad.peer.runner import DEFAULT_RUN_OPTIONS

    explicit: dict = {}
    if strategy is not None or inner_steps is not None or outer_lr is not None or target_batch_size is not None \
            or every is not None:
        name = strategy or DEFAULT_RUN_OPTIONS["strategy"]["name"]
        settings: dict = {"name": name}
        if name == "diloco":
            settings.update(inner_steps=inner_steps or 50, outer_lr=outer_lr if outer_lr is not None else 0.7,
                            outer_momentum=0.9)
        elif name == "sync":
            settings.update(target_batch_size=target_batch_size or 4096)
        elif name == "gossip":
            settings.update(every=every or 4)
        explicit["strategy"] = settings
    if averaging is not None or group_size is not None:
        kind = averaging or ("gossip" if strategy == "gossip" else "moshpit")
        explicit["averaging"] = {"kind": kind, **({"group_size": group_size} if group_size else {})}
    elif strategy == "gossip":
        explicit["averaging"] = {"kind": "gossip"}
    if compression is not None:
        explicit["compression"] = compression
    if privacy_clip is not None or privacy_noise is not None:
        if privacy_clip is None or privacy_noise is None:
            raise typer.BadParameter("privacy needs both --privacy-clip and --privacy-noise")
        explicit["privacy"] = {"clip_norm": privacy_clip, "noise_multiplier": privacy_noise, "level": privacy_level,
                               **({"max_epsilon": max_epsilon} if max_epsilon is not None else {})}
    hparams = {key: value for key, value in (("lr", lr), ("batch_size", batch_size)) if value is not None}
    if hparams:
        explicit["hparams"] = hparams
    return explicit


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
    task: str = typer.Option("fashion-mnist", "--task", help="Task the swarm trains."),
    strategy: str = typer.Option("diloco", "--strategy", help="diloco, sync or gossip."),
    averaging: Optional[str] = typer.Option(None, "--averaging", help="moshpit or gossip (default: gossip for the gossip strategy, else moshpit)."),
    compression: str = typer.Option("int8", "--compression", help="Codec for averaging: none, fp16, int8, topk:F, ..."),
    inner_steps: int = typer.Option(100, "--inner-steps", min=1, help="diloco: local steps between averaging."),
    target_accuracy: float = typer.Option(0.88, "--target-accuracy", min=0, max=1, help="Stop once reached."),
    max_seconds: float = typer.Option(150.0, "--max-seconds", min=1, help="Training time budget per peer."),
    plot: Path = typer.Option(Path("swarmgrad-demo.png"), "--plot", help="Where to write the loss/accuracy plot."),
    json_output: bool = JsonOutput,
    run_id: str = typer.Option("demo", "--run-id", help="Run name used on the local swarm."),
) -> None:
    """Train a model with a whole swarm on this machine (loopback only): a bootstrap node and N peer
    processes, live progress, a loss/accuracy plot, and the time to 85% and 88% held-out accuracy."""
    from swarmgrad.demo import DemoSettings, run_demo

    averaging = averaging or ("gossip" if strategy == "gossip" else "moshpit")
    settings = DemoSettings(peers=peers, run_id=run_id, task=task, strategy=strategy, averaging=averaging,
                            compression=compression, inner_steps=inner_steps, target_accuracy=target_accuracy,
                            max_seconds=max_seconds, plot=plot)
    _run(run_demo(settings, json_output=json_output))


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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
