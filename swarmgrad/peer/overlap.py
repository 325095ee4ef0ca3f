"""When a DiLoCo round travels behind the next inner phase (Streaming DiLoCo's overlap, arXiv
2501.18512): the measured rule, and what a round in flight carries.

Overlap hides the round behind compute, but the outer step then lands on a model that trained on
from the old start, which costs some progress per epoch (issue 7's notes: 0.848 against 0.867 after
7 rounds, merged 15 of 50 steps in). It pays only where it hides a real share of the epoch, the shorter of the two phases: ``auto``
overlaps while the smoothed round time and the smoothed inner phase are within a factor
1 / ``Timing.overlap_share`` of each other and rounds take at least ``Timing.overlap_min_round``
seconds, and stops when either phase comes to dwarf the other (rounds of 1-2 s against inner phases
of 0.2 s in the attack benchmark: hiding 0.2 s was not worth the stale step). The first round,
before any was measured, travels.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from swarmgrad.peer.strategies.diloco import Overlap as OverlapMode
from swarmgrad.timing import DEFAULT_TIMING, Timing

SMOOTHING = 0.3  # weight of the newest measurement in the running estimates


def _smooth(estimate: float | None, value: float) -> float:
    return value if estimate is None else estimate + SMOOTHING * (value - estimate)


class PhaseClock:
    """Seconds the training loop computes between rounds (the inner phase) and seconds a round
    takes, smoothed; ``overlap()`` applies the rule. The driver marks when the training loop waits
    on it (``blocked``) and when it goes on (``resumed``); all else is compute."""

    def __init__(self, mode: OverlapMode = "auto", timing: Timing = DEFAULT_TIMING, clock=time.monotonic):
        self.mode, self.timing, self.clock = mode, timing, clock
        self.inner: float | None = None
        self.round: float | None = None
        self._computed = 0.0  # compute seconds since the last round began
        self._resumed_at: float | None = None

    def resumed(self) -> None:
        self._resumed_at = self.clock()

    def blocked(self) -> None:
        if self._resumed_at is not None:
            self._computed += self.clock() - self._resumed_at
            self._resumed_at = None

    def round_began(self) -> None:
        """A round starts: the compute since the last one was this epoch's inner phase."""
        if self._computed > 0:
            self.inner = _smooth(self.inner, self._computed)
        self._computed = 0.0

    def round_took(self, seconds: float) -> None:
        self.round = _smooth(self.round, seconds)

    def overlap(self) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        if self.round is None:
            # no round measured yet: the first one travels. Where rounds are long it would otherwise
            # hold every peer for a whole round before the pipeline fills (5-6 s of a 35 s run at
            # 5 Mbit/s), and where they are short, an eager step one round early costs little
            return True
        if self.inner is None:
            return False
        # what overlap hides is the shorter phase: worth it only where neither dwarfs the other
        short, long = sorted((self.round, self.inner))
        return self.round >= self.timing.overlap_min_round and short >= self.timing.overlap_share * long


@dataclass
class Flight:
    """A round sent while the next inner phase runs: its epoch, what it sent (the contribution, or its
    bfloat16 copy where the averager reads contributions: a retry resends it, the parameters moved on),
    and the local progress made since, carried into the next epoch."""

    epoch: int
    sent: torch.Tensor
    steps_at_launch: int
    samples_at_launch: int
    launched_at: float
    task: asyncio.Task | None = None
    landed_at: float | None = field(default=None)

    @property
    def landed(self) -> bool:
        return self.landed_at is not None
