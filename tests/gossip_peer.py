"""A gossip peer process for tests: joins a run and gossips one tensor until killed.

    python tests/gossip_peer.py INITIAL_PEER RUN_ID VALUE NUMEL WEIGHT
Prints {"ready": peer_id} once it is a member. Codec none, and its presence is refreshed every 0.5 s
(a record lives 6 s), as in test_gossip.py's swarm.
"""

import asyncio
import json
import sys

import torch

from swarmgrad.averaging import GossipAverager
from swarmgrad.dht import NodeConfig
from swarmgrad.eventloop import run
from swarmgrad.net.network_runtime import NetworkRuntime
from swarmgrad.timing import Timing


async def main(initial_peer: str, run_id: str, value: float, numel: int, weight: float) -> None:
    tensor = torch.full((numel,), value)
    network = NodeConfig(initial_peers=[initial_peer])
    async with NetworkRuntime(run_id, network, timing=Timing(presence_refresh=0.5)) as runtime, \
            GossipAverager(runtime, [tensor], weight=weight, codec="none") as gossip:
        print(json.dumps({"ready": runtime.peer_id}), flush=True)
        while True:
            await gossip.step()
            await asyncio.sleep(0.05)


if __name__ == "__main__":
    initial_peer, run_id, value, numel, weight = sys.argv[1:6]
    run(main(initial_peer, run_id, float(value), int(numel), float(weight)))
