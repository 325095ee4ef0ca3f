"""`swarmgrad bootstrap`: a long-lived DHT/relay node."""

from __future__ import annotations

import contextlib
import logging

from swarmgrad.console import stderr
from swarmgrad.dht.membership import Membership
from swarmgrad.dht.node import NodeConfig, SwarmNode
from swarmgrad.eventloop import shutdown_signal

logger = logging.getLogger(__name__)


async def run_bootstrap(config: NodeConfig, run_id: str | None) -> None:
    with shutdown_signal() as stop:
        async with SwarmNode(config) as node, contextlib.AsyncExitStack() as stack:
            if run_id is not None:
                await stack.enter_async_context(Membership(node, run_id, role="bootstrap"))
            for address in node.maddrs:
                print(address, flush=True)
            stderr.print(f"bootstrap node {node.peer_id} is up; give peers the address above. Ctrl-C stops it.")
            stderr.print(f"{await stop}: shutting down")
