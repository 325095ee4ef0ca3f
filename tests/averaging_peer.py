"""A peer process for averaging tests: joins, averages one tensor once, prints its report as JSON.

    python tests/averaging_peer.py INITIAL_PEER RUN_ID VALUE NUMEL [--codec C] [--aggregator A] [--timeout S]
"""

import argparse
import asyncio
import json
import sys

import torch

from swarmgrad.averaging import Averager, Moshpit, NetworkRuntime
from swarmgrad.dht import NodeConfig
from swarmgrad.runtime import run


async def main(args: argparse.Namespace) -> None:
    tensor = torch.full((args.numel,), args.value)
    settings = Moshpit(group_size=4, matchmaking_seconds=args.window, round_timeout=args.timeout)
    network = NodeConfig(initial_peers=[args.initial_peer])
    async with NetworkRuntime(args.run_id, network) as runtime, \
            Averager(runtime, [tensor], settings=settings, grid_dims=1, codec=args.codec,
                     aggregator=args.aggregator) as averager:
        print(json.dumps({"ready": runtime.peer_id}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # the test says when to start the round
        report = await averager.step(weight=args.weight)
        print(json.dumps({"ok": report.ok, "error": report.error, "value": float(tensor[0])}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("initial_peer")
    parser.add_argument("run_id")
    parser.add_argument("value", type=float)
    parser.add_argument("numel", type=int)
    parser.add_argument("--weight", type=float, default=1.0)
    parser.add_argument("--codec", default="none")
    parser.add_argument("--aggregator", default="mean")  # exact averages, as codec none
    parser.add_argument("--window", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=20.0)
    run(main(parser.parse_args()))
