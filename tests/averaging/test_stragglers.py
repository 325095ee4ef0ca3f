"""How long matchmaking waits for a straggler (issue 38, item 2): once a peer measured its own round
period, a member whose record carries a pace is waited for at most a tenth of it, and not at all
when its pace says it cannot come by then; a liar's pace never stretches the wait past that cap.

Unit tests with a fake clock, then ``Matchmaker.find_group`` in-process with a fake DHT (as
test_matchmaking_grace.py does) and a 20 s window: without the cap every scenario below waits the
whole window, so each is bounded well below it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from matchmaking_fakes import DeclaredNode

from swarmgrad.averaging.matchmaking import Matchmaker
from swarmgrad.averaging.stragglers import OWN_STEPS, STRAGGLER_SHARE, Pace, Patience, RoundClock, straggler_cap

WINDOW = 20.0  # the window a straggler would otherwise cost
PERIOD = 1.0  # this peer's measured round period: the cap is STRAGGLER_SHARE of it
BOUND = WINDOW / 2  # a round that waited the window fails this bound; the cap is 0.1 s


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_round_period_is_the_median_gap_between_round_starts():
    clock = Clock()
    rounds = RoundClock(clock)
    assert rounds.period is None
    for gap in (1.0, 1.0, 0.01, 1.2):  # a retry's short gap moves the median little
        rounds.started()
        clock.now += gap
    rounds.started()
    assert rounds.period == pytest.approx(1.0)


def test_the_cap_is_a_share_of_the_period_at_least_a_few_dht_requests_at_most_the_window():
    assert straggler_cap(None, 2.0, 0.01) is None  # nothing measured: the window rules
    assert straggler_cap(10.0, 2.0, 0.01) == pytest.approx(STRAGGLER_SHARE * 10.0)
    assert straggler_cap(10.0, 0.5, 0.01) == 0.5
    assert straggler_cap(0.1, 2.0, 0.05) == pytest.approx(0.15)  # a declaration takes that long to show
    # a period of a few steps: a tenth of it is less than one step, and a member as fast comes within one
    assert straggler_cap(0.2, 2.0, 0.001, step=0.05) == pytest.approx(OWN_STEPS * 0.05)
    assert straggler_cap(0.2, 2.0, 0.001, step=10.0) == 2.0  # never past the window


def test_a_member_as_fast_as_this_peer_is_waited_for_however_short_the_round_period():
    """Rounds every few steps (DiLoCo H=4 at 50 steps/s: a 0.1 s period): a tenth of the period is
    less than one step, so a member of equal pace that had not declared when half had was never
    waited for. Here ``me`` steps 50 times a second too; the straggler declares 30 ms (1.5 steps) late."""
    group, no_shows = find_group(Pace(50.0, False), declares_after=0.03, period=0.1, own=Pace(50.0, True))
    assert sorted(group) == ["me", "other", "slow"] and no_shows == {}
    # a member 10x slower is not waited for, and the one as fast is, only as long as one of its steps
    group, no_shows = find_group(Pace(5.0, False), declares_after=0.03, period=0.1, own=Pace(50.0, True))
    assert group == ["me", "other"] and no_shows == {}


def test_a_straggler_is_waited_for_up_to_the_cap_only_when_its_pace_fits():
    clock = Clock()
    paces = {"near": Pace(20.0, False), "far": Pace(2.0, False), "looking": Pace(0.1, True),
             "idle": Pace(0.0, False), "liar": Pace(1e6, True)}
    patience = Patience(0.1, paces, clock)
    assert {peer for peer in [*paces, "no-pace"] if patience.waits_for(peer)} == {"near", "looking", "liar", "no-pace"}
    clock.now = 0.1  # the cap is out: only a member without a pace is still waited for (attendance.py)
    assert [peer for peer in [*paces, "no-pace"] if patience.waits_for(peer)] == ["no-pace"]
    # those it waited for and that did not come are no-shows; a straggler it never waited for is not
    assert patience.gave_up_on([*paces, "no-pace"]) == {"near", "looking", "liar"}
    unmeasured = Patience(None, paces, clock)
    clock.now = 100.0
    assert all(unmeasured.waits_for(peer) for peer in paces) and unmeasured.gave_up_on(paces) == set()


def test_a_declaration_made_at_the_caps_last_moment_is_looked_for_while_it_takes_to_show():
    clock = Clock()
    patience = Patience(0.1, {"near": Pace(20.0, False)}, clock, shown_after=0.05)
    clock.now = 0.12  # past the cap: a declaration made just before it may not have shown yet
    assert patience.waits_for("near") and patience.gave_up_on(["near"]) == set()
    clock.now = 0.16
    assert not patience.waits_for("near") and patience.gave_up_on(["near"]) == {"near"}


def find_group(pace: Pace, declares_after: float | None, measured: bool = True,
               stragglers: tuple[str, ...] = ("slow",), period: float = PERIOD,
               own: Pace | None = None) -> tuple[list[str] | None, dict]:
    """One round with ``me`` and ``other`` declared and ``stragglers`` (seen alive, claiming ``pace``)
    declaring after ``declares_after`` seconds (None: never); the group ``me`` leads and the no-shows.
    ``period``: the round period ``me`` measured; ``own``: the pace ``me``'s own record claims."""
    async def scenario():
        node = DeclaredNode(["me", "other"])
        matchmaker = Matchmaker(node, SimpleNamespace(admission=None), "test", schema_digest="schema",
                                codec="none", reply_timeout=0.1)
        clock = Clock()
        matchmaker.rounds = RoundClock(clock)
        if measured:
            for _ in range(3):
                matchmaker.rounds.started()
                clock.now += period
        for member in ("other", *stragglers):  # all averaged before: alive
            matchmaker.attendance.seen_alive(member)

        async def lead(key, group, min_group_size, share):
            return group

        async def declare_late():
            await asyncio.sleep(declares_after)
            node.declared.extend(stragglers)

        matchmaker.invitations.lead = lead
        if declares_after is not None:
            asyncio.ensure_future(declare_late())
        # nobody else can be dialled: "me" leads whichever group holds it
        plan = await asyncio.wait_for(matchmaker.find_group(
            "round", group_size=8, min_group_size=2, window=WINDOW, share=1.0, expected=2 + len(stragglers),
            expected_members=frozenset({"me", "other", *stragglers}), unreachable=frozenset({"other", *stragglers}),
            paces={"other": Pace(100.0, True), **{peer: pace for peer in stragglers},
                   **({"me": own} if own is not None else {})}), BOUND)
        return plan, matchmaker.attendance.no_shows

    return asyncio.run(scenario())


def test_a_straggler_that_cannot_come_within_the_cap_is_not_waited_for_nor_a_no_show():
    # one step takes it 0.5 s, the cap is 0.1 s: the round goes on without it (it replays and keeps its work)
    group, no_shows = find_group(Pace(2.0, False), declares_after=None)
    assert group == ["me", "other"] and no_shows == {}


def test_a_straggler_whose_pace_fits_the_cap_is_waited_for_and_joins():
    group, no_shows = find_group(Pace(50.0, False), declares_after=0.03)
    assert sorted(group) == ["me", "other", "slow"] and no_shows == {}


def test_a_liars_pace_does_not_stretch_the_wait_past_the_cap():
    # it claims to be averaging at a million steps a second and never declares: waited for 0.1 s, then a no-show
    group, no_shows = find_group(Pace(1e6, True), declares_after=None)
    assert group == ["me", "other"] and no_shows == {"slow": 1}


def test_an_early_minority_waits_for_the_others_past_the_cap():
    # 2 of 6 here first, the 4 others 0.3 s later (3x the cap): those here are early, not the rest
    # late, so the round waits and takes all 6 instead of splitting the swarm 2 / 4
    late = ("a", "b", "c", "d")
    group, no_shows = find_group(Pace(50.0, False), declares_after=0.3, stragglers=late)
    assert sorted(group) == sorted(["me", "other", *late]) and no_shows == {}


def test_once_half_are_here_the_others_are_stragglers_and_the_cap_holds():
    # 2 of 4 here: the other two, whose paces fit, are waited for up to the cap only (no-shows after it)
    group, no_shows = find_group(Pace(50.0, False), declares_after=None, stragglers=("a", "b"))
    assert group == ["me", "other"] and no_shows == {"a": 1, "b": 1}


def test_before_a_period_is_measured_an_alive_member_is_waited_for_as_before():
    # the same far straggler, declaring after 0.3 s: with no period measured there is no cap yet
    group, no_shows = find_group(Pace(2.0, False), declares_after=0.3, measured=False)
    assert sorted(group) == ["me", "other", "slow"] and no_shows == {}


def test_the_averager_reads_paces_from_the_members_progress_records():
    from swarmgrad.averaging.moshpit import Averager
    from swarmgrad.dht.membership import Progress

    def member(peer: str, progress: Progress | None) -> SimpleNamespace:
        return SimpleNamespace(peer_id=peer, progress=progress)

    trainer = Progress(epoch=3, samples=64, steps=2, steps_per_second=4.0, averaging=True)
    averager = SimpleNamespace(_averaging_members=lambda: [member("trainer", trainer), member("averager", None)])
    assert Averager._paces(averager) == {"trainer": Pace(4.0, True)}  # no progress: no pace, the window rules
