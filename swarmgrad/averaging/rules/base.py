"""What every aggregation rule is and shares: the ``Rule`` interface, its result (``Aggregate``), the
gossip form, and the arithmetic several rules use (weighted mean, median, weight bounds).

A rule sees one chunk at a time: a stack of contributions (one row per member, float32) and their
sample weights, already bounded (``bound_weights``), and returns a tensor of the chunk's length. Pure:
no I/O, no state; a rule's gossip form may keep state (one per averager).

- **small groups**: one row is its own result, and a group of two cannot out-vote a liar (there is no
  majority to keep): every rule returns their weighted mean, so only the run's cap bounds what a liar
  claims there (the median cut of ``bound_weights`` cuts nothing among two). So a rule that out-votes
  from ``outvotes_from`` rows is not used in a smaller group while that many members of the slice are
  known to be here (invitations.py ``quorum``): such peers then wait for a larger group instead.
- **weights**: a rule that needs all rows sees each claim cut to min(cap, ``WEIGHT_FACTOR`` x the
  median claim); a streaming one, only to the cap (it folds a contribution before the others have
  claimed). With factor 2 one peer never holds more than half the weight of a group of three or
  more, the point where the robust rules break down.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from swarmgrad.averaging.pushsum import Push

WEIGHT_FACTOR = 2.0


@dataclass
class Aggregate:
    """A chunk's result and the rows whose pull it bounded: clipped (pulled by a bounded amount) or
    rejected (left out); ``reach``: those rows' distance from the result, in the rule's radius (what
    the log shows). The owner suspects the members behind those rows."""

    value: torch.Tensor
    clipped: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    reach: dict[int, float] = field(default_factory=dict)


class GossipForm(ABC):
    """How a gossiping peer takes in the pushes that arrived before push-sum merges them (one per
    averager: it may remember earlier pushes)."""

    @abstractmethod
    def admit(self, values: torch.Tensor, pushes: list[Push]) -> tuple[list[Push], list[int]]:
        """The pushes to merge into ``values`` (this peer's estimate, flat), and the indices of those
        whose pull was bounded (their senders are suspected)."""


class Rule(ABC):
    """An aggregation rule. ``streams``: its result is the weighted mean of the rows, so a part's owner
    folds each contribution into a running sum as it arrives and keeps no rows; otherwise the owner
    keeps every member's row of a chunk until all are in, and calls ``aggregate``."""

    name: ClassVar[str]
    streams: ClassVar[bool] = False
    outvotes_from: ClassVar[int | None] = 3  # the fewest rows among which it out-votes one liar (None: never)

    def aggregate(self, rows: torch.Tensor, weights: torch.Tensor) -> Aggregate:
        """One chunk's result from ``rows`` (members x chunk, float32) and their bounded ``weights``
        (float64); two rows or fewer: their weighted mean (see the module docstring)."""
        if len(rows) <= 2:
            return Aggregate(weighted_mean(rows, weights))
        return self.combine(rows, weights)

    @abstractmethod
    def combine(self, rows: torch.Tensor, weights: torch.Tensor) -> Aggregate:
        """The rule itself, on three rows or more."""

    def gossip(self) -> GossipForm | None:
        """A fresh gossip form of this rule, or None: the rule needs a group (gossip cannot use it)."""
        return None


def weighted_mean(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.mv(rows.t(), (weights.double() / weights.sum()).to(rows.dtype))


def median(values: torch.Tensor) -> float:
    """The middle of a 1-D tensor (the mean of the two middle values when their number is even)."""
    ordered = values.double().sort().values
    n = len(ordered)
    if n == 0:
        raise ValueError("the median of nothing")
    return float(ordered[n // 2]) if n % 2 else float((ordered[n // 2 - 1] + ordered[n // 2]) / 2)


def bound_weights(weights: torch.Tensor, cap: float | None = None,
                  factor: float | None = WEIGHT_FACTOR) -> torch.Tensor:
    """Each weight cut to min(``cap``, ``factor`` x the median weight); None leaves that bound out."""
    limit = float("inf") if cap is None else cap
    if factor is not None and len(weights):
        limit = min(limit, factor * median(weights))
    return weights.double().clamp(max=limit)
