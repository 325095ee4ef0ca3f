"""median: per coordinate, the weighted median of the contributions (the value with at most half the
weight below it and at most half above; midway between two values when the weight splits exactly
there, so equal weights give the usual median). While the liars hold less than half a group's
weight, every coordinate of the result lies between two honest values, whatever the liars sent. No
gossip form: a push has no group to take the median of."""

from __future__ import annotations

import torch

from swarmgrad.averaging.rules.base import Aggregate, Rule


def weighted_median(stack: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted median of every column of ``stack``. Ties are broken by weight, as trimmed-mean's,
    so the result depends only on the (value, weight) pairs, not on the order of the rows."""
    by_weight = weights.argsort(stable=True)
    values, order = stack[by_weight].sort(dim=0, stable=True)
    below = weights.double()[by_weight][order].cumsum(dim=0)  # weight up to and including each value
    half = below[-1] / 2
    lower = (below < half).sum(dim=0, keepdim=True)  # the first value with half the weight up to it
    upper = (below <= half).sum(dim=0, keepdim=True).clamp(max=len(stack) - 1)  # the first past half
    middle = values.gather(0, lower).double() / 2 + values.gather(0, upper).double() / 2  # never overflows
    return middle.squeeze(0).to(stack.dtype)


class Median(Rule):
    name = "median"

    def combine(self, rows: torch.Tensor, weights: torch.Tensor) -> Aggregate:
        return Aggregate(weighted_median(rows, weights))


RULE = Median()
