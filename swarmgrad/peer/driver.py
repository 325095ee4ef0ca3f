"""The one round driver: when a strategy's swarm step is due, it runs the round and owns what is
common to every strategy (attempts, catching up with a swarm that moved on, how many peers to
expect, stepping alone) so the policies only say what they contribute and how they apply it.

A DiLoCo round may also travel behind the next inner phase (overlap.py decides when): it is
launched, the training loop goes on, and ``land()`` takes its outer step once it is back (or once
the next inner phase is done, waiting for it then). A round run in turn whose first attempt failed
sends its retries that way too (unless overlap is off): a failing round holds the training loop for
one attempt, not ``MAX_ROUND_ATTEMPTS``; and one whose group has not formed within the backend's
``in_turn_wait`` (its matchmaking window) goes on that way itself, so that a silent member or a dead
entry point holds training for a window, not for however long matchmaking then takes.

The driver talks to an ``AveragingBackend`` (backends.py: a moshpit ``Averager`` or a
``GossipAverager`` behind a small adapter, or a fake in unit tests) and to the peer's progress tracker; it does no
networking of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Iterable, Protocol

import torch

from swarmgrad.peer.backends import MAX_ROUND_ATTEMPTS, AveragingBackend, RoundOutcome
from swarmgrad.peer.missed_round import MissedRound, Replayer
from swarmgrad.peer.overlap import Flight, OverlapMode, PhaseClock
from swarmgrad.peer.progress import SwarmProgress
from swarmgrad.peer.strategies.base import Policy
from swarmgrad.timing import Timing

logger = logging.getLogger(__name__)

class Tracker(Protocol):
    local: Any

    def fresh(self) -> SwarmProgress: ...

    def ahead_of(self, epoch: int) -> list[str]: ...

    def rejoin_from(self, epoch: int) -> list[str]: ...

    def others_at(self, epoch: int) -> list[str]: ...

    def set_averaging(self, averaging: bool) -> None: ...

    def met(self, epoch: int, members: Iterable[str]) -> None: ...

    def next_epoch(self, epoch: int, steps: int = 0, samples: int = 0) -> None: ...


CatchUp = Callable[[list[str], int, bool], Awaitable[None]]  # donors, minimum version, rejoin; raises on failure


class RoundDriver:
    """Runs a policy's swarm steps: ``await driver.swarm_step()`` when ``policy.after_backward`` said so.

    ``catch_up(donors, min_version, rejoin)`` takes the swarm's state (the peer's job: it owns the state);
    when it fails the peer trains on locally and retries after ``timing.catch_up_retry``.
    ``record(outcome)`` counts each round. ``keep_result(epoch, tensor)`` is handed what each epoch
    applied (the swarm's average, or the peer's own values when it stepped alone), before it is
    applied, with the frames it travelled in (None when alone or lossless): a peer that missed the
    round replays it from there. ``run_id`` only names the run in warnings.
    ``overlap``: whether the policy's rounds may travel behind the next inner phase (overlap.py).
    ``replayer``: fetches the one round this peer missed while it trains on into the next (missed_round.py).
    """

    def __init__(self, policy: Policy, backend: AveragingBackend, tracker: Tracker, timing: Timing,
                 catch_up: CatchUp, record: Callable[[RoundOutcome], None] = lambda outcome: None,
                 run_id: str = "",
                 keep_result: Callable[[int, torch.Tensor, list | None], None] = lambda epoch, result, frames: None,
                 overlap: OverlapMode = "off", replayer: Replayer | None = None):
        self.policy, self.backend, self.tracker, self.timing = policy, backend, tracker, timing
        self.catch_up, self.record, self.run_id, self.keep_result = catch_up, record, run_id, keep_result
        self.replayer = replayer
        self.missed: MissedRound | None = None  # the round this peer missed, fetched while it trains on
        self.solo_steps = 0  # epochs this peer finished alone
        self.overlapped = 0  # rounds that travelled behind an inner phase
        # samples this peer sent as weight in rounds that succeeded (its own, and those carried from a
        # round it missed): of the samples it computed, those that reached an average (issue 38 item 5)
        self.samples_averaged = 0
        self.warning: str | None = None  # why this peer trains alone, when it can tell
        self.clock = PhaseClock(overlap if policy.overlap_steps is not None else "off", timing)
        self.flight: Flight | None = None  # the round travelling while training goes on
        self._overlapping = False
        self._retry_at = 0.0

    async def swarm_step(self) -> bool:
        """One swarm step; True when this peer's epoch advanced (by averaging, alone, or by catching
        up). False also when the round was launched to travel behind the next inner phase."""
        if self.flight is not None:
            raise RuntimeError("a round is in flight: land() it first")
        self.clock.blocked()
        try:
            return await self._swarm_step()
        finally:
            self.clock.resumed()

    async def _swarm_step(self) -> bool:
        epoch = self.tracker.local.epoch
        if time.monotonic() < self._retry_at:
            return False  # the last download failed: train on locally for a moment before trying again
        self._check_settings(self.tracker.fresh())
        if not self.policy.synchronous:
            self.policy.prepare()
            outcome = await self.backend.average(epoch, 0, self.policy.weight(), 0, lambda: False)
            self.record(outcome)
            if outcome.average is not None:
                self.policy.apply(outcome.average)
            self.tracker.next_epoch(epoch + 1)
            return True
        ahead = self.tracker.ahead_of(epoch)
        if ahead:  # the swarm moved on without us: take its state instead of averaging stale values
            if self.missed is not None:  # the round before first (its result is on its way)
                await self.settle_missed()
                epoch = self.tracker.local.epoch
                ahead = self.tracker.ahead_of(epoch) or ahead
            return await self._fall_in(ahead, epoch)
        if self.missed is not None:
            return await self._round_beside_missed(epoch)
        alone = not self.tracker.others_at(epoch) and not self.tracker.others_at(epoch - 1)
        if not alone:
            self.tracker.set_averaging(True)
        self.clock.round_began()
        if not alone and self._overlap():
            self._launch(epoch)
            return False
        began = self.clock.clock()  # rounds and inner phases on one clock: the rule compares them
        retries_travel = not alone and self._retries_may_travel()
        if retries_travel:
            # the first attempt, waited for within the backend's bound; where the retries travel, the
            # training loop does not wait on the records either: the flight does
            first = asyncio.ensure_future(self._attempts(epoch, 1, self.policy.weight(), self.policy.prepare_round,
                                                         settle=False))
            try:
                await asyncio.wait({first}, timeout=self.backend.in_turn_wait)
            except asyncio.CancelledError:  # pausing or leaving: the attempt goes with this step
                first.cancel()
                raise
            if not first.done() and not self.backend.writing_in_place:
                # no group yet past its window (a silent member, a dead entry point): training goes on and
                # the attempt travels behind the next inner phase (issue 38: 23 s stalls in the soak)
                self._launch(epoch, first_attempt=1, running=first)
                self.flight.launched_at = began  # type: ignore[union-attr]  # the round's length counts from here
                return False
            outcome, ahead = await first
        else:
            outcome, ahead = await self._attempts(epoch, 0 if alone else MAX_ROUND_ATTEMPTS, self.policy.weight(),
                                                  self.policy.prepare_round)
        if outcome is not None:
            self.clock.round_took(self.clock.clock() - began)
            self.keep_result(epoch, outcome.average, outcome.frames)
            self.policy.apply(outcome.average)
            self.tracker.next_epoch(epoch + 1)
            return True
        if ahead:
            return await self._fall_in(ahead, epoch)
        if retries_travel and self.tracker.others_at(epoch):
            # the first attempt failed: the retries travel behind the next inner phase, so a failing
            # round holds the training loop for one attempt, not three (issue 38: 18-32 s stalls)
            self._launch(epoch, first_attempt=1)
            return False
        rejoined = await self._rejoin(epoch)
        if rejoined is not None:
            return rejoined
        logger.info("epoch %d: no group; stepping on local values", epoch)
        self.policy.prepare()
        self.keep_result(epoch, self.policy.contribution, None)  # before solo(): sync's apply clears the contribution
        self.policy.solo()
        self.solo_steps += 1
        self.tracker.next_epoch(epoch + 1)
        return True

    async def _fall_in(self, ahead: list[str], epoch: int) -> bool:
        """The swarm finished ``epoch`` without this peer: one round ahead, its result is fetched while
        this peer trains on into the next round (missed_round.py; False: nothing applied yet); further
        ahead, or where this peer cannot replay, it catches up now."""
        self.missed = MissedRound.start(self.replayer, self.tracker, ahead, epoch)
        if self.missed is not None:
            return False
        return await self._try_catch_up(ahead, epoch + 1)

    async def _round_beside_missed(self, epoch: int) -> bool:
        """``epoch``'s round, in turn, while the result of the one before it, which this peer missed, is
        fetched (missed_round.py); that result is applied once the all-reduce is done with the
        contribution, then this round's average on top, in the swarm's order."""
        self.tracker.set_averaging(True)
        self.clock.round_began()
        began = self.clock.clock()
        outcome, ahead = await self._attempts(epoch, MAX_ROUND_ATTEMPTS, self.policy.weight(),
                                              self.policy.prepare_round)
        average = outcome.average if outcome is not None else None
        if isinstance(average, torch.Tensor) and \
                average.untyped_storage().data_ptr() == self.policy.contribution.untyped_storage().data_ptr():
            average = average.clone()  # landed in the contribution, which the replay's step releases
        if not await self.settle_missed():  # back at the epoch it missed: this round's average cannot land
            return await self._try_catch_up(self.tracker.ahead_of(epoch - 1) or ahead, epoch)
        if outcome is None:  # the missed round is in; this one failed: judged afresh at the next swarm step
            return True
        self.clock.round_took(self.clock.clock() - began)
        self.keep_result(epoch, average, outcome.frames)
        self.policy.apply(average)
        self.tracker.next_epoch(epoch + 1)
        return True

    async def settle_missed(self) -> bool:
        """Apply the missed round whose result is on its way (missed_round.py), before anything else
        reads the epoch (a resume's catch-up). False where its fetch failed: back at that epoch."""
        missed, self.missed = self.missed, None
        if missed is None:
            return True
        assert self.replayer is not None
        return await missed.settle(self.replayer, self.tracker)

    async def _attempts(self, epoch: int, attempts: int, weight: float, prepare: Callable[[], None],
                        first: int = 0, settle: bool = True) -> tuple[RoundOutcome | None, list[str]]:
        """Rounds ``first`` to ``attempts - 1`` for ``epoch`` (``prepare`` fills the contribution before
        each): the outcome of the one that succeeded, or None and the peers that finished the epoch
        meanwhile. After a failed attempt it waits for the records to say whether the swarm finished
        the epoch (``ahead_wait``); ``settle=False``: not after the last one, the records as they are."""
        attempt = first
        while attempt < attempts:
            prepare()
            outcome = await self.backend.average(epoch, attempt, weight, self.expected_peers(epoch),
                                                 lambda: bool(self.tracker.ahead_of(epoch)))
            self.record(outcome)
            if outcome.ok and outcome.average is not None:
                if outcome.report is not None:  # its groupmates are at the next epoch now, whatever records say
                    self.tracker.met(epoch + 1, outcome.report.group)
                # what owners' rules left out of the average did not reach it (robust rules reject rows)
                left_out = outcome.report.rejected_share if outcome.report is not None else 0.0
                self.samples_averaged += int(weight * (1.0 - left_out))
                return outcome, []
            retried = outcome.report.retried if outcome.report is not None else 0
            if attempt < retried < MAX_ROUND_ATTEMPTS:
                # this peer came late: the others left this attempt's key for a retry, and it follows them
                # there at once (attempts are counted per peer; matchmaking.py ``Retried``)
                attempt, attempts = retried, max(attempts, retried + 1)
                continue
            if not settle and attempt == attempts - 1:
                return None, self.tracker.ahead_of(epoch)
            ahead = await self._wait_for_ahead(epoch)
            if ahead:
                return None, ahead
            if not self.tracker.others_at(epoch):
                break  # nobody else is training: finish the epoch alone
            attempt += 1
        return None, []

    async def _rejoin(self, epoch: int) -> bool | None:
        """No round formed. Ahead of the swarm on our own (a head start, rounds that failed), stepping
        alone would only widen the gap: take the swarm's state instead (None: not ahead). Only now, not
        before the round, since a view of others' records a beat old often lags by an epoch."""
        behind = self.tracker.rejoin_from(epoch)
        if not behind:
            return None
        target = self.tracker.fresh().epoch
        logger.info("epoch %d: ahead of the swarm (epoch %d) on its own; taking its state", epoch, target)
        rejoined = await self._try_catch_up(behind, target, rejoin=True)
        if rejoined and self.tracker.local.epoch >= epoch:
            # the state came from this epoch or later: the swarm was not behind, this peer's view of it
            # was (records a beat old, rounds a fraction of a beat apart). Judging again on that view
            # downloaded the same state over and over (issue 38: 450 times in 40 s, 3 digits peers);
            # train on until the records are reread
            self._retry_at = time.monotonic() + self.timing.presence_refresh
        return rejoined

    # ---- overlap: a round that travels behind the next inner phase ------------------------------

    def landing_due(self) -> bool:
        """The round in flight is to be landed now: it is back, or the next inner phase is done."""
        flight, steps = self.flight, self.policy.overlap_steps
        if flight is None or steps is None:
            return False
        return flight.landed or self.tracker.local.steps - flight.steps_at_launch >= steps

    def _overlap(self) -> bool:
        """The rule's decision for this round, logged when it changes."""
        overlap = self.clock.overlap()
        if overlap != self._overlapping and self.clock.mode == "auto":
            if self.clock.round is None:
                logger.info("the first round travels behind the next inner phase (no round measured yet)")
            else:
                logger.info("rounds %s: a round takes %.1f s, the inner phase %.1f s", "now travel behind the next "
                            "inner phase" if overlap else "run in turn", self.clock.round, self.clock.inner or 0.0)
        self._overlapping = overlap
        return overlap

    def _retries_may_travel(self) -> bool:
        """Whether a round run in turn sends its retries behind the next inner phase (the policy's rounds
        can travel, and overlap is not switched off)."""
        return self.clock.mode != "off"  # "off" also where the policy's rounds cannot travel (__init__)

    def _launch(self, epoch: int, first_attempt: int = 0,
                running: asyncio.Future[tuple[RoundOutcome | None, list[str]]] | None = None) -> None:
        """Send ``epoch``'s round behind the next inner phase, from attempt ``first_attempt``; ``running``:
        an attempt already under way (in matchmaking: the contribution it sent is untouched), which
        goes on, the retries after it if it fails."""
        local = self.tracker.local
        weight = self.policy.weight()
        sent = self.policy.launch(refill=running is None)
        flight = Flight(epoch, sent, local.steps, local.samples, self.clock.clock())

        def keep_sent() -> None:
            """Before each attempt: nothing to fill. The policy keeps what the flight sent until it
            lands (the contribution as sent, or its bfloat16 copy that the averager reads)."""

        if running is None:
            flight.task = asyncio.ensure_future(self._attempts(epoch, MAX_ROUND_ATTEMPTS, weight, keep_sent,
                                                               first_attempt))
        else:
            flight.task = asyncio.ensure_future(self._go_on(running, epoch, weight, keep_sent, first_attempt))
        flight.task.add_done_callback(lambda _: setattr(flight, "landed_at", self.clock.clock()))
        self.flight = flight
        self.overlapped += 1

    async def _go_on(self, running: asyncio.Future[tuple[RoundOutcome | None, list[str]]], epoch: int,
                     weight: float, keep_sent: Callable[[], None],
                     retry_from: int) -> tuple[RoundOutcome | None, list[str]]:
        """An attempt that became a flight while it ran: its outcome, or the retries after it (as
        ``_attempts`` goes on after a failed attempt). Cancelling this cancels the attempt too."""
        outcome, ahead = await running
        if outcome is not None or ahead:
            return outcome, ahead
        ahead = await self._wait_for_ahead(epoch)
        if ahead or not self.tracker.others_at(epoch):
            return None, ahead
        return await self._attempts(epoch, MAX_ROUND_ATTEMPTS, weight, keep_sent, retry_from)

    async def land(self) -> bool:
        """Wait for the round in flight and take its outer step under the local progress made
        meanwhile (a flight cancelled by pausing is withdrawn). Returns whether the epoch advanced.
        Call it from the training side (the parameters change)."""
        flight = self.flight
        if flight is None or flight.task is None:
            raise RuntimeError("no round in flight")
        self.clock.blocked()
        try:  # shielded: a pause cancels this wait, and the flight itself separately (cancel_flight)
            outcome, ahead = await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            if not flight.task.cancelled():
                raise  # only this wait was cancelled: the flight stays, for the next land()
            self.flight = None
            self.policy.withdraw()
            return False
        finally:
            self.clock.resumed()
        self.flight = None
        local = self.tracker.local
        carried = {"steps": local.steps - flight.steps_at_launch, "samples": local.samples - flight.samples_at_launch}
        if outcome is not None:
            self.clock.round_took((flight.landed_at or self.clock.clock()) - flight.launched_at)
            self.keep_result(flight.epoch, outcome.average, outcome.frames)
            self.policy.land(outcome.average)
        elif ahead:
            self.policy.withdraw()  # the swarm's state (or its rounds replayed) replaces this peer's
            return await self._fall_in(ahead, flight.epoch)
        elif self.tracker.rejoin_from(flight.epoch):
            self.policy.withdraw()
            return bool(await self._rejoin(flight.epoch))
        else:
            logger.info("epoch %d: no group; stepping on local values", flight.epoch)
            self.keep_result(flight.epoch, flight.sent, None)
            self.policy.land(flight.sent)
            self.solo_steps += 1
        self.tracker.next_epoch(flight.epoch + 1, **carried)
        return True

    def cancel_flight(self) -> None:
        """Pausing: the round in flight stops travelling. Safe while the training side runs: nothing
        is applied or undone until the next ``land()``, which withdraws it."""
        if self.flight is not None and self.flight.task is not None:
            self.flight.task.cancel()

    async def abandon(self) -> None:
        """Drop the round in flight (leaving): nothing of it is applied, even if it is already back;
        the parameters keep the local progress and the epoch stays as it was. Only while the
        training side does not run."""
        missed, self.missed = self.missed, None
        if missed is not None:
            await missed.drop()
        flight, self.flight = self.flight, None
        if flight is None:
            return
        try:
            if flight.task is not None:
                flight.task.cancel()
                await asyncio.wait([flight.task])  # its own error, if any, is beside the point now
                if not flight.task.cancelled():
                    flight.task.exception()  # retrieved: no "never retrieved" warning at exit
        finally:
            self.policy.withdraw()

    def expected_peers(self, epoch: int) -> int:
        """Peers expected in this epoch's round: those at it, and those still finishing the one before."""
        swarm = self.tracker.fresh()
        return len(swarm.at(epoch)) + len(swarm.at(epoch - 1))

    async def _wait_for_ahead(self, epoch: int) -> list[str]:
        """Peers that finished ``epoch`` (a round we missed), waiting long enough for them to say so."""
        deadline = time.monotonic() + self.timing.ahead_wait(len(self.tracker.fresh().peers))
        while True:
            ahead = self.tracker.ahead_of(epoch)
            if ahead or time.monotonic() > deadline:
                return ahead
            await asyncio.sleep(min(0.1, self.timing.presence_refresh / 4))

    async def _try_catch_up(self, donors: list[str], min_version: int, rejoin: bool = False) -> bool:
        """Take the swarm's state; if no donor can hand it over, keep training locally and retry later
        (a donor that just left, or a slow link, must not end this peer). ``rejoin``: the swarm is
        behind this peer, its state is taken as it is (no rounds to replay from here)."""
        try:
            await self.catch_up(donors, min_version, rejoin)
            return True
        except Exception as error:
            self._retry_at = time.monotonic() + self.timing.catch_up_retry
            logger.warning("could not take the swarm's state (%s); training on, retrying in %.0f s",
                           error, self.timing.catch_up_retry)
            return False

    def _check_settings(self, swarm: SwarmProgress) -> None:
        """Peers of the run that train with other settings never meet this peer's rounds: say so."""
        others, mine = len(swarm.other_settings), len(swarm.peers) - 1
        warning = None
        if others:
            warning = (f"{others} peer(s) of run {self.run_id!r} train with other settings or another model, so "
                       f"their rounds never meet this peer's ({mine} share this peer's); leave the run settings "
                       "out to take the run's manifest, or pass the ones the run uses")
        if warning is not None and warning != self.warning:
            logger.warning(warning)
        self.warning = warning
