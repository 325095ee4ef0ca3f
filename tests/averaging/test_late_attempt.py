"""A peer that comes late to a round follows the others to the attempt they went on to.

Attempts are counted per peer. At 200M in the lab (benchmarks/big_model.py) a joiner finished replaying
a round 1-3 s late and looked under the first attempt's key while the two peers that started the run,
which counted it as here (it had answered a probe) and so needed a group of three under the
centered-clip quorum, waited for it under the second's and the third's: every attempt failed, both
stepped alone, and their models differed from then on. A peer whose attempt failed now says on its
declaration where it went (``Matchmaker.leave``), and the late peer goes there at once (``Retried``).

Real DHT and transports on loopback, three matchmakers; the all-reduce after the plan is beside the point.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

from conftest import run_async

from swarmgrad.averaging.group_plan import GroupPlan
from swarmgrad.averaging.matchmaking import Matchmaker, Retried, split_groups
from swarmgrad.dht import NodeConfig
from swarmgrad.net.network_runtime import NetworkRuntime
from swarmgrad.timing import Timing

WINDOW = 1.5
PROTOCOL = "late-attempt/match"


def key(attempt: int, round_name: str) -> str:
    return round_name if attempt == 0 else f"{round_name}.{attempt}"


def round_led_by(peer: str, members: frozenset[str]) -> str:
    """A round name under which ``peer`` is its group's expected leader at the first attempt: the case
    where the two that came on time must both see that they are too few without it, at the same moment
    (one of them used to go on at once and the other a plan's wait later, and they missed each other)."""
    return next(name for name in (f"late-attempt/r{index}" for index in range(1000))
                if split_groups(sorted(members), 4, name)[0][0] == peer)


async def three_peers_one_late() -> tuple[list[tuple[int, GroupPlan | None]], object, float, object]:
    async with AsyncExitStack() as stack:
        timing = Timing(presence_refresh=0.5)
        first = await stack.enter_async_context(NetworkRuntime("late-attempt", timing=timing))
        runtimes = [first] + [await stack.enter_async_context(
            NetworkRuntime("late-attempt", NodeConfig(initial_peers=first.node.maddrs), timing=timing))
            for _ in range(2)]
        matchmakers = [Matchmaker(runtime.node, runtime.transport, PROTOCOL, schema_digest="schema", codec="none",
                                  aggregator="centered-clip") for runtime in runtimes]
        for runtime, matchmaker in zip(runtimes, matchmakers):
            await runtime.transport.serve(PROTOCOL, matchmaker.serve)
        members = frozenset(runtime.peer_id for runtime in runtimes)
        for matchmaker in matchmakers:  # all three met in earlier rounds
            for peer in members - {matchmaker.node.peer_id}:
                matchmaker.attendance.seen_alive(peer)
        *starters, late = matchmakers
        round_name = round_led_by(late.node.peer_id, members)
        retrying, in_retry = [], asyncio.Event()

        async def find(matchmaker: Matchmaker, attempt: int) -> GroupPlan | Retried | None:
            return await matchmaker.find_group(key(attempt, round_name), group_size=4, min_group_size=2, window=WINDOW,
                                               share=1.0, expected_members=members)

        async def start(matchmaker: Matchmaker) -> tuple[int, GroupPlan | None]:
            for attempt in range(3):  # as the round driver does: up to three attempts, each under its own key
                if attempt == 1:
                    retrying.append(matchmaker)
                    if len(retrying) == len(starters):
                        in_retry.set()
                # the late peer answered a probe between attempts (it is not busy any more): it counts as
                # here, so the quorum of three stands and a pair does not form
                matchmaker.attendance.seen_alive(late.node.peer_id)
                plan = await find(matchmaker, attempt)
                if plan is not None:
                    return attempt, plan
                matchmaker.leave(key(attempt, round_name), attempt + 1)
            return 3, None

        async def come_late() -> tuple[object, float, object]:
            await in_retry.wait()  # the first attempt failed without it
            await asyncio.sleep(0.3)
            began = time.monotonic()
            answer = await find(late, 0)
            followed = time.monotonic() - began
            plan = await find(late, answer.attempt) if isinstance(answer, Retried) else None
            return answer, followed, plan

        *outcomes, (answer, followed, plan) = await asyncio.gather(*(start(m) for m in starters), come_late())
        for matchmaker in matchmakers:
            await matchmaker.close()
        return outcomes, answer, followed, plan


def test_a_late_peer_follows_the_others_to_their_retry_and_the_three_average_there():
    outcomes, answer, followed, plan = run_async(three_peers_one_late())
    # under the first attempt's key it found both gone to the second, and followed them at once
    assert answer == Retried(1) and followed < WINDOW / 2, (answer, followed)
    assert [attempt for attempt, _ in outcomes] == [1, 1], outcomes
    plans = [starter_plan for _, starter_plan in outcomes] + [plan]
    assert all(p is not None and len(p.members) == 3 for p in plans), plans
    assert len({p.round_id for p in plans}) == 1  # one group, one plan
