"""A gossip peer process for tests: joins a run and gossips one tensor until killed.

    python tests/gossip_peer.py INITIAL_PEER RUN_ID VALUE NUMEL WEIGHT
Prints {"ready": peer_id} once it is a member, then one line per step: {"step": n, "weight": w}.
"""

import asyncio
import json
import sys

import torch

from swarmgrad.averaging import GossipAverager
from swarmgrad.dht import Membership, NodeConfig, SwarmNode
from swarmgrad.runtime import run


async def main(initial_peer: str, run_id: str, value: float, numel: int, weight: float) -> None:
    tensor = torch.full((numel,), value)
    async with SwarmNode(NodeConfig(initial_peers=[initial_peer])) as node, Membership(node, run_id, ttl=3):
        async with GossipAverager(node, run_id, [tensor], weight=weight, members_refresh_seconds=0.5) as gossip:
            print(json.dumps({"ready": node.peer_id}), flush=True)
            while True:
                await gossip.step()
                await asyncio.sleep(0.05)


if __name__ == "__main__":
    initial_peer, run_id, value, numel, weight = sys.argv[1:6]
    run(main(initial_peer, run_id, float(value), int(numel), float(weight)))
