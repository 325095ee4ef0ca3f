"""The round driver's logic, in-process against a fake averaging backend: retries under fresh
attempts, catching up with a swarm that moved on, stepping alone, expected peers, and saying why a
peer trains alone. The same driver runs with real peers in test_peer_* and test_cli."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import run_async
from peer_fakes import FakeBackend, FakeTracker, attach, model_and_optimizer, set_grads

from swarmgrad.averaging.settings import Gossip
from swarmgrad.peer.backends import MAX_ROUND_ATTEMPTS
from swarmgrad.peer.driver import RoundDriver
from swarmgrad.peer.progress import PeerProgress
from swarmgrad.peer.strategies.diloco import DiLoCo
from swarmgrad.peer.strategies.gossip import GossipSGD
from swarmgrad.state.snapshot import StateTransferError
from swarmgrad.timing import Timing

FAST = Timing(presence_refresh=0.1)  # ahead_wait 0.7 s


def peer_at(epoch: int, name: str = "other") -> PeerProgress:
    return PeerProgress(name, epoch, 0.0, 0.0, 0.0, False)


class Harness:
    """A DiLoCo policy that took a few local steps, its driver, and what the driver called."""

    def __init__(self, outcomes: list[bool], others=(peer_at(0),), other_settings=(), fail_catch_up=False,
                 on_call=None, rejected_share: float = 0.0, retried: dict[int, int] | None = None,
                 replayer=None):
        self.model, optimizer = model_and_optimizer(0, lr=0.5)
        self.tracker = FakeTracker(tuple(others), tuple(other_settings))
        self.policy = attach(DiLoCo(inner_steps=2, outer_lr=1.0, outer_momentum=0.0), self.model, optimizer,
                             self.tracker)
        for seed in range(2):
            set_grads(self.policy.params, seed)
            self.policy.after_backward(batch_size=4)
        self.swarm_average = torch.full((self.policy.layout.total,), 0.25)
        self.backend = FakeBackend(self.policy.contribution, outcomes, self.swarm_average, on_call, rejected_share,
                                   retried)
        self.catch_ups: list[tuple[list[str], int]] = []
        self.rejoins: list[tuple[list[str], int]] = []  # the state taken from a swarm behind this peer
        self.fail_catch_up, self.recorded = fail_catch_up, []
        self.driver = RoundDriver(self.policy, self.backend, self.tracker, FAST, self.catch_up,
                                  self.recorded.append, run_id="unit", replayer=replayer)

    async def catch_up(self, donors: list[str], min_version: int, rejoin: bool = False) -> None:
        (self.rejoins if rejoin else self.catch_ups).append((donors, min_version))
        if self.fail_catch_up:
            raise ConnectionError("donor left")
        self.tracker.next_epoch(min_version)

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.policy.params]


def test_a_round_that_succeeds_applies_the_swarms_average_once():
    h = Harness([True])
    start = [s.clone() for s in h.policy.layout.views(h.policy.start)]
    assert run_async(h.driver.swarm_step())
    assert [call["attempt"] for call in h.backend.calls] == [0]
    assert h.backend.calls[0]["weight"] == 8 and h.backend.calls[0]["expected"] == 2  # me and the other at epoch 0
    for s, p in zip(start, h.policy.params):  # outer lr 1, no momentum: start - average
        torch.testing.assert_close(p.detach(), s - 0.25)
    assert h.tracker.local.epoch == 1 and h.tracker.averaging_set == [True]
    assert len(h.recorded) == 1 and h.recorded[0].ok and h.driver.solo_steps == 0
    assert h.driver.samples_averaged == 8  # the epoch's samples reached an average


def test_what_the_owners_rules_left_out_of_the_average_is_not_counted_as_averaged():
    h = Harness([True], rejected_share=0.25)  # a robust rule rejected a quarter of the contribution's elements
    assert run_async(h.driver.swarm_step())
    assert h.driver.samples_averaged == 6  # 8 samples, three quarters of them in the average


def test_failed_rounds_are_retried_with_fresh_attempts_and_change_nothing_until_one_succeeds():
    before = None

    def check_unchanged(calls: int) -> None:
        if calls > 1:  # every retry sees the same contribution and the parameters as they were
            assert all(torch.equal(a, b) for a, b in zip(before, h.params()))

    h = Harness([False, False, True], on_call=check_unchanged)
    before = h.params()
    assert run_async(h.driver.swarm_step())
    assert [call["attempt"] for call in h.backend.calls] == [0, 1, 2]
    assert all(torch.equal(call["values"], h.backend.calls[0]["values"]) for call in h.backend.calls)
    assert [outcome.ok for outcome in h.recorded] == [False, False, True]
    assert h.tracker.local.epoch == 1 and h.driver.solo_steps == 0
    assert h.driver.samples_averaged == 8  # once, for the attempt that succeeded
    assert not all(torch.equal(a, b) for a, b in zip(before, h.params()))


def test_a_late_peer_follows_the_others_to_their_retry_at_once():
    """Attempt 0's report says the others left its key for attempt 2 (a late peer: matchmaking.py
    ``Retried``): the next attempt is 2, with no wait for the records in between (``ahead_wait`` is 0.7 s
    here). Attempts are counted per peer: a joiner that went on to attempt 1 looked where nobody was,
    and the others failed every attempt waiting for it (big_model.py, 200M, lab)."""
    h = Harness([False, True], retried={0: 2})
    began = time.monotonic()
    assert run_async(h.driver.swarm_step())
    assert [call["attempt"] for call in h.backend.calls] == [0, 2]
    assert time.monotonic() - began < FAST.ahead_wait(2) / 2
    assert h.tracker.local.epoch == 1 and h.driver.solo_steps == 0


def test_a_retry_named_past_the_last_attempt_is_not_followed():
    # any peer may lie in its record: it cannot send this one past the attempts the driver makes
    h = Harness([False] * MAX_ROUND_ATTEMPTS, retried={0: 50})
    assert run_async(h.driver.swarm_step())
    assert [call["attempt"] for call in h.backend.calls] == list(range(MAX_ROUND_ATTEMPTS))


def test_after_every_attempt_fails_the_peer_steps_alone():
    h = Harness([False] * MAX_ROUND_ATTEMPTS)
    start = [s.clone() for s in h.policy.layout.views(h.policy.start)]
    own_delta = [s - p.detach() for s, p in zip(start, h.policy.params)]
    assert run_async(h.driver.swarm_step())
    assert len(h.backend.calls) == MAX_ROUND_ATTEMPTS
    assert h.driver.solo_steps == 1 and h.tracker.local.epoch == 1
    assert h.driver.samples_averaged == 0  # stepped alone: its samples reached no average
    for s, d, p in zip(start, own_delta, h.policy.params):  # the outer step on its own delta: start - delta
        torch.testing.assert_close(p.detach(), s - d)


def test_alone_in_the_run_no_round_is_attempted():
    h = Harness([], others=())
    assert run_async(h.driver.swarm_step())
    assert h.backend.calls == [] and h.driver.solo_steps == 1 and h.tracker.local.epoch == 1
    assert h.tracker.averaging_set == []  # nobody is told to join a round that will not happen


def test_a_peer_behind_the_swarm_catches_up_instead_of_averaging():
    h = Harness([], others=(peer_at(3, "ahead"),))
    assert run_async(h.driver.swarm_step())
    assert h.catch_ups == [(["ahead"], 1)] and h.backend.calls == []
    assert h.tracker.local.epoch == 1 and h.driver.solo_steps == 0


def test_a_round_missed_while_the_others_finished_it_is_caught_up():
    h = Harness([False])
    h.backend.on_call = lambda calls: setattr(h.tracker, "others", (peer_at(1, "finished"),))
    assert run_async(h.driver.swarm_step())
    assert len(h.backend.calls) == 1 and h.catch_ups == [(["finished"], 1)]
    assert h.driver.solo_steps == 0


def test_an_attempt_is_told_when_the_swarm_finished_its_round_without_this_peer():
    h = Harness([False])
    told = []

    def others_finish(calls: int) -> None:
        told.append(h.backend.calls[0]["moved_on"]())  # the other is still at epoch 0
        h.tracker.others = (peer_at(1, "finished"),)
        told.append(h.backend.calls[0]["moved_on"]())  # half the swarm is past epoch 0

    h.backend.on_call = others_finish
    run_async(h.driver.swarm_step())
    assert told == [False, True]  # matchmaking stops looking once the swarm moved on (matchmaking.py)


def test_when_the_others_leave_after_a_failed_round_the_peer_steps_alone_at_once():
    h = Harness([False])
    h.backend.on_call = lambda calls: setattr(h.tracker, "others", ())
    assert run_async(h.driver.swarm_step())
    assert len(h.backend.calls) == 1 and h.driver.solo_steps == 1


def test_a_failed_catch_up_keeps_training_and_waits_before_retrying():
    h = Harness([], others=(peer_at(2, "ahead"),), fail_catch_up=True)
    assert not run_async(h.driver.swarm_step())
    assert not run_async(h.driver.swarm_step())  # within catch_up_retry: not even tried
    assert len(h.catch_ups) == 1 and h.tracker.local.epoch == 0 and h.backend.calls == []


def test_expected_peers_counts_those_finishing_the_previous_epoch():
    h = Harness([], others=(peer_at(4, "a"), peer_at(3, "b"), peer_at(2, "c")))
    h.tracker.next_epoch(4)
    assert h.driver.expected_peers(4) == 3  # me and a at 4, b still finishing 3


def test_peers_with_other_settings_are_named_in_the_warning():
    h = Harness([], others=(), other_settings=("x", "y"))
    assert run_async(h.driver.swarm_step())
    assert h.driver.warning is not None and "2 peer(s) of run 'unit' train with other settings" in h.driver.warning
    assert h.driver.solo_steps == 1
    h.tracker.other_settings = ()
    run_async(h.driver.swarm_step())
    assert h.driver.warning is None


@pytest.mark.parametrize("ok", [True, False])
def test_gossip_steps_once_and_always_takes_the_merged_values(ok):
    model, optimizer = model_and_optimizer(0)
    tracker = FakeTracker((peer_at(0),))
    policy = attach(GossipSGD(every=1), model, optimizer, tracker, averaging=Gossip())
    assert not policy.synchronous
    merged = torch.arange(policy.layout.total, dtype=torch.float32)
    backend = FakeBackend(policy.contribution, [ok], average=merged)
    backend.fixed_average = merged
    driver = RoundDriver(policy, backend, tracker, FAST, catch_up=None)  # gossip never catches up
    assert run_async(driver.swarm_step())
    assert len(backend.calls) == 1 and tracker.local.epoch == 1
    if ok:
        torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in policy.params]), merged)


def test_a_rejoin_whose_state_is_at_this_peers_epoch_waits_for_fresh_records_before_judging_again():
    """Issue 38: records a beat old said the swarm was two epochs behind; the state taken was at this
    peer's own epoch (the donor was there too), and the next swarm step judged the same stale view
    again: 450 downloads in 40 s. Now it trains on until the records are reread."""
    h = Harness([], others=(peer_at(2, "b"), peer_at(2, "c")))
    h.tracker.local.epoch = 4

    async def donor_at_this_epoch(donors, min_version, rejoin=False):
        h.rejoins.append((donors, min_version))
        h.tracker.next_epoch(4)  # what the donor really held

    h.driver.catch_up = donor_at_this_epoch
    assert run_async(h.driver.swarm_step()) and h.rejoins == [(["b", "c"], 2)]
    assert not run_async(h.driver.swarm_step()) and len(h.rejoins) == 1  # the same view: not judged again
    h.driver._retry_at = 0.0  # the records reread (here: the wait is over)
    run_async(h.driver.swarm_step())
    assert len(h.rejoins) == 2


class FakeReplayer:
    """Fetches the missed round's ``result`` (or fails to), applies it as catch_up.py does."""

    def __init__(self, result: torch.Tensor | None):
        self.result, self.policy, self.applied, self.published = result, None, [], 0

    def replays_beside(self) -> bool:
        return True

    async def fetch_missed(self, donors: list[str], epoch: int) -> torch.Tensor:
        if self.result is None:
            raise StateTransferError("the donors' results disagree")
        return self.result

    def apply_missed(self, epoch: int, result: torch.Tensor) -> bool:
        self.applied.append(epoch)
        self.start_before = self.policy.start.clone()
        return self.policy.apply_keeping_progress(result)

    def publish_state(self) -> None:
        self.published += 1


def behind_by_one(result: torch.Tensor | None, outcomes: list[bool]) -> tuple[Harness, FakeReplayer]:
    replayer = FakeReplayer(result)
    h = Harness(outcomes, others=(peer_at(1, "ahead"),), replayer=replayer)
    replayer.policy = h.policy
    return h, replayer


def test_a_peer_one_round_behind_fetches_it_while_training_on_and_applies_it_before_the_next_round():
    """The swarm is one round ahead: the missed round's result is fetched in the background while the
    peer trains on at the next epoch, takes part in that round, and applies the missed result once
    the all-reduce is done, then the round's average (in the swarm's order). At 201M parameters in the
    lab a replay in turn took 25 s against a 13.6 s inner phase, and the joiner never averaged."""
    h, replayer = behind_by_one(None, [True])
    missed = torch.full((h.policy.layout.total,), 0.5)
    replayer.result = missed
    start = h.policy.start.clone()
    assert not run_async(h.driver.swarm_step())  # no round yet: it trains on
    assert h.tracker.local.epoch == 1 and h.tracker.local.steps == 0 and h.tracker.local.samples == 8
    assert h.backend.calls == [] and h.catch_ups == [] and replayer.applied == []

    h.backend.on_call = lambda calls: replayer.applied == [] or pytest.fail("applied while the all-reduce ran")
    assert run_async(h.driver.swarm_step())
    assert [call["epoch"] for call in h.backend.calls] == [1] and h.backend.calls[0]["weight"] == 8
    assert replayer.applied == [0] and replayer.published == 1 and h.catch_ups == []
    # the missed result first, on the start as it was; then the round's average (outer lr 1, no momentum)
    assert torch.equal(replayer.start_before, start)
    torch.testing.assert_close(h.policy.start, start - missed - h.swarm_average)
    assert h.tracker.local.epoch == 2


def test_a_missed_round_whose_fetch_fails_puts_the_peer_back_and_the_next_round_is_not_applied():
    h, replayer = behind_by_one(None, [True])
    start = h.policy.start.clone()
    assert not run_async(h.driver.swarm_step())
    assert run_async(h.driver.swarm_step())  # the round ran; its average cannot land on epoch 0's state
    assert replayer.applied == [] and h.catch_ups == [(["ahead"], 1)]
    torch.testing.assert_close(h.policy.start, start)


def test_a_round_the_others_finish_during_its_attempt_is_fetched_while_training_on():
    """The attempt itself finds the swarm past this epoch (the lab's q2 joiner, rounds 26-28: each
    replayed in turn, each next round missed): fetched beside the next round, as at the step's start."""
    h, replayer = behind_by_one(torch.zeros(1), [False, True])
    replayer.result = torch.full((h.policy.layout.total,), 0.5)
    h.tracker.others = (peer_at(0, "other"),)
    h.backend.on_call = lambda calls: setattr(h.tracker, "others", (peer_at(1, "finished"),))
    assert not run_async(h.driver.swarm_step())
    assert len(h.backend.calls) == 1 and h.catch_ups == [] and h.tracker.local.epoch == 1
    h.backend.on_call = None
    assert run_async(h.driver.swarm_step())
    assert replayer.applied == [0] and h.tracker.local.epoch == 2 and h.catch_ups == []


def test_a_missed_round_on_its_way_is_settled_before_a_resume_compares_epochs():
    """Paused while the missed round's result is on its way, the peer's epoch is one past its state's:
    the resume's catch-up settles it first (Peer._resync), else it would replay from the wrong round."""
    h, replayer = behind_by_one(torch.zeros(1), [])
    replayer.result = torch.full((h.policy.layout.total,), 0.5)
    start = h.policy.start.clone()
    assert not run_async(h.driver.swarm_step())
    assert run_async(h.driver.settle_missed()) and replayer.applied == [0] and h.driver.missed is None
    torch.testing.assert_close(h.policy.start, start - replayer.result)
    assert h.tracker.local.epoch == 1 and run_async(h.driver.settle_missed())  # nothing on its way: nothing to do
