"""State a joiner can trust, on real p2pd nodes: among three donors, one serves a poisoned state (the
same version and layout, other bytes) or describes the majority's hashes and then serves bad bytes;
the joiner takes the majority's state, fetches parts only from the donors that agree, checks each part
against its hash, and names the liar. Without a majority it takes nothing."""

from __future__ import annotations

import asyncio
import math
from contextlib import AsyncExitStack
from types import SimpleNamespace

import pytest
import torch
from test_state_transfer import CountingServer, assert_same, big_state, new_protocol, serving

from swarmgrad.averaging import state_transfer
from swarmgrad.averaging.state_transfer import StateTransferError, download_state
from swarmgrad.averaging.transport import Libp2pTransport
from swarmgrad.dht import NodeConfig, SwarmNode
from swarmgrad.runtime import BackgroundLoop


@pytest.fixture(scope="module")
def swarm():
    """One joiner and three donors on loopback, for the whole module."""
    loop = BackgroundLoop("trusted-state-test")
    stack = AsyncExitStack()

    async def start():
        joiner = await stack.enter_async_context(SwarmNode(NodeConfig(host="127.0.0.1")))
        donors = await asyncio.gather(*(
            stack.enter_async_context(SwarmNode(NodeConfig(host="127.0.0.1", initial_peers=joiner.maddrs)))
            for _ in range(3)))
        return joiner, donors

    try:
        joiner, donors = loop.run(start(), timeout=60)
        yield SimpleNamespace(loop=loop, joiner=joiner, donors=donors,
                              transports=[Libp2pTransport(node.p2p) for node in (joiner, *donors)])
    finally:
        loop.run(stack.aclose(), timeout=30)
        loop.close()


class BadBytesServer(CountingServer):
    """Describes its snapshot honestly (the majority's hashes), then serves every part with one byte flipped."""

    async def _serve(self, channel) -> None:
        send = channel.send

        async def flipping_send(header, payload=b""):
            if header.get("t") == "part":
                payload = bytearray(payload)
                payload[len(payload) // 2] ^= 0xFF
            await send(header, payload)

        channel.send = flipping_send
        await super()._serve(channel)


def download(swarm, snapshots, kinds=None, **kwargs):
    async def scenario():
        protocol = new_protocol()
        suspicions: dict[str, list[str]] = {}
        async with serving(swarm, protocol, snapshots, kinds) as servers:
            got = await download_state(swarm.transports[0], protocol, [d.peer_id for d in swarm.donors],
                                       seconds=20, suspicions=suspicions, **kwargs)
            return got, [server.served for server in servers], suspicions

    return swarm.loop.run(scenario(), timeout=60)


def test_a_poisoned_state_at_the_same_version_loses_to_the_majority(swarm):
    honest = big_state(version=5, megabytes=10, seed=1)
    poisoned = big_state(version=5, megabytes=10, seed=2)  # same version and layout, other bytes
    assert poisoned.digest == honest.digest and not torch.equal(poisoned.data, honest.data)
    got, served, suspicions = download(swarm, [honest, poisoned, honest])
    assert_same(got, honest)
    assert served[1] == [] and served[0] and served[2]  # parts only from the donors that agree
    liar = swarm.donors[1].peer_id
    assert list(suspicions) == [liar] and "other bytes than the majority" in suspicions[liar][0]


def test_a_donor_claiming_a_far_newer_version_is_outvoted(swarm):
    honest = big_state(version=5, megabytes=1, seed=1)
    got, served, suspicions = download(swarm, [honest, honest, big_state(version=10**6, megabytes=1, seed=2)])
    assert_same(got, honest)
    assert served[2] == [] and list(suspicions) == [swarm.donors[2].peer_id]
    assert "described version 1000000" in suspicions[swarm.donors[2].peer_id][0]


def test_bad_bytes_behind_the_majoritys_hashes_are_caught_part_by_part(swarm):
    honest = big_state(version=5, megabytes=10, seed=1)
    parts = math.ceil(honest.nbytes / state_transfer.PART_BYTES)
    assert parts >= 3
    got, served, suspicions = download(swarm, [honest, honest, honest], [CountingServer, BadBytesServer, CountingServer])
    assert_same(got, honest)
    assert len(served[1]) == 1  # it served one part, which failed its hash; it was dropped
    assert sorted(served[0] + served[2]) == list(range(parts))  # the others fetched every part
    liar = swarm.donors[1].peer_id
    assert list(suspicions) == [liar] and "fail its agreed hash" in suspicions[liar][0]


def test_without_a_strict_majority_nothing_is_taken(swarm):
    states = [big_state(version=v, megabytes=0.5, seed=v) for v in (5, 6, 7)]
    with pytest.raises(StateTransferError, match="majority of the 3 donor"):
        download(swarm, states)
    # one donor that answers is its own majority (two stay silent): a swarm of two takes in a joiner
    got, served, suspicions = download(swarm, [states[0], None, None])
    assert_same(got, states[0])
    assert suspicions == {} and served[0]


def test_donors_that_just_moved_on_still_agree_on_the_version_before(swarm):
    v5, v6 = big_state(version=5, megabytes=0.5, seed=5), big_state(version=6, megabytes=0.5, seed=6)

    async def scenario(moved: list[bool]):
        protocol = new_protocol()
        async with serving(swarm, protocol, [v5] * len(moved)) as servers:
            for server, on in zip(servers, moved):
                if on:
                    server.publish(v6)  # it keeps v5 too, for downloads in progress
            suspicions: dict[str, list[str]] = {}
            got = await download_state(swarm.transports[0], protocol, [d.peer_id for d in swarm.donors[:len(moved)]],
                                       seconds=20, suspicions=suspicions)
            return got, suspicions

    got, suspicions = swarm.loop.run(scenario([False, True]), timeout=60)
    assert_same(got, v5)  # both hold 5; only one holds 6
    assert suspicions == {}
    got, suspicions = swarm.loop.run(scenario([False, True, True]), timeout=60)
    assert_same(got, v6)  # two of three hold 6
    assert suspicions == {}  # the one behind is no liar
