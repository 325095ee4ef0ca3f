"""`swarmgrad status`: the live members of a run, once or continuously."""

from __future__ import annotations

import asyncio

from rich.console import Group
from rich.live import Live
from rich.text import Text

from swarmgrad.console import members_table, print_json, short_id, stdout
from swarmgrad.dht.membership import Member, list_members
from swarmgrad.dht.node import NodeConfig, SwarmNode


async def run_status(config: NodeConfig, run_id: str, *, json_output: bool, watch: bool, interval: float) -> None:
    async with SwarmNode(config) as node:  # client mode: reads the DHT, accepts no connections
        if not watch:
            members = await list_members(node, run_id)
            if json_output:
                print_json([member.to_json() for member in members])
            else:
                stdout.print(_view(members, run_id))
            return
        if json_output:  # one JSON line per refresh
            while True:
                print_json([member.to_json() for member in await list_members(node, run_id)])
                await asyncio.sleep(interval)
        with Live(console=stdout, auto_refresh=False) as live:
            while True:
                members = await list_members(node, run_id)
                live.update(_view(members, run_id), refresh=True)
                await asyncio.sleep(interval)


def _view(members: list[Member], run_id: str) -> Group:
    """The members' table, and which members ban others now (each peer's bans are local: its record
    says how many, accountability.py)."""
    table = members_table(members, title=f"run {run_id}: {len(members)} members")
    banning = [f"{short_id(member.peer_id)} bans {member.stats.bans}" for member in members
               if member.stats is not None and member.stats.bans]
    lines = [Text(f"bans: {', '.join(banning)}")] if banning else []
    entries = entry_points(members)
    if entries:  # any public member is an entry point: the bootstrap node need not be alive
        lines.append(Text(f"join through any of: --initial-peers {','.join(entries)}"))
    return Group(table, *lines)


def entry_points(members: list[Member], count: int = 3) -> list[str]:
    """Up to ``count`` addresses to join the run through: one each of the members others can dial
    (bootstrap nodes first, then peers seen most recently)."""
    public = [member for member in members if member.reachability == "public"]
    public.sort(key=lambda member: (member.role != "bootstrap", -member.last_seen))
    return [next(a for a in member.maddrs if "/p2p-circuit" not in a) for member in public[:count]]
