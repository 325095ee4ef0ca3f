"""`swarmgrad dashboard`: serve a run's web dashboard until SIGINT/SIGTERM."""

from __future__ import annotations

from swarmgrad.console import stderr
from swarmgrad.dashboard.server import Dashboard
from swarmgrad.dashboard.settings import DashboardSettings
from swarmgrad.dht.node import NodeConfig
from swarmgrad.eventloop import shutdown_signal


async def run_dashboard(network: NodeConfig, run_id: str, settings: DashboardSettings) -> None:
    with shutdown_signal() as stop:
        async with Dashboard(run_id, network, settings) as board:
            print(board.url, flush=True)  # stdout: what scripts read, as `bootstrap` prints its address
            stderr.print(f"dashboard of run {run_id} at {board.url} (JSON under {board.url}api/, Prometheus at "
                         f"{board.url}metrics); reading the DHT {settings.reads_per_second:.1f} times a second. "
                         "Ctrl-C stops it.", markup=False, soft_wrap=True)
            stderr.print(f"{await stop}: shutting down", markup=False)
