"""A bare member process: joins a run and stays until SIGTERM/SIGINT, then leaves gracefully.

Internal to the tests (membership, kill and restart scenarios); users run ``swarmgrad peer``.
Prints one JSON line ``{"peer_id": ..., "maddrs": [...]}`` on stdout once it is a member.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from swarmgrad.dht.membership import DEFAULT_TTL, Membership
from swarmgrad.dht.node import NodeConfig, SwarmNode
from swarmgrad.errors import SwarmgradError
from swarmgrad.eventloop import configure_logging, run, shutdown_signal


async def serve(config: NodeConfig, run_id: str, ttl: float) -> None:
    with shutdown_signal() as stop:
        async with SwarmNode(config) as node, Membership(node, run_id, role="peer", ttl=ttl):
            print(json.dumps({"peer_id": node.peer_id, "maddrs": node.maddrs}), flush=True)
            await stop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarmgrad.demo.member")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--ttl", type=float, default=DEFAULT_TTL)
    parser.add_argument("--identity", default=None)
    parser.add_argument("--client-mode", action="store_true")
    args = parser.parse_args(argv)
    configure_logging(logging.INFO)
    try:
        config = NodeConfig(initial_peers=args.initial_peers, identity_path=args.identity, client_mode=args.client_mode)
        run(serve(config, args.run_id, args.ttl))
    except SwarmgradError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
