"""`swarmgrad status`: the live members of a run, once or continuously."""

from __future__ import annotations

import asyncio

from rich.live import Live

from swarmgrad.console import members_table, print_json, stdout
from swarmgrad.dht.membership import list_members
from swarmgrad.dht.node import NodeConfig, SwarmNode


async def run_status(config: NodeConfig, run_id: str, *, json_output: bool, watch: bool, interval: float) -> None:
    async with SwarmNode(config) as node:  # client mode: reads the DHT, accepts no connections
        if not watch:
            members = await list_members(node, run_id)
            if json_output:
                print_json([member.to_json() for member in members])
            else:
                stdout.print(members_table(members, title=f"run {run_id}: {len(members)} members"))
            return
        if json_output:  # one JSON line per refresh
            while True:
                print_json([member.to_json() for member in await list_members(node, run_id)])
                await asyncio.sleep(interval)
        with Live(console=stdout, auto_refresh=False) as live:
            while True:
                members = await list_members(node, run_id)
                live.update(members_table(members, title=f"run {run_id}: {len(members)} members"), refresh=True)
                await asyncio.sleep(interval)
