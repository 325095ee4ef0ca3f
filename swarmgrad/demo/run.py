"""Running the demo swarm: a bootstrap node here, N ``swarmgrad peer`` processes, the live dashboard,
the summary and the plot."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

from rich.live import Live

from swarmgrad.console import print_json, stderr, stdout
from swarmgrad.dashboard.settings import DashboardSettings
from swarmgrad.demo.dashboard import render_dashboard
from swarmgrad.demo.events import RunLog
from swarmgrad.demo.plot import plot_run
from swarmgrad.demo.processes import ChildPeer, PeerProcesses
from swarmgrad.demo.settings import DemoSettings, peer_command
from swarmgrad.demo.summary import TARGETS, summarize
from swarmgrad.dht.membership import Membership
from swarmgrad.dht.node import NodeConfig, SwarmNode


async def _follow(child: ChildPeer, log: RunLog) -> None:
    """Feed one child's event lines into the log until it exits."""
    assert child.process.stdout is not None
    while line := await child.process.stdout.readline():
        log.add_line(line)


async def run_demo(settings: DemoSettings, *, json_output: bool, dashboard: DashboardSettings | None = None) -> dict:
    """``dashboard``: also serve the swarm's web dashboard with these settings, for as long as the demo runs."""
    log_dir = Path(tempfile.mkdtemp(prefix="swarmgrad-demo-"))
    started = time.time()
    log = RunLog(started_at=started)
    config = settings.run_config()
    title = f"swarmgrad demo: {settings.peers} peers, {settings.task}, {config.strategy.name}+{config.averaging.kind}, " \
            f"{config.compression}"
    board_url = None
    async with SwarmNode(NodeConfig(host="127.0.0.1")) as bootstrap, \
            Membership(bootstrap, settings.run_id, role="bootstrap"), contextlib.AsyncExitStack() as stack:
        if dashboard is not None:
            from swarmgrad.dashboard.server import Dashboard

            board = await stack.enter_async_context(Dashboard(
                settings.run_id, NodeConfig(initial_peers=bootstrap.maddrs, client_mode=True), dashboard))
            board_url = board.url
            stderr.print(f"dashboard: {board_url}", markup=False, soft_wrap=True)
        commands = [peer_command(settings, index, bootstrap.maddrs, log_dir) for index in range(settings.peers)]
        with Live(render_dashboard(log, title=title), console=stderr, refresh_per_second=4,
                  transient=json_output) as live:
            async with PeerProcesses(commands, log_dir) as children:
                # imports, a p2pd per peer and --wait-peers on a small shared machine: a minute, and more peers take longer
                await children.wait_ready(seconds=60 + 3 * settings.peers)
                for child in children.children:
                    log.add({"event": "ready", "t": time.time(), "peer_id": child.peer_id, "maddrs": child.maddrs})
                formation_seconds = time.time() - started
                followers = [asyncio.create_task(_follow(child, log)) for child in children.children]
                evaluator = children.children[0].process
                while evaluator.returncode is None and not all(f.done() for f in followers):
                    live.update(render_dashboard(log, title=title))
                    await asyncio.sleep(0.25)  # the dashboard's refresh rate
                    if followers[0].done():
                        break
                await children.stop()  # the others leave gracefully and report
                await asyncio.wait(followers, timeout=15)  # their last lines, after STOP_GRACE_SECONDS at most
            live.update(render_dashboard(log, title=title))
    summary = summarize(log, targets=TARGETS)
    plot = plot_run(log, settings.plot, title, targets=TARGETS)
    summary.update({
        "task": settings.task, "strategy": config.strategy.name, "averaging": config.averaging.kind,
        "compression": config.compression, "num_peers": settings.peers, "run_id": settings.run_id,
        "formation_seconds": round(formation_seconds, 3), "total_seconds": round(time.time() - started, 3),
        "time_to_85": summary["seconds_to"].get("0.85"), "time_to_88": summary["seconds_to"].get("0.88"),
        "plot": str(plot), "logs": str(log_dir), "dashboard": board_url,
    })
    if json_output:
        print_json(summary)
    else:
        final = summary.get("final_accuracy")
        stdout.print(f"final held-out accuracy: {'-' if final is None else f'{final:.4f}'}; "
                     f"85% after {_seconds(summary['time_to_85'])}, 88% after {_seconds(summary['time_to_88'])}; "
                     f"{summary['total_seconds']:.0f} s in all")
        stdout.print(f"plot: {plot}   logs: {log_dir}")
    return summary


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.0f} s"
