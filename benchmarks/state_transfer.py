"""One donor serving its state to one joiner on loopback, over the direct encrypted data plane, and
what a donor's verification sketch costs: a measurement to run by hand, not a test.

    PYTHONPATH=. python benchmarks/state_transfer.py [--megabytes 200] [--sketch-megabytes 200 800]

Rows: the download's MB/s unlimited, under the donor's upload cap (``--cap-mbps``), and with a
round trip of ``--rtt-ms`` added (the joiner's requests reach the donor that much later, in order);
then the seconds one sketch request costs a donor for states of each ``--sketch-megabytes``. Runs on
older trees too (it finds how their sketch is called), so before and after compare on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import random
import time
from contextlib import AsyncExitStack

import torch

from swarmgrad.dht import NodeConfig, SwarmNode
from swarmgrad.net.direct import default_transport
from swarmgrad.net.ratelimit import RateLimits
from swarmgrad.state import sketch as state_sketch
from swarmgrad.state.server import StateServer
from swarmgrad.state.snapshot import StateSnapshot, part_count
from swarmgrad.state.transfer import download_state

MB = 1e6


class DelayedRequests:
    """A channel whose sends reach the other side ``delay`` seconds later, in order: a round trip of
    ``delay`` for every request, whatever else is in flight."""

    def __init__(self, channel, delay: float):
        self._channel, self._delay = channel, delay
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pump = asyncio.ensure_future(self._run())

    def __getattr__(self, name):
        return getattr(self._channel, name)

    async def send(self, header: dict, payload=b"") -> None:
        self._queue.put_nowait((asyncio.get_running_loop().time() + self._delay, header, bytes(payload)))

    async def _run(self) -> None:
        while True:
            due, header, payload = await self._queue.get()
            await asyncio.sleep(max(0.0, due - asyncio.get_running_loop().time()))
            await self._channel.send(header, payload)
            self._queue.task_done()

    async def close(self) -> None:
        await asyncio.wait_for(self._queue.join(), 5)
        self._pump.cancel()
        await self._channel.close()

    async def abort(self) -> None:
        self._pump.cancel()
        await self._channel.abort()


class DelayedTransport:
    def __init__(self, transport, delay: float):
        self._transport, self._delay, self.admission = transport, delay, None

    async def open(self, peer_id: str, protocol: str):
        return DelayedRequests(await self._transport.open(peer_id, protocol), self._delay)


def state(megabytes: float) -> StateSnapshot:
    return StateSnapshot.capture(1, {"model/w": torch.randn(int(megabytes * MB / 4))}, {"epoch": 1})


async def download_rate(snapshot: StateSnapshot, cap_mbps: float | None, rtt: float) -> float:
    async with AsyncExitStack() as stack:
        joiner = await stack.enter_async_context(SwarmNode(NodeConfig(host="127.0.0.1")))
        donor = await stack.enter_async_context(SwarmNode(NodeConfig(host="127.0.0.1", initial_peers=joiner.maddrs)))
        transports = [default_transport(joiner),
                      default_transport(donor, limits=RateLimits.from_mbps(upload_mbps=cap_mbps))]
        for transport in transports:
            await transport.start()
            stack.push_async_callback(transport.stop)
        server = await stack.enter_async_context(StateServer(transports[1], "bench/state"))
        server.publish(snapshot)
        opener = DelayedTransport(transports[0], rtt) if rtt else transports[0]
        start = time.perf_counter()
        got = await download_state(opener, "bench/state", [donor.peer_id], seconds=120)
        seconds = time.perf_counter() - start
        assert all(torch.equal(got.read_part(index), snapshot.read_part(index))
                   for index in range(part_count(snapshot.nbytes)))
        return snapshot.nbytes / MB / seconds


def sketch_seconds(snapshot: StateSnapshot) -> tuple[float, int]:
    """Seconds a donor spends on one sketch request of a new joiner, and the parts it reads."""
    seed, everything = random.getrandbits(63), list(range(part_count(snapshot.nbytes)))
    if hasattr(state_sketch, "sample_parts"):
        parts = state_sketch.sample_parts(snapshot.specs, everything, seed)
        source = snapshot.read_part
    else:  # before sampling: every part, read from the buffer
        parts, source = everything, snapshot.data
    assert list(inspect.signature(state_sketch.sketch).parameters)[1:] == ["specs", "seed", "parts"]
    start = time.perf_counter()
    state_sketch.sketch(source, snapshot.specs, seed, parts)
    return time.perf_counter() - start, len(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=200)
    parser.add_argument("--cap-mbps", type=float, default=100)
    parser.add_argument("--rtt-ms", type=float, default=50)
    parser.add_argument("--sketch-megabytes", type=float, nargs="*", default=[200, 800])
    args = parser.parse_args()
    snapshot = state(args.megabytes)
    for label, cap, rtt in (("loopback", None, 0.0), (f"upload cap {args.cap_mbps:g} Mbit/s", args.cap_mbps, 0.0),
                            (f"rtt {args.rtt_ms:g} ms", None, args.rtt_ms / 1000)):
        rate = asyncio.run(download_rate(snapshot, cap, rtt))
        print(f"download {args.megabytes:g} MB, {label}: {rate:.1f} MB/s", flush=True)
    del snapshot
    for megabytes in args.sketch_megabytes:
        seconds, parts = sketch_seconds(state(megabytes))
        print(f"sketch of a {megabytes:g} MB state: {seconds:.3f} s ({parts} parts read)", flush=True)


if __name__ == "__main__":
    main()
