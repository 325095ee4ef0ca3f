"""A runtime for the lab's NAT tests: joins through a bootstrap, then serves or fetches a blob.

    python tests/nat_transport_peer.py HOST INITIAL_PEER serve NBYTES
    python tests/nat_transport_peer.py HOST INITIAL_PEER fetch PEER_ID

``serve`` prints {"ready": peer id} and answers each channel on the test protocol with NBYTES;
``fetch`` waits until PEER_ID is listed in presence, opens a channel to it on the runtime's
transport, reads the blob and prints how it came (the channel's transport) and its size.
"""

import asyncio
import json
import logging
import sys
import time

from swarmgrad.dht import NodeConfig
from swarmgrad.eventloop import run
from swarmgrad.net.network_runtime import NetworkRuntime

PROTOCOL = "swarmgrad/test/blob"


async def main(host: str, initial_peer: str, mode: str, argument: str) -> None:
    async with NetworkRuntime("natblob", NodeConfig(host=host, initial_peers=[initial_peer])) as runtime:
        if mode == "serve":
            blob = b"\x01" * int(argument)

            async def serve(channel) -> None:
                await channel.recv(max_payload=0)
                await channel.send({"t": "blob"}, blob)

            await runtime.transport.serve(PROTOCOL, serve)
            print(json.dumps({"ready": runtime.peer_id, "dialable": runtime.node.dialable}), flush=True)
            await asyncio.to_thread(sys.stdin.readline)
            return
        deadline = time.monotonic() + 30
        while argument not in {m.peer_id for m in runtime.members()} and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        channel = await runtime.transport.open(argument, PROTOCOL)
        await channel.send({"t": "get"})
        frame = await channel.recv(max_payload=1 << 26)
        print(json.dumps({"transport": channel.transport_name, "bytes": len(frame.payload),
                          "dialable": runtime.node.dialable}), flush=True)
        await channel.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("swarmgrad.net.direct").setLevel(logging.INFO)  # why a channel fell back to libp2p
    run(main(*sys.argv[1:5]))
