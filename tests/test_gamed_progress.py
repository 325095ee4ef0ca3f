"""Progress that one record cannot game (issue 15, item 3, its catch-up part): whether the swarm moved
on comes from a quorum of distinct peers, and a claim far ahead of that quorum is never a donor.

The unit tests check the rule on snapshots; the last test runs three honest peers on loopback beside
a node that only publishes a presence record claiming epoch 10^6 with their settings (the attack
measured in the issue: the honest peers froze for the 40 s the record lived)."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import pytest
import torch
from conftest import run_async

import swarmgrad as sg
from swarmgrad.dht import NodeConfig, SwarmNode
from swarmgrad.dht.membership import Membership, Progress
from swarmgrad.peer.progress import PeerProgress, SwarmProgress, catch_up_quorum

LIE = 10**6


def swarm(me: int, *others: tuple[str, int]) -> SwarmProgress:
    peers = [PeerProgress("me", me, 0.0, 0.0, 0.0, False)]
    peers += [PeerProgress(name, epoch, 0.0, 0.0, 0.0, False) for name, epoch in others]
    return SwarmProgress(tuple(peers))


@pytest.mark.parametrize(("others", "needed"), [(0, 0), (1, 1), (2, 2), (3, 2), (4, 3), (7, 4), (15, 8)])
def test_the_quorum_is_half_the_swarm_and_at_least_two_others(others, needed):
    assert catch_up_quorum(others) == needed


def test_one_record_far_ahead_neither_moves_the_swarms_epoch_nor_makes_donors():
    view = swarm(5, ("honest1", 5), ("honest2", 5), ("liar", LIE))
    assert view.ahead(5) == ([], 5) and view.epoch == 5


def test_a_quorum_ahead_makes_donors_of_itself_and_never_of_a_claim_beyond_it():
    view = swarm(5, ("a", 6), ("b", 6), ("c", 7), ("liar", LIE), ("slow", 5))
    donors, target = view.ahead(5)
    assert target == 6 and sorted(donors) == ["a", "b", "c"] and view.epoch == 6


def test_in_a_swarm_of_two_the_other_peer_decides():
    """A joiner of a two-peer swarm must take the state: nobody is there to outvote the other."""
    assert swarm(0, ("other", 9)).ahead(0) == (["other"], 9)


def test_a_round_missed_by_one_peer_of_many_is_still_caught_up():
    view = swarm(3, *((f"p{i}", 4) for i in range(7)))
    assert view.ahead(3)[1] == 4 and len(view.ahead(3)[0]) == 7


# ---- real peers -------------------------------------------------------------------------------------

TIMING = sg.Timing(presence_refresh=0.5)


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


async def train(peer: sg.Peer, model: torch.nn.Module, seed: int, until) -> None:
    generator = torch.Generator().manual_seed(seed)
    deadline = time.monotonic() + 90
    while not until() and time.monotonic() < deadline:
        x, y = torch.randn(16, 8, generator=generator), torch.randint(0, 2, (16,), generator=generator)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        await peer.astep(batch_size=16)
        await asyncio.sleep(0.005)


def test_honest_peers_keep_averaging_beside_a_record_that_claims_epoch_a_million():
    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            settings = {"strategy": sg.DiLoCo(inner_steps=4), "timing": TIMING}
            models = [model_and_optimizer() for _ in range(3)]
            first = await stack.enter_async_context(sg.Peer(*models[0], run_id="gamed-run", **settings))
            peers = [first] + [await stack.enter_async_context(
                sg.Peer(*models[i], run_id="gamed-run", initial_peers=first.maddrs, **settings)) for i in (1, 2)]
            await asyncio.gather(*(peer.await_peers(3, 30) for peer in peers))
            # the liar: a node of its own whose presence record claims epoch 10^6 with the honest settings
            liar = await stack.enter_async_context(SwarmNode(NodeConfig(host="127.0.0.1", initial_peers=first.maddrs)))
            lie = Progress(epoch=LIE, samples=0, steps=0, steps_per_second=0.0, settings=first.tracker.settings)
            await stack.enter_async_context(Membership(
                liar, "gamed-run", ttl=TIMING.presence_ttl, refresh=TIMING.presence_refresh,
                before_publish=lambda membership: membership.update(progress=lie)))
            deadline = time.monotonic() + 20
            while not all(any(m.peer_id == liar.peer_id for m in peer.runtime.members()) for peer in peers):
                assert time.monotonic() < deadline, "the honest peers never listed the liar's record"
                await asyncio.sleep(0.05)
            epochs = [peer.epoch for peer in peers]
            await asyncio.gather(*(train(peer, model, seed, lambda peer=peer, e=e: peer.epoch >= e + 3)
                                   for seed, (peer, (model, _), e) in enumerate(zip(peers, models, epochs))))
            for peer, epoch in zip(peers, epochs):
                status = peer.status()
                assert peer.epoch >= epoch + 3, f"frozen by the lie: epoch {peer.epoch}, was {epoch}"
                assert status.state_downloads == 0 and status.epoch < LIE

    run_async(scenario())
