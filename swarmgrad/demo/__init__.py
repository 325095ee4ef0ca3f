"""`swarmgrad demo`: a whole swarm on this machine, on loopback only.

A bootstrap node runs in this process; N peers run as separate processes. The demo waits until
every peer is a listed member of the run, shows the member table, and shuts everything down.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from rich.status import Status

from swarmgrad.console import members_table, print_json, stderr, stdout
from swarmgrad.demo.processes import PeerProcesses
from swarmgrad.dht.membership import Member, Membership, list_members
from swarmgrad.dht.node import NodeConfig, SwarmNode
from swarmgrad.errors import StartupError

POLL_SECONDS = 0.25
MEMBER_TTL = 10.0


def member_command(run_id: str, initial_peers: list[str], ttl: float = MEMBER_TTL) -> list[str]:
    return [sys.executable, "-m", "swarmgrad.demo.member", "--run-id", run_id, "--ttl", str(ttl), "--initial-peers", *initial_peers]


async def wait_for_members(node: SwarmNode, run_id: str, peer_ids: set[str], seconds: float) -> list[Member]:
    """Poll the run's membership until all ``peer_ids`` are listed."""
    deadline = time.monotonic() + seconds
    while True:
        members = [member for member in await list_members(node, run_id) if member.peer_id in peer_ids]
        if len(members) == len(peer_ids):
            return members
        if time.monotonic() > deadline:
            raise StartupError(f"only {len(members)} of {len(peer_ids)} peers became visible within {seconds:.0f} s")
        await asyncio.sleep(POLL_SECONDS)


async def run_demo(*, peers: int, run_id: str, json_output: bool) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="swarmgrad-demo-"))
    started = time.monotonic()
    with Status("starting bootstrap node", console=stderr) as status:
        async with SwarmNode(NodeConfig(host="127.0.0.1")) as bootstrap, Membership(bootstrap, run_id, role="bootstrap"):
            bootstrap_maddrs = bootstrap.maddrs
            status.update(f"starting {peers} peer processes (logs in {log_dir})")
            async with PeerProcesses([member_command(run_id, bootstrap_maddrs)] * peers, log_dir) as children:
                await children.wait_ready(seconds=60 + 3 * peers)
                status.update(f"waiting until all {peers} peers see each other in run {run_id!r}")
                members = await wait_for_members(
                    bootstrap, run_id, {child.peer_id for child in children.children}, seconds=30
                )
                formation_seconds = time.monotonic() - started
                status.update("stopping peers")
    summary = {
        "peers": peers,
        "run_id": run_id,
        "bootstrap": bootstrap_maddrs,
        "members": [member.to_json() for member in members],
        "formation_seconds": round(formation_seconds, 3),
        "logs": str(log_dir),
    }
    if json_output:
        print_json(summary)
    else:
        stdout.print(members_table(members, title=f"run {run_id}: {len(members)} peers"))
        stdout.print(f"swarm formed in {formation_seconds:.1f} s; all processes stopped. Logs: {log_dir}")
    return summary
