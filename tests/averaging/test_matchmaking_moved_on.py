"""A peer that looks for a group after the swarm finished the round without it stops looking once its
view of the others' progress says so (issue 38: a late peer waited about 6 s, its window, the grace
and a plan's wait, for a group nobody was looking for any more, up to three times a round).

The last test is about the end of a follower's wait for a plan, where the same rounds lost time.

In-process, with a fake DHT (as test_matchmaking_grace.py does) and a 20 s window: without
``moved_on`` each scenario below waits the window out."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from matchmaking_fakes import DeclaredNode

from swarmgrad.averaging.invitations import Looking
from swarmgrad.averaging.matchmaking import Matchmaker

WINDOW = 20.0


def matchmaker(declared: list[str]) -> Matchmaker:
    return Matchmaker(DeclaredNode(declared), SimpleNamespace(admission=None), "test", schema_digest="schema",
                      codec="none", reply_timeout=0.1)


def test_a_peer_alone_under_a_key_stops_looking_once_the_swarm_moved_on():
    async def scenario() -> tuple[object, float]:
        began = time.monotonic()
        plan = await matchmaker(["me"]).find_group(
            "round", group_size=4, min_group_size=2, window=WINDOW, share=1.0,
            moved_on=lambda: time.monotonic() - began > 0.3)
        return plan, time.monotonic() - began

    plan, took = asyncio.run(scenario())
    assert plan is None and 0.3 <= took < 2.0  # not the 20 s window


def test_a_listed_member_that_moved_on_is_not_waited_for_past_the_moment_that_shows():
    # the grid lists a member alive (probes answer) that never declares: it finished the round
    async def scenario() -> tuple[object, float]:
        mm = matchmaker(["me"])
        mm.attendance.answered("ahead")
        began = time.monotonic()
        plan = await mm.find_group("round", group_size=4, min_group_size=2, window=WINDOW, share=1.0,
                                   expected_members=frozenset({"me", "ahead"}),
                                   moved_on=lambda: time.monotonic() - began > 0.3)
        return plan, time.monotonic() - began

    plan, took = asyncio.run(scenario())
    assert plan is None and took < 2.0


def test_stopping_declines_every_later_invitation_and_leaves_a_committed_peer_alone():
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        looking = Looking("round", 1.0, plan=loop.create_future())
        await Matchmaker._stop_when(lambda: True, looking)
        assert looking.committed and looking.plan.result() is None

        taken = Looking("round", 1.0, committed=True, plan=loop.create_future())  # a group took it first
        await Matchmaker._stop_when(lambda: True, taken)
        assert not taken.plan.done()

    asyncio.run(scenario())


def test_an_invitation_accepted_as_the_wait_for_a_plan_ends_is_waited_for():
    """A follower that accepted an invitation just as its wait for the expected leader's plan ran
    out waits for that leader's decision: leaving, it would be in the plan and never come, and the
    group would wait out the all-reduce's deadline (soak: 5 s lost each time)."""
    async def scenario() -> tuple[bool, object]:
        mm = matchmaker(["me"])  # reply deadline 0.1 s: the first wait is window + 0.2 s
        loop = asyncio.get_running_loop()
        accepted = Looking("round", 1.0, plan=loop.create_future())
        plan = object()

        def accept() -> None:  # what serve() does on an invitation, then the leader's "begin"
            accepted.committed = True
            loop.call_later(0.1, accepted.plan.set_result, plan)

        loop.call_later(0.28, accept)
        got = await mm._plan(accepted, window=0.1)
        alone = await mm._plan(Looking("round", 1.0, plan=loop.create_future()), window=0.1)  # nobody invited it
        return got is plan, alone

    got, alone = asyncio.run(scenario())
    assert got and alone is None
