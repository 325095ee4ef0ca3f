"""mean: the weighted mean of the contributions. It streams (a part's owner keeps a running sum, no
rows), and its gossip form is plain push-sum. No defence: one contribution can move the result
anywhere, so it suits trusted peers and consensus of fixed values (centered-clip keeps the value half
a group holds; the mean averages it with the rest)."""

from __future__ import annotations

import torch

from swarmgrad.averaging.pushsum import Push
from swarmgrad.averaging.rules.base import Aggregate, GossipForm, Rule, weighted_mean


class PlainGossip(GossipForm):
    def admit(self, values: torch.Tensor, pushes: list[Push]) -> tuple[list[Push], list[int]]:
        return pushes, []


class Mean(Rule):
    name = "mean"
    streams = True
    outvotes_from = None

    def combine(self, rows: torch.Tensor, weights: torch.Tensor) -> Aggregate:
        return Aggregate(weighted_mean(rows, weights))

    def gossip(self) -> GossipForm:
        return PlainGossip()


RULE = Mean()
