"""Progress that one record cannot game (issue 15, item 3): the swarm's epoch is the one at least half
of its peers reached, so a claim far ahead moves nobody and is never a donor; a peer ahead of that
epoch on its own rejoins it; whether a step is due comes from medians and capped claims.

The unit tests check the rules on snapshots and through the round driver; the last test runs three
honest peers on loopback beside a node that only publishes a presence record claiming epoch 10^6
with their settings (the attack measured in the issue: the honest peers froze for the 40 s the
record lived, retrying downloads from its author)."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import pytest
from conftest import run_async, tiny_classifier, train_steps
from peer_fakes import FakeTracker, attach, model_and_optimizer, set_grads
from test_driver import Harness, peer_at

import swarmgrad as sg
from swarmgrad.dht import NodeConfig, SwarmNode
from swarmgrad.dht.membership import Membership, Progress
from swarmgrad.peer.progress import PeerProgress, SwarmProgress
from swarmgrad.peer.strategies.diloco import DiLoCo
from swarmgrad.peer.strategies.sync import SyncSGD

LIE = 10**6


def swarm(me: int, *others: tuple[str, int], averaging: tuple[str, ...] = ()) -> SwarmProgress:
    peers = [PeerProgress("me", me, 0.0, 0.0, 0.0, False)]
    peers += [PeerProgress(name, epoch, 0.0, 0.0, 0.0, name in averaging) for name, epoch in others]
    return SwarmProgress(tuple(peers))


@pytest.mark.parametrize(("epochs", "expected"), [
    ((4,), 4),                     # alone: its own
    ((0, 9), 9),                   # two: the other is half the swarm (a joiner of two must take the state)
    ((0, 0, 9), 0),                # three: one ahead is not half
    ((5, 5, 5, LIE), 5),           # the attack: one record past three honest peers
    ((5, 5, 5, 0), 5),             # nor can one record drag it back
    ((10,) * 4 + (5,) * 4, 10),    # an even split: the same number for every peer, so only one side moves
    ((7,) * 6 + (LIE, LIE), 7),    # 2 of 8 lying
    # 2 of 8 lying beside honest peers a round or two apart: the liars are left out, then the honest
    # median is taken (with them in, it was the second honest peer's 11, and four honest peers were behind)
    ((12, 11, 10, 10, 9, 9, LIE, LIE), 10),
])
def test_the_swarms_epoch_is_the_one_half_of_the_peers_reached(epochs, expected):
    assert swarm(epochs[0], *((f"p{i}", e) for i, e in enumerate(epochs[1:]))).epoch == expected


def test_one_record_far_ahead_makes_no_donor_and_is_implausible():
    view = swarm(5, ("honest1", 5), ("honest2", 5), ("liar", LIE))
    assert view.ahead(5) == [] and view.rejoin(5) == []
    assert [peer.peer_id for peer in view.implausible()] == ["liar"]


def test_a_peer_behind_takes_the_state_only_from_peers_at_the_swarms_epoch():
    view = swarm(5, ("a", 6), ("b", 6), ("c", 7), ("d", 6), ("liar", LIE), ("slow", 5))
    assert view.epoch == 6 and sorted(view.ahead(5)) == ["a", "b", "c", "d"]  # within DONOR_LEAD, never the liar


def test_in_a_swarm_of_two_the_other_peer_decides():
    assert swarm(0, ("other", 9)).ahead(0) == ["other"]
    assert swarm(9, ("joiner", 0)).rejoin(9) == []  # and the peer ahead stays


def test_a_lone_leader_rejoins_the_swarm_and_the_others_do_not_follow_it():
    """A head start (or rounds that failed) put one peer ahead of the rest: no round can form at its
    epoch, so it takes the state of the swarm it is ahead of; they stay."""
    leader = swarm(5, ("b", 0), ("c", 0), ("d", 0))
    assert sorted(leader.rejoin(5)) == ["b", "c", "d"] and leader.ahead(5) == []
    laggard = swarm(0, ("leader", 5), ("c", 0), ("d", 0))
    assert laggard.ahead(0) == [] and laggard.rejoin(0) == []


def test_a_peer_ahead_waits_for_peers_that_are_about_to_come():
    assert swarm(3, ("b", 3), ("c", 2), ("d", 2)).rejoin(3) == []  # not on its own
    assert swarm(3, ("b", 2), ("c", 2), averaging=("b",)).rejoin(3) == []  # b is finishing round 2
    assert sorted(swarm(3, ("b", 2), ("c", 2)).rejoin(3)) == ["b", "c"]


def progress(name: str, epoch: int, samples: float = 0.0, steps: float = 0.0, averaging: bool = False) -> PeerProgress:
    return PeerProgress(name, epoch, samples, steps, 0.0, averaging)


def test_a_huge_claim_counts_as_a_few_peers_and_a_zero_one_as_none():
    honest = [progress(f"h{i}", 0, samples=100.0, steps=10.0) for i in range(3)]
    view = SwarmProgress((progress("me", 0, 100.0, 10.0), *honest, progress("liar", 0, 1e12, 1e12)))
    assert view.samples_in(0) == 4 * 100.0 + 2 * 100.0 and view.mean_steps_in(0) == (4 * 10.0 + 2 * 10.0) / 5
    view = SwarmProgress((progress("me", 0, 100.0, 10.0), *honest, progress("liar", 0, 0.0, 0.0)))
    assert view.samples_in(0) == 400.0 and view.mean_steps_in(0) == 40.0 / 5


def test_one_peer_claiming_to_average_does_not_start_the_round_of_many():
    others = [progress(f"h{i}", 0) for i in range(3)]
    assert not SwarmProgress((progress("me", 0), *others, progress("liar", 0, averaging=True))).averaging_in(0)
    others[0] = progress("h0", 0, averaging=True)
    assert SwarmProgress((progress("me", 0), *others, progress("liar", 0, averaging=True))).averaging_in(0)


@pytest.mark.parametrize("lie", ["steps", "samples", "averaging", "epoch"])
def test_a_liar_cannot_make_a_step_due(lie):
    model, optimizer = model_and_optimizer(0)
    honest = tuple(progress(f"h{i}", 0, samples=8.0, steps=1.0) for i in range(3))
    liar = {"steps": progress("liar", 0, steps=1e12), "samples": progress("liar", 0, samples=1e12),
            "averaging": progress("liar", 0, averaging=True), "epoch": progress("liar", LIE)}[lie]
    tracker = FakeTracker((*honest, liar))
    strategy = DiLoCo(inner_steps=4) if lie != "samples" else SyncSGD(target_batch_size=64)
    policy = attach(strategy, model, optimizer, tracker)
    set_grads(policy.params, 0)
    assert not policy.after_backward(batch_size=8)
    # the lie gone and the honest counts at the target: due (so the test above could have failed)
    tracker.others = tuple(progress(p.peer_id, 0, samples=64.0, steps=6.0) for p in honest) + (progress("liar", 0),)
    set_grads(policy.params, 1)
    assert policy.after_backward(batch_size=8)


def test_an_honest_leader_two_rounds_ahead_is_no_liar_when_liars_are_left_out():
    view = swarm(10, ("a", 10), ("b", 9), ("c", 12), ("d", 11), ("liar1", LIE), ("liar2", LIE), ("e", 9))
    assert view.epoch == 10 and view.ahead(10) == []
    assert sorted(peer.peer_id for peer in view.implausible()) == ["liar1", "liar2"]  # not c, at 12
    assert sorted(view.ahead(9)) == ["a", "d"]  # at 10 or 11: never the liars, nor c


def test_claims_of_zero_keep_a_peer_from_its_round_only_until_it_trained_twice_the_steps():
    model, optimizer = model_and_optimizer(0)
    tracker = FakeTracker(tuple(progress(f"z{i}", 0) for i in range(3)))
    policy = attach(DiLoCo(inner_steps=4), model, optimizer, tracker)
    due = []
    for seed in range(8):
        set_grads(policy.params, seed)
        due.append(policy.after_backward(batch_size=8))
    assert due == [False] * 7 + [True]


def test_the_driver_of_a_lone_leader_takes_the_swarms_state_and_the_laggards_average():
    leader = Harness([], others=(peer_at(0, "b"), peer_at(0, "c"), peer_at(0, "d")))
    leader.tracker.local.epoch = 4
    assert run_async(leader.driver.swarm_step())
    assert leader.rejoins == [(["b", "c", "d"], 0)] and leader.catch_ups == [] and leader.backend.calls == []
    laggard = Harness([True], others=(peer_at(4, "leader"), peer_at(0, "c"), peer_at(0, "d")))
    assert run_async(laggard.driver.swarm_step())
    assert laggard.catch_ups == [] and laggard.rejoins == [] and len(laggard.backend.calls) == 1


def test_the_driver_beside_a_liar_averages_and_takes_no_state():
    h = Harness([True], others=(peer_at(0, "h1"), peer_at(0, "h2"), peer_at(LIE, "liar")))
    assert run_async(h.driver.swarm_step())
    assert h.catch_ups == [] and h.rejoins == [] and len(h.backend.calls) == 1 and h.tracker.local.epoch == 1


# ---- real peers -------------------------------------------------------------------------------------

TIMING = sg.Timing(presence_refresh=0.5)


def test_honest_peers_keep_averaging_beside_a_record_that_claims_epoch_a_million():
    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            settings = {"strategy": sg.DiLoCo(inner_steps=4), "timing": TIMING}
            models = [tiny_classifier() for _ in range(3)]
            first = await stack.enter_async_context(sg.Peer(*models[0], run_id="gamed-run", **settings))
            peers = [first] + [await stack.enter_async_context(
                sg.Peer(*models[i], run_id="gamed-run", initial_peers=first.maddrs, **settings)) for i in (1, 2)]
            await asyncio.gather(*(peer.await_peers(3, 30) for peer in peers))
            # the liar: a node of its own whose presence record claims epoch 10^6 with the honest settings
            liar = await stack.enter_async_context(SwarmNode(NodeConfig(host="127.0.0.1", initial_peers=first.maddrs)))
            lie = Progress(epoch=LIE, samples=10**9, steps=10**9, steps_per_second=0.0, averaging=True,
                           settings=first.tracker.settings)
            await stack.enter_async_context(Membership(
                liar, "gamed-run", ttl=TIMING.presence_ttl, refresh=TIMING.presence_refresh,
                before_publish=lambda membership: membership.update(progress=lie)))
            deadline = time.monotonic() + 20
            while not all(any(m.peer_id == liar.peer_id for m in peer.runtime.members()) for peer in peers):
                assert time.monotonic() < deadline, "the honest peers never listed the liar's record"
                await asyncio.sleep(0.05)
            epochs = [peer.epoch for peer in peers]
            await asyncio.gather(*(train_steps(peer, model, seed, until=lambda peer=peer, e=e: peer.epoch >= e + 3,
                                               pause=0.005)
                                   for seed, (peer, (model, _), e) in enumerate(zip(peers, models, epochs))))
            for peer, epoch in zip(peers, epochs):
                status = peer.status()
                assert peer.epoch >= epoch + 3, f"frozen by the lie: epoch {peer.epoch}, was {epoch}"
                assert status.state_downloads == 0 and status.epoch < LIE and status.rounds_ok >= 3, status
                assert liar.peer_id in peer.tracker.suspicions  # and it was blamed for it
                assert peer.runtime.admission.misbehaviour.score(liar.peer_id) > 0

    run_async(scenario())
