"""A peer process for averaging tests: joins, averages one tensor once, prints its report as JSON.

    python tests/averaging_peer.py INITIAL_PEER RUN_ID VALUE NUMEL [--codec C] [--aggregator A] [--timeout S]
        [--host H] [--group-size G] [--grid-dims D]

With ``--host`` (a lab address) it also reports how the libp2p connections to its groupmates were
made: ``relayed`` (a /p2p-circuit address) or ``direct`` (hole punched, or dialled).
"""

import argparse
import asyncio
import json
import logging
import os
import sys
import time

import torch

from swarmgrad.averaging import Aggregation, Averager, Moshpit
from swarmgrad.dht import NodeConfig
from swarmgrad.eventloop import run
from swarmgrad.net.network_runtime import NetworkRuntime


async def main(args: argparse.Namespace) -> None:
    tensor = torch.full((args.numel,), args.value)
    settings = Moshpit(group_size=args.group_size, matchmaking_seconds=args.window, round_timeout=args.timeout)
    network = NodeConfig(initial_peers=args.initial_peer.split(","), host=args.host)
    async with NetworkRuntime(args.run_id, network) as runtime, \
            Averager(runtime, [tensor], settings=settings, grid_dims=args.grid_dims or None, codec=args.codec,
                     aggregation=Aggregation(rule=args.aggregator)) as averager:
        print(json.dumps({"ready": runtime.peer_id}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # the test says when to start the round
        if args.wait_direct:
            await _until_direct(runtime, args.wait_direct)
        report = await averager.step(weight=args.weight)
        links = await _connections(runtime.node.p2p, [peer for peer in report.group if peer != runtime.peer_id])
        print(json.dumps({"ok": report.ok, "error": report.error, "value": float(tensor[0]), "links": links,
                          "transports": report.transports, "dialable": runtime.node.dialable,
                          "maddrs": runtime.node.maddrs}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # stay up until told: others may still need us


async def _until_direct(runtime: NetworkRuntime, seconds: float) -> None:
    """Wait (up to ``seconds``) until every other training member listed has a direct libp2p
    connection: hole punching runs in the background from the moment presence lists a NATed peer,
    and a round that starts before it finished would run over the relay."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        others = [m.peer_id for m in runtime.members() if m.role == "peer" and m.peer_id != runtime.peer_id]
        links = await _connections(runtime.node.p2p, others)
        if others and all("direct" in kinds for kinds in links.values()):
            return
        await asyncio.sleep(0.2)


async def _connections(p2p, peers: list[str]) -> dict[str, list[str]]:
    """Per groupmate, how each open libp2p connection to it runs: relayed or direct."""
    found: dict[str, list[str]] = {peer: [] for peer in peers}
    for info in await p2p._client.list_peers():
        if str(info.peer_id) in found:
            found[str(info.peer_id)] += ["relayed" if "p2p-circuit" in str(a) else "direct" for a in info.addrs]
    return found


if __name__ == "__main__":
    if os.environ.get("SWARMGRAD_TEST_LOG"):  # a test that wants to see why, on stderr
        logging.basicConfig(level=os.environ["SWARMGRAD_TEST_LOG"], format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("initial_peer")  # one multiaddr, or several separated by commas
    parser.add_argument("run_id")
    parser.add_argument("value", type=float)
    parser.add_argument("numel", type=int)
    parser.add_argument("--weight", type=float, default=1.0)
    parser.add_argument("--codec", default="none")
    parser.add_argument("--aggregator", default="mean")  # exact averages, as codec none
    parser.add_argument("--window", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--grid-dims", type=int, default=1)  # 0: the grid sized by the membership
    parser.add_argument("--wait-direct", type=float, default=0.0)  # seconds to wait for hole punching
    run(main(parser.parse_args()))
