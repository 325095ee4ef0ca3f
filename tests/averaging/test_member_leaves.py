"""A member whose round failed tells the others at once: an owner that has every chunk of a
contributor, and waits on another member's, fails as soon as that contributor's channel closes,
not at its deadline (soak: a member killed mid-round held every other member the whole deadline,
since the owners waiting for its contribution had no channel with it to see it die)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from conftest import run_async
from hivemind.p2p import P2P, PeerID

from swarmgrad.averaging import GroupAllReduce, GroupPlan, get_codec
from swarmgrad.averaging.frames import encoded_to_frame
from swarmgrad.averaging.layout import Schema
from swarmgrad.dht import SwarmNode
from swarmgrad.net.transport import Libp2pTransport, StreamChannel
from swarmgrad.net.wire import expect_kind

DEADLINE = 20.0  # the owner's round deadline: failing near it is the bug


@pytest.mark.parametrize("leaves", [True, False])
def test_an_owner_fails_as_soon_as_a_contributor_that_sent_everything_leaves(leaves):
    """The plan: the owner (all of the part), contributor A (this test's raw stream), member X (never
    streams: killed before it could). A sends its chunk, then its round fails and it aborts its channel;
    the owner fails at once, naming A. ``leaves=False``: A keeps its channel open, and the owner waits
    for X until the deadline (here cut short: the test only checks it is still waiting)."""

    async def scenario():
        async with SwarmNode() as owner:
            contributor = await P2P.create(initial_peers=owner.maddrs, nat_port_map=False, auto_nat=False)
            silent = await P2P.create(nat_port_map=False, auto_nat=False)  # in the plan, never streams
            try:
                tensor = torch.arange(100, dtype=torch.float32)
                schema = Schema.of([("w", tensor)])
                a, x = contributor.peer_id.to_base58(), silent.peer_id.to_base58()
                plan = GroupPlan("round-x", (owner.peer_id, a, x), (1.0, 0.0, 0.0), "none", schema.digest)
                transport = Libp2pTransport(owner.p2p)
                allreduce = GroupAllReduce(plan, owner.peer_id, schema, tensor.clone(), 1.0, get_codec("none"),
                                           transport, "test/allreduce")

                async def serve(channel):
                    await allreduce.accept(channel, expect_kind(await channel.recv(0), "part"))

                await transport.serve("test/allreduce", serve)
                began = time.monotonic()
                run = asyncio.ensure_future(allreduce.run(DEADLINE))
                _, reader, writer = await contributor.call_binary_stream_handler(
                    PeerID.from_base58(owner.peer_id), "test/allreduce")
                channel = StreamChannel(owner.peer_id, reader, writer, "libp2p")
                await channel.send({"t": "part", "round": "round-x", "weight": 1.0})
                header, payload = encoded_to_frame(get_codec("none").encode(torch.ones(100)))
                await channel.send({"t": "chunk", "c": 0, **header}, payload)
                if not leaves:
                    done, _ = await asyncio.wait([run], timeout=3.0)
                    assert not done  # still waiting for X's contribution, as it should be
                    run.cancel()
                    return
                await asyncio.sleep(0.5)  # the owner has A's chunk, and waits for X's
                await channel.abort()  # A's round failed elsewhere: it tears its channels down
                report = await asyncio.wait_for(run, DEADLINE + 5)
                assert not report.ok and not report.timed_out, report.error
                assert f"{a} left the round" in report.error, report.error
                assert time.monotonic() - began < DEADLINE / 2
            finally:
                await contributor.shutdown()
                await silent.shutdown()

    run_async(scenario())
