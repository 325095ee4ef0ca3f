"""Progress that cannot be gamed, with real peers: three honest peers (the real Peer API on real p2pd
nodes and DHT) and one extra node that does nothing but publish a presence record claiming epoch
10^6, through the real presence record API. The honest peers keep training and averaging, never try
to download the liar's state, and name it as implausible progress. The quorum and median rules
themselves are unit-tested in tests/test_driver.py and below on SwarmProgress."""

from __future__ import annotations

import asyncio

import torch
from conftest import run_async

import swarmgrad as sg
from swarmgrad.dht import NodeConfig, SwarmNode
from swarmgrad.dht.membership import Membership, Progress
from swarmgrad.peer.progress import PeerProgress, SwarmProgress, catch_up_quorum

TIMING = sg.Timing(presence_refresh=0.5)
LIE = 10**6


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


async def train(peer: sg.Peer, model: torch.nn.Module, seed: int, steps: int) -> sg.PeerStatus:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=generator), torch.randint(0, 2, (16,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        await peer.astep(batch_size=16, loss=loss)
        await asyncio.sleep(0.01)  # the other peers share this loop
    return peer.status()


async def honest_peers_beside_a_liar(steps: int):
    models = [model_and_optimizer() for _ in range(3)]
    first = sg.Peer(*models[0], run_id="gamed-progress", timing=TIMING)
    async with first:
        others = [sg.Peer(*pair, run_id="gamed-progress", initial_peers=first.maddrs, timing=TIMING)
                  for pair in models[1:]]
        for peer in others:
            await peer.__aenter__()
        try:
            peers = [first, *others]
            await asyncio.gather(*(peer.await_peers(3, 20) for peer in peers))
            catch_ups: list[tuple[str, list[str], int]] = []
            for peer in peers:  # count every attempt, failed or not (state_downloads counts successes)
                real = peer.driver.catch_up

                async def counted(donors, min_version, peer=peer, real=real):
                    catch_ups.append((peer.node.peer_id, donors, min_version))
                    await real(donors, min_version)

                peer.driver.catch_up = counted
            settings = first.tracker.settings

            def lie(membership: Membership) -> None:
                membership.update(step=LIE, samples_per_second=1e6, progress=Progress(
                    epoch=LIE, samples=LIE, steps=LIE, steps_per_second=1e6, averaging=True, settings=settings))

            async with SwarmNode(NodeConfig(host="127.0.0.1", initial_peers=first.maddrs)) as node, \
                    Membership(node, "gamed-progress", ttl=TIMING.presence_ttl, refresh=TIMING.presence_refresh,
                               before_publish=lie):
                # every honest peer lists the liar (same settings) before training starts
                await asyncio.gather(*(peer.await_peers(4, 20) for peer in peers))
                assert all(len(peer.tracker.fresh().peers) == 4 for peer in peers)
                statuses = await asyncio.gather(*(train(peer, model, seed, steps) for seed, (peer, (model, _))
                                                  in enumerate(zip(peers, models))))
                suspicions = [dict(peer.tracker.suspicions) for peer in peers]
            return statuses, catch_ups, suspicions, node.peer_id
        finally:
            for peer in others:
                await peer.__aexit__(None, None, None)


def test_a_record_claiming_epoch_a_million_triggers_nothing():
    steps = 3 * sg.DiLoCo().inner_steps
    statuses, catch_ups, suspicions, liar = run_async(honest_peers_beside_a_liar(steps))
    # the liar sent no one to download: no attempt named it, or aimed past what honest peers reached
    # (an honest peer that fell behind on this loaded loop may catch up from the other two: allowed)
    honest_epochs = max(status.epoch for status in statuses)
    assert all(liar not in donors and min_version <= honest_epochs for _, donors, min_version in catch_ups), catch_ups
    assert sum(status.state_downloads for status in statuses) <= len(catch_ups)  # none without an attempt
    for status in statuses:  # kept training and averaging
        assert status.rounds_ok >= 1 and status.epoch >= 1, status
    assert honest_epochs >= 2
    for suspected in suspicions:
        assert list(suspected) == [liar] and "implausible progress" in suspected[liar][0]


# ---- the rules, on snapshots --------------------------------------------------------------------


def at(name: str, epoch: int, samples: float = 0.0, steps: float = 0.0, averaging: bool = False) -> PeerProgress:
    return PeerProgress(name, epoch, samples, steps, 0.0, averaging)


def test_catch_up_quorum_is_half_the_swarm_and_at_least_two_distinct_peers():
    assert [catch_up_quorum(n) for n in (0, 1, 2, 3, 4, 9, 10)] == [0, 1, 2, 2, 3, 5, 6]


def test_the_swarms_epoch_and_the_catch_up_target_are_quantiles_not_the_max():
    swarm = SwarmProgress((at("me", 5), at("a", 7), at("b", 6), at("c", LIE)))
    assert swarm.epoch == 6
    donors, target = swarm.ahead("me", 5)
    assert target == 7 and donors == ["a"]  # two of three reached 7; the liar is no donor
    assert [p.peer_id for p in swarm.implausible("me")] == ["c"]


def test_a_liar_listed_alone_for_a_moment_is_not_the_only_other_peer():
    lapsed = SwarmProgress((at("me", 5), at("liar", LIE)), population=3)  # two honest records lapsed
    assert lapsed.ahead("me", 5) == ([], 5)
    assert SwarmProgress((at("me", 5), at("only", 9)), population=1).ahead("me", 5) == (["only"], 9)


def test_one_huge_or_zero_claim_neither_forces_nor_stalls_a_step():
    forced = SwarmProgress((at("me", 0, 16, 1), at("a", 0, 16, 1), at("b", 0, 16, 1), at("liar", 0, 1e9, 1e9)))
    assert forced.capped_samples_in("me", 0) == 16 * 3 + 4 * 16 and forced.median_steps_in("me", 0) == 1
    stalled = SwarmProgress((at("me", 0, 64, 8), at("a", 0, 64, 8), at("zero", 0, 0, 0)))
    assert stalled.capped_samples_in("me", 0) == 128 and stalled.median_steps_in("me", 0) == 8
    two = SwarmProgress((at("me", 0, 16, 2), at("other", 0, 1e9, 1e9)))
    assert two.median_steps_in("me", 0) == 2  # of two, this peer's own count decides
    flag = SwarmProgress((at("me", 0), at("a", 0), at("liar", 0, averaging=True)))
    assert not flag.averaging_quorum_in("me", 0)
    assert SwarmProgress((at("me", 0), at("a", 0, averaging=True))).averaging_quorum_in("me", 0)
