"""What a peer counts for ``status()`` and its presence record: rounds, traffic, the smoothed loss;
and what each round tells the ban scores (net/accountability.py) and the round's observers."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch

from swarmgrad.averaging.moshpit import UNREACHABLE_GROUP
from swarmgrad.net.accountability import Misbehaviour
from swarmgrad.peer.backends import RoundOutcome

logger = logging.getLogger(__name__)

LOSS_SMOOTHING = 0.05


class Counters:
    """``record(outcome)`` for each round the driver ran (``RoundDriver(record=...)``); ``observers``
    are called with each outcome first (catch-up's rates, the metrics' round-time histogram)."""

    def __init__(self, misbehaviour: Misbehaviour):
        self.misbehaviour = misbehaviour
        self.observers: list[Callable[[RoundOutcome], None]] = []
        self.rounds_ok = 0
        self.rounds_failed = 0
        self.rounds_unreachable = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self._loss: float | torch.Tensor | None = None  # smoothed where the losses are (a GPU's: no sync per step)
        self.last_report: dict[str, Any] | None = None
        self.longest_round = 0.0  # seconds, matchmaking included (a soak checks nothing creeps up)
        self.longest_allreduce = 0.0  # seconds of the longest all-reduce (what a round's deadline bounds)

    def note_loss(self, value: float | torch.Tensor) -> None:
        """Smooth in one step's loss; a non-finite one is left out. A tensor is smoothed on its device."""
        if isinstance(value, torch.Tensor):
            value = value.detach().float()
            if self._loss is None:
                self._loss = torch.where(torch.isfinite(value), value, torch.full_like(value, math.nan))
                return
            previous = torch.as_tensor(self._loss, device=value.device)
            blended = torch.where(previous.isnan(), value, previous + LOSS_SMOOTHING * (value - previous))
            self._loss = torch.where(torch.isfinite(value), blended, previous)
        elif math.isfinite(value):
            loss = self.loss
            self._loss = value if loss is None else loss + LOSS_SMOOTHING * (value - loss)

    @property
    def loss(self) -> float | None:
        """The smoothed training loss (read from the device, if the losses are there, only now)."""
        loss = None if self._loss is None else float(self._loss)
        return None if loss is None or math.isnan(loss) else loss

    def record(self, outcome: RoundOutcome) -> None:
        report = outcome.report
        if report is None:
            return
        for observer in self.observers:
            try:
                observer(outcome)
            except Exception as error:  # an observer must not break the round's bookkeeping
                logger.warning("round observer failed: %s: %s", type(error).__name__, error)
        # bans: what the round caught, and a clean round for the others it saw contribute
        self.misbehaviour.note_round(report.suspicions, report.observed)
        self.rounds_ok += int(outcome.ok)
        self.rounds_failed += int(not outcome.ok)
        self.rounds_unreachable += int(report.error == UNREACHABLE_GROUP)
        self.bytes_sent += report.bytes_sent
        self.bytes_received += report.bytes_received
        self.last_report = report.summary()
        self.longest_round = max(self.longest_round, report.seconds)
        self.longest_allreduce = max(self.longest_allreduce, getattr(report, "allreduce_seconds", 0.0))
        if report.kind == "moshpit":  # a gossip push is too frequent to log
            logger.info("round %d: %s, %d peers, %.1f s (all-reduce %.1f s), %.2f MB sent", report.round_index,
                        "ok" if outcome.ok else f"failed ({report.error})", len(report.peers), report.seconds,
                        report.allreduce_seconds, report.bytes_sent / 1e6)
