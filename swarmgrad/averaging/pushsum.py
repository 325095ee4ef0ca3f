"""Dense push-sum arithmetic (SGP, arXiv 1811.10792): who to push to, merging what arrived, and
giving a share away. No I/O: gossip.py moves these values over the network (and adds a refused
share's weight back).

Each peer holds an estimate x and a weight w; the swarm's weighted mean is sum(w x) / sum(w), and
every operation here keeps sum(w x) over the peers and the pushes in flight exactly (a merge only
moves mass; a share is given away before it is sent and taken back only on a refusal).

Clipped gossip (ClippedGossip, arXiv 2202.01545: x_i <- x_i + Σ_j w_ij clip(x_j - x_i, τ_i)):
``clip_pushes`` replaces each push's estimate x_k by x + clip(x_k - x, τ) before the merge, so one
push moves a peer by at most its share w_k / W of τ. ``ClipScale`` chooses τ: ``TAU_FACTOR`` x the
lower median, over the last ``CLIP_WINDOW`` senders, of each one's latest distance ||x_k - x||
(this merge's included). One entry per sender, so a liar that pushes often still counts once, and
the lower median holds while at most half the senders lie. A clipped push drops the mass of what
was cut, as in ClippedGossip: exact conservation is traded for a bound on any one push. A peer's
first merge has no history: its τ comes from that merge's pushes alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from swarmgrad.averaging.robust import TAU_FACTOR, clip_toward

CLIP_WINDOW = 16  # senders remembered: more than a peer's in-neighbours on the exponential graph of 2^16 peers


@dataclass
class Push:
    """A push waiting to be merged."""

    weight: float | torch.Tensor  # a scalar, or per-coordinate weights of a sparse push
    values: torch.Tensor  # decoded estimate of the sender, flat float32 (or the pushed coordinates only)
    indices: torch.Tensor | None = None  # sparse pushes: which coordinates
    sender: str = ""  # who pushed it (for the report of clipped pushes)


@dataclass
class ClipScale:
    """τ of clipped gossip, from the latest push distance of each recent sender (module docstring)."""

    window: int = CLIP_WINDOW
    latest: dict[str, float] = field(default_factory=dict)  # sender -> distance, oldest sender first

    def tau(self, distances: dict[str, float]) -> float:
        """Remember ``distances`` (sender -> distance of its push now), then ``TAU_FACTOR`` x the lower
        median of every remembered sender's latest distance."""
        for sender, distance in distances.items():
            self.latest.pop(sender, None)
            self.latest[sender] = distance
        while len(self.latest) > self.window:
            del self.latest[next(iter(self.latest))]
        known = sorted(self.latest.values())
        return TAU_FACTOR * known[(len(known) - 1) // 2] if known else math.inf


def clip_pushes(values: torch.Tensor, pushes: list[Push], scale: ClipScale) -> tuple[list[Push], list[int]]:
    """Each push's estimate moved to within τ of ``values`` (on its coordinates, for sparse pushes),
    and the indices of the pushes that were clipped; ``scale`` remembers their distances."""
    current = [values if push.indices is None else values[push.indices] for push in pushes]
    distances = [float(torch.linalg.vector_norm(push.values - here, dtype=torch.float64))
                 for push, here in zip(pushes, current)]
    latest: dict[str, float] = {}
    for push, distance in zip(pushes, distances):  # a sender with several pushes here counts with its farthest
        latest[push.sender] = max(distance, latest.get(push.sender, 0.0))
    tau = scale.tau(latest)
    clipped = [index for index, distance in enumerate(distances) if distance > tau]
    pushes = [Push(push.weight, clip_toward(here, push.values, tau), push.indices, push.sender)
              if index in clipped else push for index, (push, here) in enumerate(zip(pushes, current))]
    return pushes, clipped


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
