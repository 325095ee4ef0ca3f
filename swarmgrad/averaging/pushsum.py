"""Dense push-sum arithmetic (SGP, arXiv 1811.10792): who to push to, merging what arrived, and
giving a share away. No I/O: gossip.py moves these values over the network (and adds a refused
share's weight back).

Each peer holds an estimate x and a weight w; the swarm's weighted mean is sum(w x) / sum(w), and
every operation here keeps sum(w x) over the peers and the pushes in flight exactly (a merge only
moves mass; a share is given away before it is sent and taken back only on a refusal).

What a peer takes in of the pushes before merging them is its aggregation rule's gossip form
(rules/: plain push-sum, or clipped gossip).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Push:
    """A push waiting to be merged."""

    weight: float | torch.Tensor  # a scalar, or per-coordinate weights of a sparse push
    values: torch.Tensor  # decoded estimate of the sender, flat float32 (or the pushed coordinates only)
    indices: torch.Tensor | None = None  # sparse pushes: which coordinates
    sender: str = ""  # who pushed it (for the report of clipped pushes)


def exponential_neighbors(members: list[str], me: str, step: int, fanout: int) -> list[str]:
    """Time-varying exponential graph over sorted ids: offsets 2^(step mod log2 n), and the next ones."""
    ordered = sorted(set(members) | {me})
    n = len(ordered)
    if n < 2:
        return []
    exponents = math.ceil(math.log2(n))  # offsets 1, 2, ..., 2^(exponents-1), all below n
    index = ordered.index(me)
    picked: list[str] = []
    for k in range(fanout):
        offset = 2 ** ((step + k) % exponents)
        peer = ordered[(index + offset) % n]
        if peer != me and peer not in picked:
            picked.append(peer)
    return picked


def merge(values: torch.Tensor, weight: float, pushes: list[Push]) -> float:
    """values <- (w x + sum w_k x_k) / W in place, with W = w + sum w_k; returns W.

    The ratios w/W and w_k/W are taken in double precision first: the tensors never carry a
    weight's magnitude (float32 would lose tiny or huge ones)."""
    merged = weight + sum(push.weight for push in pushes)
    values.mul_(weight / merged)
    for push in pushes:
        values.add_(push.values, alpha=push.weight / merged)
    return merged


def give(values: torch.Tensor, weight: float, given: float, arrives: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Keep exactly what was not given away: w x - given x^ = (w - given) x'. Returns (x', w - given).

    x' is a new tensor when the receiver gets something other than x (a lossy codec), else ``values``
    itself; either way the compression error stays with the sender (error feedback by construction)."""
    kept = weight - given
    if torch.equal(arrives, values):
        return values, kept
    # (w x - g x^) / (w - g) = x + g / (w - g) (x - x^): scale-free, whatever w's magnitude
    return torch.add(values, values - arrives, alpha=given / kept), kept
