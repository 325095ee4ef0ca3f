"""What the round driver talks to (peer/driver.py): one attempt at a round, through a moshpit
``Averager`` or a ``GossipAverager`` behind a small adapter (or a fake in unit tests), and what it
comes back with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from swarmgrad.averaging import Averager, GossipAverager
from swarmgrad.averaging.report import RoundReport

MAX_ROUND_ATTEMPTS = 3  # a round that failed is retried under a fresh key, up to this many times


@dataclass
class RoundOutcome:
    """``ok``: the swarm's average is in ``average``. False: the round failed and nothing changed."""

    ok: bool
    average: torch.Tensor | None = None
    report: RoundReport | None = None
    frames: list | None = None  # the average as it travelled (averaging/result_frames.py), if lossy


class AveragingBackend(Protocol):
    # how long a round run in turn holds the training loop before it travels behind the next inner
    # phase instead (seconds; a group forms within its matchmaking window, or is late)
    in_turn_wait: float
    # whether the attempt now running writes the average into the contribution itself: it has to be
    # waited for then (the contribution is no longer what was sent)
    writing_in_place: bool

    async def average(self, epoch: int, attempt: int, weight: float, expected_peers: int,
                      moved_on: Callable[[], bool]) -> RoundOutcome:
        """One attempt at ``epoch``'s round; ``moved_on()`` says when the swarm finished it without
        this peer, so that an attempt no group takes stops early."""


class MoshpitBackend:
    """A moshpit Averager over the policy's contribution; the average is read where it landed: in the
    contribution itself while ``in_place()`` says nothing reads it again (a round run in turn, whose
    retries fill it afresh), else in a buffer of its own."""

    def __init__(self, averager: Averager, in_place: Callable[[], bool] = lambda: False):
        self.averager, self.in_place = averager, in_place
        self.in_turn_wait = averager.matchmaking_seconds
        self.writing_in_place = False

    def _in_place_now(self) -> bool:
        """Asked as the all-reduce begins (a round in turn may have become a flight meanwhile)."""
        self.writing_in_place = self.in_place()
        return self.writing_in_place

    async def average(self, epoch: int, attempt: int, weight: float, expected_peers: int,
                      moved_on: Callable[[], bool]) -> RoundOutcome:
        retry = attempt + 1 if attempt + 1 < MAX_ROUND_ATTEMPTS else None  # where this peer goes if it fails
        try:
            report = await self.averager.step(weight=max(weight, 1e-6), round_index=epoch,
                                              expected_peers=expected_peers, attempt=attempt,
                                              in_place=self._in_place_now, moved_on=moved_on, retry=retry)
        finally:
            self.writing_in_place = False
        if not report.ok:
            return RoundOutcome(False, None, report)
        if self.averager.write_back:
            return RoundOutcome(True, self.averager.tensors[0], report, self.averager.take_average()[1])
        average, frames = self.averager.take_average()
        return RoundOutcome(True, average, report, frames)


class GossipBackend:
    """Push-sum gossip: no rounds; every step merges what arrived into the contribution, which then
    holds this peer's estimate of the swarm's mean whether or not its own push got through."""

    in_turn_wait = float("inf")  # gossip steps are not rounds in turn
    writing_in_place = False

    def __init__(self, gossip: GossipAverager, contribution: torch.Tensor):
        self.gossip, self.contribution = gossip, contribution

    async def average(self, epoch: int, attempt: int, weight: float, expected_peers: int,
                      moved_on: Callable[[], bool]) -> RoundOutcome:
        self.gossip.add_weight(weight)  # push-sum mass from the samples since the last step, not 1 a peer
        report = await self.gossip.step()
        return RoundOutcome(report.ok, self.contribution, report)
