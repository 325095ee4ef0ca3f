"""Overlap (peer/overlap.py): a DiLoCo round travels while the next inner phase runs, and its outer
step lands on the model that trained on, keeping that progress. In-process, against a gated fake
backend: the measured rule, what is sent and resent, what landing applies, carried progress, the
state published at landing, failure and abandoning."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FakeClock
from peer_fakes import FakeTracker, attach, model_and_optimizer, set_grads

from swarmgrad.averaging.report import RoundReport
from swarmgrad.peer.backends import MAX_ROUND_ATTEMPTS, RoundOutcome
from swarmgrad.peer.driver import RoundDriver
from swarmgrad.peer.overlap import PhaseClock
from swarmgrad.peer.progress import PeerProgress
from swarmgrad.peer.strategies.diloco import DiLoCo
from swarmgrad.timing import Timing

FAST = Timing(presence_refresh=0.1, overlap_min_round=0.01)
AVERAGE = 0.25  # what every successful round of the fake swarm returns, per element


def test_auto_overlaps_only_once_rounds_take_the_set_share_of_the_inner_phase():
    clock = FakeClock()
    phases = PhaseClock("auto", Timing(overlap_share=0.5, overlap_min_round=1.0), clock=clock)

    def epoch(compute: float, round_seconds: float) -> bool:
        phases.resumed()
        clock.now += compute
        phases.blocked()
        phases.round_began()
        decision = phases.overlap()
        phases.round_took(round_seconds)
        return decision

    assert phases.overlap()  # no round measured: the first one travels
    assert epoch(10.0, 2.0)  # decided before this epoch's round was measured
    assert not epoch(10.0, 2.0)  # rounds 1/5 of the inner phase: in turn
    for _ in range(12):
        last = epoch(10.0, 8.0)
    assert last and phases.round >= 0.5 * phases.inner  # rounds of 0.8 inner phases: overlapped
    for _ in range(12):
        last = epoch(10.0, 1.0)
    assert not last  # cheap again: back in turn
    for _ in range(12):
        last = epoch(1.0, 0.9)
    assert not last  # a large share, but under overlap_min_round seconds
    for _ in range(12):
        last = epoch(1.0, 20.0)
    assert not last  # rounds dwarf the inner phase: hiding it would save 1 s in 21


@pytest.mark.parametrize("mode, expected", [("on", True), ("off", False)])
def test_on_and_off_need_no_measurement(mode, expected):
    assert PhaseClock(mode).overlap() is expected


class GatedBackend:
    """Rounds that end when the test says: each call waits for ``release`` and takes the next outcome."""

    in_turn_wait = float("inf")  # a round in turn holds the training loop until released
    writing_in_place = False

    def __init__(self, contribution: torch.Tensor, outcomes: list[bool]):
        self.contribution, self.outcomes = contribution, list(outcomes)
        self.calls: list[torch.Tensor] = []
        self.release = asyncio.Event()

    async def average(self, epoch: int, attempt: int, weight: float, expected_peers: int,
                      moved_on=lambda: False) -> RoundOutcome:
        self.calls.append(self.contribution.clone())
        await self.release.wait()
        ok = self.outcomes.pop(0)
        average = torch.full_like(self.contribution, AVERAGE)
        return RoundOutcome(ok, average if ok else None, RoundReport("moshpit", attempt, ok=ok))


class Harness:
    """A DiLoCo peer (outer lr 1, no momentum: the new start is start - average) with 2 inner steps
    per epoch and one other peer at its epoch, whose rounds run through a GatedBackend."""

    def __init__(self, outcomes: list[bool], overlap: str = "on", others=None, outer_lr=1.0, outer_momentum=0.0):
        self.model, optimizer = model_and_optimizer(0, lr=0.5)
        self.tracker = FakeTracker(others if others is not None else (PeerProgress("other", 0, 0.0, 0.0, 0.0, False),))
        self.policy = attach(DiLoCo(inner_steps=2, outer_lr=outer_lr, outer_momentum=outer_momentum), self.model,
                             optimizer, self.tracker)
        self.backend = GatedBackend(self.policy.contribution, outcomes)
        self.kept: list[tuple[int, torch.Tensor]] = []
        self.driver = RoundDriver(self.policy, self.backend, self.tracker, FAST, self._no_catch_up,
                                  keep_result=lambda epoch, result, frames: self.kept.append((epoch, result.clone())),
                                  overlap=overlap)

    async def _no_catch_up(self, donors, min_version, rejoin=False):
        raise AssertionError("nobody is ahead")

    def train(self, steps: int, seed: int = 0) -> None:
        for index in range(steps):
            set_grads(self.policy.params, seed + index)
            self.policy.after_backward(batch_size=4)

    def flat_params(self) -> torch.Tensor:
        flat = self.policy.layout.zeros()
        self.policy.copy_params_into(flat)
        return flat


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_round_in_flight_lands_its_outer_step_under_the_progress_made_meanwhile():
    async def scenario():
        h = Harness([True])
        h.train(2)
        start, at_launch = h.policy.start.clone(), h.flat_params()
        assert not await h.driver.swarm_step()  # launched: the epoch has not advanced yet
        assert h.driver.flight is not None and h.driver.overlapped == 1 and h.tracker.local.epoch == 0
        await _settle()
        torch.testing.assert_close(h.backend.calls[0], start - at_launch)  # the pseudo-gradient at launch
        h.train(1, seed=10)  # the next inner phase runs while the round travels
        meanwhile = h.flat_params() - at_launch
        assert not h.driver.landing_due()  # 1 of 2 steps, not back yet
        h.backend.release.set()
        await _settle()
        assert h.driver.landing_due()  # back: land it now
        assert await h.driver.land() and h.driver.flight is None
        new_start = start - AVERAGE
        torch.testing.assert_close(h.policy.start, new_start)  # the swarm's model: what joiners take
        torch.testing.assert_close(h.flat_params(), new_start + meanwhile)
        assert h.tracker.local.epoch == 1 and h.tracker.local.steps == 1 and h.tracker.local.samples == 4
        assert [epoch for epoch, _ in h.kept] == [0]
        h.train(1, seed=20)  # the next pseudo-gradient is measured from the new start
        h.policy.prepare()
        torch.testing.assert_close(h.policy.contribution, new_start - h.flat_params())

    asyncio.run(scenario())


def test_eager_the_next_inner_phase_starts_from_the_provisional_step_and_landing_corrects_it():
    """With momentum, an outer step on the peer's own pseudo-gradient at launch (eager); the landing
    swaps it for the swarm's: start and momentum end as if the round had run in turn."""
    async def scenario():
        h = Harness([True, True], outer_lr=0.7, outer_momentum=0.9)
        in_turn = Harness([True, True], overlap="off", outer_lr=0.7, outer_momentum=0.9)
        for peer in (h, in_turn):
            peer.backend.release.set()
        for epoch in range(2):  # the second epoch starts with momentum from the first
            for peer in (h, in_turn):
                peer.train(2, seed=100 * epoch)
            start, momentum, at_launch = h.policy.start.clone(), h.policy.momentum.clone(), h.flat_params()
            sent = start - at_launch
            await in_turn.driver.swarm_step()
            assert not await h.driver.swarm_step()
            provisional = start - 0.7 * (sent + 0.9 * (0.9 * momentum + sent))
            torch.testing.assert_close(h.flat_params(), provisional)  # eager: trains on from here
            h.train(1, seed=7 + epoch)
            meanwhile = h.flat_params() - provisional
            assert await h.driver.land()
            torch.testing.assert_close(h.policy.start, in_turn.policy.start)  # the swarm's model, published
            torch.testing.assert_close(h.policy.momentum, in_turn.policy.momentum)
            torch.testing.assert_close(h.flat_params(), in_turn.flat_params() + meanwhile)
            h.policy.copy_into_params(h.policy.start)  # both peers train the next epoch from the same point
            h.tracker.local.steps = 0

    asyncio.run(scenario())


def test_a_paused_flight_is_withdrawn_at_the_next_landing():
    async def scenario():
        h = Harness([True], outer_lr=0.7, outer_momentum=0.9)
        h.train(2)
        start, at_launch = h.policy.start.clone(), h.flat_params()
        await h.driver.swarm_step()
        provisional = h.flat_params()
        torch.testing.assert_close(h.policy.start, start)  # start and momentum move only when the round lands
        h.train(1, seed=10)
        meanwhile = h.flat_params() - provisional
        h.driver.cancel_flight()  # pausing: nothing changes yet
        await _settle()
        assert h.driver.landing_due() and h.driver.flight is not None
        assert await h.driver.land() is False
        assert h.driver.flight is None and h.tracker.local.epoch == 0
        torch.testing.assert_close(h.policy.start, start)
        torch.testing.assert_close(h.policy.momentum, torch.zeros_like(start))
        torch.testing.assert_close(h.flat_params(), at_launch + meanwhile)

    asyncio.run(scenario())


def test_landing_waits_for_the_round_once_the_next_inner_phase_is_done():
    async def scenario():
        h = Harness([True])
        h.train(2)
        await h.driver.swarm_step()
        h.train(2, seed=10)
        assert h.driver.landing_due()  # a whole inner phase ran: wait for the round now
        landing = asyncio.ensure_future(h.driver.land())
        await _settle()
        assert not landing.done()
        h.backend.release.set()
        advanced = await landing
        assert advanced and h.tracker.local.epoch == 1 and h.tracker.local.steps == 2

    asyncio.run(scenario())


def test_a_retry_in_flight_resends_what_was_sent_not_the_moved_parameters():
    async def scenario():
        h = Harness([False, True])
        h.train(2)
        await h.driver.swarm_step()
        await _settle()
        h.train(1, seed=10)  # the parameters moved: a pseudo-gradient taken now would differ
        h.backend.release.set()
        assert await h.driver.land() and len(h.backend.calls) == 2
        torch.testing.assert_close(h.backend.calls[1], h.backend.calls[0])

    asyncio.run(scenario())


def test_a_flight_that_finds_no_group_steps_alone_and_keeps_the_local_progress():
    async def scenario():
        h = Harness([False] * MAX_ROUND_ATTEMPTS)
        h.train(2)
        at_launch = h.flat_params()
        await h.driver.swarm_step()
        h.train(1, seed=10)
        before_landing = h.flat_params()
        h.backend.release.set()
        advanced = await h.driver.land()
        # outer lr 1 on its own pseudo-gradient: the new start is where it was at launch
        assert advanced and h.driver.solo_steps == 1 and h.tracker.local.epoch == 1
        torch.testing.assert_close(h.policy.start, at_launch)
        torch.testing.assert_close(h.flat_params(), before_landing)

    asyncio.run(scenario())


def test_an_abandoned_flight_applies_nothing():
    async def scenario():
        h = Harness([True])
        h.train(2)
        start = h.policy.start.clone()
        await h.driver.swarm_step()
        await _settle()
        h.train(1, seed=10)
        trained = h.flat_params()
        await h.driver.abandon()
        assert h.driver.flight is None and h.tracker.local.epoch == 0 and not h.driver.landing_due()
        torch.testing.assert_close(h.policy.start, start)
        torch.testing.assert_close(h.flat_params(), trained)
        assert await h.driver.swarm_step() is False  # the next swarm step launches afresh
        assert h.driver.flight is not None and h.driver.overlapped == 2
        await h.driver.abandon()

    asyncio.run(scenario())


def test_a_flight_already_back_is_still_abandoned_whole():
    """Leaving just after the round came back (not yet landed) applies nothing of it either: the
    published state must stay the last landed one, at the epoch the peer reports."""
    async def scenario():
        h = Harness([True])
        h.train(2)
        start = h.policy.start.clone()
        await h.driver.swarm_step()
        h.train(1, seed=10)
        trained = h.flat_params()
        h.backend.release.set()
        await _settle()
        assert h.driver.flight is not None and h.driver.flight.task.done() and h.driver.landing_due()
        await h.driver.abandon()
        assert h.driver.flight is None and h.tracker.local.epoch == 0 and not h.kept
        torch.testing.assert_close(h.policy.start, start)
        torch.testing.assert_close(h.flat_params(), trained)

    asyncio.run(scenario())


def test_in_turn_the_round_applies_before_training_goes_on():
    async def scenario():
        h = Harness([True], overlap="off")
        h.train(2)
        start = h.policy.start.clone()
        step = asyncio.ensure_future(h.driver.swarm_step())
        await _settle()
        assert not step.done() and h.driver.flight is None
        h.backend.release.set()
        assert await step
        assert h.driver.overlapped == 0 and h.tracker.local.epoch == 1
        torch.testing.assert_close(h.flat_params(), start - AVERAGE)

    asyncio.run(scenario())


@pytest.mark.parametrize("overlap", ["auto", "off"])
def test_a_round_in_turn_whose_first_attempt_fails_sends_its_retries_behind_the_next_inner_phase(overlap):
    async def scenario():
        h = Harness([False, True], overlap=overlap)
        h.driver.clock.round, h.driver.clock.inner = 2.0, 0.1  # measured: auto runs rounds in turn
        h.train(2)
        start, at_round = h.policy.start.clone(), h.flat_params()
        h.backend.release.set()
        waits, wait_for_ahead = [], h.driver._wait_for_ahead

        async def counted(epoch):
            waits.append(epoch)
            return await wait_for_ahead(epoch)

        h.driver._wait_for_ahead = counted
        advanced = await h.driver.swarm_step()
        # the training loop did not wait for the records after the failed attempt (the flight does)
        assert waits == ([0] if overlap == "off" else [])
        await _settle()
        assert len(h.backend.calls) == 2  # the retry resends the pseudo-gradient of the round
        torch.testing.assert_close(h.backend.calls[1], start - at_round)
        if overlap == "off":  # rounds never travel: the loop waited for the retry
            assert advanced and h.driver.flight is None and h.driver.overlapped == 0
            torch.testing.assert_close(h.flat_params(), start - AVERAGE)
            return
        # one attempt held the training loop; the retry travels while the next inner phase runs
        assert not advanced and h.driver.flight is not None and h.driver.overlapped == 1
        assert h.tracker.local.epoch == 0
        h.train(1, seed=10)
        meanwhile = h.flat_params() - at_round  # outer lr 1: the eager step on its own delta stays at at_round
        assert h.driver.landing_due()  # the retry is back
        assert await h.driver.land()
        torch.testing.assert_close(h.policy.start, start - AVERAGE)
        torch.testing.assert_close(h.flat_params(), start - AVERAGE + meanwhile)
        assert h.tracker.local.epoch == 1 and h.tracker.local.steps == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("in_place", [False, True])
def test_a_round_in_turn_still_looking_for_its_group_past_its_window_travels_behind_the_next_inner_phase(in_place):
    async def scenario():
        h = Harness([False, True], overlap="auto")
        h.driver.clock.round, h.driver.clock.inner = 2.0, 0.1  # measured: auto runs rounds in turn
        h.backend.in_turn_wait = 0.05
        h.backend.writing_in_place = in_place  # its all-reduce already writes the average into the contribution
        h.train(2)
        start, at_round = h.policy.start.clone(), h.flat_params()
        step = asyncio.ensure_future(h.driver.swarm_step())
        done, _ = await asyncio.wait({step}, timeout=1.0)
        if in_place:  # the contribution is no longer what was sent: the loop waits for the attempt
            assert not done
            h.backend.release.set()
            h.backend.writing_in_place = False
            await asyncio.wait_for(step, 5.0)
            assert h.driver.flight is not None and h.driver.overlapped == 1  # it failed: the retries travel
        else:  # the attempt goes on as a flight (the same one: no second call) and training goes on
            assert done and not step.result()
            assert h.driver.flight is not None and h.driver.overlapped == 1 and h.tracker.local.epoch == 0
            assert len(h.backend.calls) == 1
        h.train(1, seed=10)
        meanwhile = h.flat_params() - at_round  # outer lr 1: the eager step on its own delta stays at at_round
        h.backend.release.set()
        await _settle()
        # the attempt failed; the retry resends the round's pseudo-gradient, not one measured from the
        # parameters that moved meanwhile
        for _ in range(100):
            if len(h.backend.calls) == 2 and h.driver.landing_due():
                break
            await asyncio.sleep(0.02)
        assert len(h.backend.calls) == 2
        torch.testing.assert_close(h.backend.calls[1], start - at_round)
        assert await h.driver.land()
        torch.testing.assert_close(h.policy.start, start - AVERAGE)
        torch.testing.assert_close(h.flat_params(), start - AVERAGE + meanwhile)
        assert h.tracker.local.epoch == 1 and h.tracker.local.steps == 1

    asyncio.run(scenario())


def test_auto_sends_the_first_round_in_flight_then_follows_the_measured_rule():
    async def scenario():
        h = Harness([True, True, True], overlap="auto")
        clock = FakeClock()  # seconds as the test says, however loaded the machine
        h.driver.clock.clock = clock
        h.backend.release.set()
        h.train(2)
        h.driver.clock.resumed()
        original = h.backend.average

        async def slow(*args):  # a round of 1 s
            clock.now += 1.0
            return await original(*args)

        h.backend.average = slow
        assert not await h.driver.swarm_step()  # no round measured: the first one travels
        assert h.driver.flight is not None
        await _settle()  # it lands 1 s after its launch
        h.train(2, seed=10)
        clock.now += 1.0  # an inner phase as long as the round
        assert await h.driver.land() and h.driver.clock.round == 1.0
        h.train(2, seed=11)
        clock.now += 1.0
        assert not await h.driver.swarm_step()  # measured as long as the compute: it travels again
        await _settle()
        await h.driver.land()
        h.train(2, seed=12)
        clock.now += 40.0  # inner phases that dwarf the 1 s rounds
        for _ in range(5):
            h.driver.clock.round_began()
            h.driver.clock.resumed()
            clock.now += 40.0
            h.driver.clock.blocked()
        assert await h.driver.swarm_step()  # now in turn: hiding 1 s of 40 is not worth a stale step
        assert h.driver.flight is None and h.driver.overlapped == 2

    asyncio.run(scenario())


def test_strategies_whose_rounds_cannot_overlap_never_launch():
    from swarmgrad.peer.strategies.sync import SyncSGD

    model, optimizer = model_and_optimizer(0)
    policy = attach(SyncSGD(target_batch_size=8), model, optimizer)
    driver = RoundDriver(policy, GatedBackend(policy.contribution, []), FakeTracker(), FAST, None, overlap="on")
    assert policy.overlap_steps is None and not driver.clock.overlap() and not driver.landing_due()


def test_the_overlap_benchmark_runs_both_schedules_on_the_policys_own_launch_and_land():
    """benchmarks/overlap_diloco.py --quick: the first outer step is the same step in both schedules
    (overlap only delays it), and from the second on they differ (the next phase trained from the
    eager step, not from the swarm's)."""
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "overlap_diloco.py"), "--quick", "--json"],
                         capture_output=True, text=True, timeout=300, check=True, cwd=root)
    result = json.loads(run.stdout)
    rows = {(row["schedule"], row["momentum"]): row["mean"] for row in result["rows"]}
    assert set(rows) == {("turn", 0.9), ("overlap", 0.9)} and result["land_after"] == result["inner_steps"]
    turn, overlap = rows["turn", 0.9], rows["overlap", 0.9]
    assert len(turn) == len(overlap) == result["rounds"] and all(0 < value <= 1 for value in turn + overlap)
    assert turn[0] == overlap[0] and turn[1] != overlap[1]
