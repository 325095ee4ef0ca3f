"""trimmed-mean: per coordinate, drop the ``trim_for(n)`` lowest and highest values (by count, so a
heavy row is dropped like a light one), then take the weighted mean of the rest. Three rows tolerate
one liar (the trimmed mean is then the median). No gossip form: a push has no group to trim."""

from __future__ import annotations

import torch

from swarmgrad.averaging.rules.base import Aggregate, Rule

TRIM_FRACTION = 0.25  # share of the rows dropped at each end (at least one from three rows on)


def trim_for(rows: int) -> int:
    """Rows dropped at each end of every coordinate: a quarter, at least one from three rows on."""
    return 0 if rows < 3 else max(1, int(rows * TRIM_FRACTION))


def trimmed_mean(stack: torch.Tensor, weights: torch.Tensor, trim: int) -> torch.Tensor:
    """Per coordinate: drop the ``trim`` lowest and highest values, weighted mean of the rest.

    Ties are broken by weight (a row with less weight counts as lower), so the result depends only
    on the (value, weight) pairs, not on the order of the rows."""
    rows = len(stack)
    if not 0 <= 2 * trim < rows:
        raise ValueError(f"cannot trim {trim} of {rows} rows from each end")
    by_weight = weights.argsort(stable=True)
    values, order = stack[by_weight].sort(dim=0, stable=True)
    kept = weights.double()[by_weight][order[trim : rows - trim]]
    return ((values[trim : rows - trim].double() * kept).sum(dim=0) / kept.sum(dim=0)).to(stack.dtype)


class TrimmedMean(Rule):
    name = "trimmed-mean"

    def combine(self, rows: torch.Tensor, weights: torch.Tensor) -> Aggregate:
        return Aggregate(trimmed_mean(rows, weights, trim_for(len(rows))))


RULE = TrimmedMean()
