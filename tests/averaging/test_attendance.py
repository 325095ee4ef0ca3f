"""Who matchmaking waits for (issue 38, item 1): members seen alive; a listed member that never
declares costs at most one window, one behind which no peer answers costs none.

The unit tests check the bookkeeping with a fake clock; the last test runs three honest peers on
loopback beside a node that only publishes a presence record (the run's settings digest, an honest
peer's rates, one epoch past the highest honest peer at every beat) and never joins a round: the
attack measured in the issue (169 epochs in 40 s without it, 10 with it)."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

from conftest import FakeClock, run_async, tiny_classifier, train_steps

import swarmgrad as sg
from swarmgrad.averaging.attendance import MAX_BACKOFF, PROBE_BACKOFF, Attendance
from swarmgrad.dht import NodeConfig, SwarmNode
from swarmgrad.dht.membership import Membership, Progress


def test_only_members_seen_alive_are_waited_for_and_a_no_show_is_not_waited_for_again():
    attendance = Attendance(FakeClock())
    slice_ = frozenset({"me", "a", "b", "silent"})
    assert attendance.waited_for(slice_, "me") == {"me"}  # nobody seen alive yet: probes first
    attendance.seen_alive("a")
    attendance.answered("b")
    attendance.answered("silent")
    assert attendance.waited_for(slice_, "me") == slice_
    attendance.missed(["silent"])  # waited a window, never declared
    assert attendance.waited_for(slice_, "me") == {"me", "a", "b"}
    assert attendance.no_shows == {"silent": 1} and attendance.suspects() == ["silent"]
    attendance.seen_alive("silent")  # it declared after all: waited for again, its count stays
    assert "silent" in attendance.waited_for(slice_, "me") and attendance.suspects() == []


def test_probes_back_off_and_a_peer_that_only_answers_probes_is_waited_for_ever_less_often():
    clock = FakeClock()
    attendance = Attendance(clock)
    assert attendance.to_probe({"me", "x"}, "me") == ["x"]
    assert attendance.to_probe({"me", "x"}, "me") == []  # in flight: not twice
    attendance.probe_failed("x")
    clock.now = PROBE_BACKOFF - 0.1
    assert attendance.to_probe({"x"}, "me") == []
    clock.now = PROBE_BACKOFF
    assert attendance.to_probe({"x"}, "me") == ["x"]
    gaps = []
    for _ in range(5):  # answers every probe, never declares
        attendance.answered("x")
        attendance.missed(["x"])
        started = clock.now
        while not attendance.to_probe({"x"}, "me"):
            clock.now += 1.0
        gaps.append(clock.now - started)
    assert gaps == sorted(gaps) and gaps[-1] >= 8 * gaps[0] and max(gaps) <= MAX_BACKOFF
    attendance.seen_alive("x")  # declared: its backoff is forgotten
    attendance.missed(["x"])
    clock.now += PROBE_BACKOFF
    assert attendance.to_probe({"x"}, "me") == ["x"]


def test_what_is_remembered_stays_bounded():
    attendance = Attendance(FakeClock())
    for index in range(5000):
        attendance.missed([f"p{index}"])
    attendance.keep_only({"p1", "p2"})
    assert set(attendance.no_shows) == {"p1", "p2"}


# ---- real peers -------------------------------------------------------------------------------------

# A window far longer than a clean round (tens of ms on loopback): a round that waited for the silent
# record would take at least WINDOW, so 6 epochs in well under 6 windows can only come from rounds
# that did not wait for it (a loose bound, not a timing measurement).
WINDOW = 20.0
TIMING = sg.Timing(presence_refresh=0.5)


def test_a_listed_member_that_never_averages_is_not_waited_for():
    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            settings = {"strategy": sg.DiLoCo(inner_steps=4), "timing": TIMING,
                        "averaging": sg.Moshpit(matchmaking_seconds=WINDOW)}
            models = [tiny_classifier() for _ in range(3)]
            first = await stack.enter_async_context(sg.Peer(*models[0], run_id="silent-run", **settings))
            peers = [first] + [await stack.enter_async_context(
                sg.Peer(*models[i], run_id="silent-run", initial_peers=first.maddrs, **settings)) for i in (1, 2)]
            await asyncio.gather(*(peer.await_peers(3, 30) for peer in peers))
            # the silent member: a node of its own, serving no averaging protocol, whose record says it
            # trains with the honest settings at an honest rate, one epoch past the highest honest peer
            silent = await stack.enter_async_context(SwarmNode(NodeConfig(host="127.0.0.1",
                                                                          initial_peers=first.maddrs)))

            def fill(membership: Membership) -> None:
                local = first.tracker.local
                membership.update(step=local.total_steps, samples_per_second=float(local.samples_per_second),
                                  progress=Progress(epoch=max(peer.epoch for peer in peers) + 1, samples=local.samples,
                                                    steps=local.steps, steps_per_second=float(local.steps_per_second),
                                                    settings=first.tracker.settings))

            await stack.enter_async_context(Membership(silent, "silent-run", ttl=TIMING.presence_ttl,
                                                       refresh=TIMING.presence_refresh, before_publish=fill))
            deadline = time.monotonic() + 20
            while not all(any(m.peer_id == silent.peer_id for m in peer.runtime.members()) for peer in peers):
                assert time.monotonic() < deadline, "the honest peers never listed the silent record"
                await asyncio.sleep(0.05)
            epochs = [peer.epoch for peer in peers]
            started = time.monotonic()
            await asyncio.gather(*(train_steps(peer, model, seed, until=lambda peer=peer, e=e: peer.epoch >= e + 6,
                                               seconds=3 * WINDOW, pause=0.005)
                                   for seed, (peer, (model, _), e) in enumerate(zip(peers, models, epochs))))
            took = time.monotonic() - started
            for peer, epoch in zip(peers, epochs):
                status = peer.status()
                assert peer.epoch >= epoch + 6, f"epoch {peer.epoch}, was {epoch}, after {took:.0f} s: waited for it"
                assert status.rounds_ok >= 6 and status.solo_steps == 0, status
                # listed in every round's slice, never waited for: no window spent on it, so no no-show
                assert silent.peer_id in {m.peer_id for m in peer.runtime.members()}
                assert status.no_shows.get(silent.peer_id, 0) == 0 and status.no_shows == {}, status.no_shows
            assert took < 3 * WINDOW

    run_async(scenario())


def test_a_member_whose_probe_is_in_flight_is_undecided_until_it_answers_or_fails():
    """Matchmaking ends its window early only once no probe of a listed member is in flight: members
    whose probes answered at different moments grouped different sets of peers, and a round failed
    now and then with "no group formed" (tests/averaging/test_averaging.py's two averagers per peer)."""
    attendance = Attendance(FakeClock())
    listed = {"me", "a", "b"}
    assert attendance.probing(listed) == set()
    assert sorted(attendance.to_probe(listed, "me")) == ["a", "b"]
    assert attendance.probing(listed) == {"a", "b"}
    attendance.answered("a")
    assert attendance.probing(listed) == {"b"} and attendance.waited_for(listed, "me") == {"me", "a"}
    attendance.probe_failed("b")
    assert attendance.probing(listed) == set() and attendance.waited_for(listed, "me") == {"me", "a"}
