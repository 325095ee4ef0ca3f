"""Sparse push-sum: gossip that sends only the top-k coordinates of each push.

A dense push-sum push carries the whole estimate with half the weight. Sending a few coordinates
of a dense estimate instead would drag the receiver toward zero everywhere else, so sparse gossip
runs one push-sum per coordinate: every coordinate has its own weight, and a push gives half the
weight of only the coordinates it carries, with their exact values. Mass is conserved per
coordinate, exactly, and every coordinate converges as long as it is sent now and then.

Which coordinates: half of the k are those whose value moved most since this peer last shared them
(fresh information first); the other half is a window at a random place, so a coordinate that
stopped moving here, but still differs elsewhere, is sent again too (otherwise mixing stalls). The
place is random, not a sweep: a sweep falls into step with the graph's period and then sends some
coordinates only along edges that split the swarm in two.

Wire payload of one push: k int32 indices (strictly increasing), k float32 values, k float32 weights.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from swarmgrad.net.wire import FrameError

BYTES_PER_ENTRY = 12


class SparseMass:
    """Per-coordinate push-sum weights, and what was last shared of each coordinate."""

    def __init__(self, total: int, weight: float, fraction: float):
        self.weights = torch.full((total,), float(weight))
        self.last_shared = torch.zeros(total)
        self.k = max(1, min(total, math.ceil(fraction * total)))
        self._generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    @property
    def mean_weight(self) -> float:
        return float(self.weights.mean())

    def select(self, values: torch.Tensor) -> torch.Tensor:
        """Sorted, distinct indices: the most changed coordinates, plus a window at a random place."""
        total, sweep_count = len(values), self.k // 2
        start = int(torch.randint(total, (1,), generator=self._generator))
        window = (torch.arange(sweep_count) + start) % total
        score = torch.sub(values, self.last_shared).abs_()
        score[window] = -1.0  # already chosen: let the changed-most half pick others
        changed = torch.topk(score, self.k - sweep_count, sorted=False).indices
        return torch.cat([window, changed]).unique()  # unique() also sorts

    def give(self, values: torch.Tensor, indices: torch.Tensor, share: float) -> torch.Tensor:
        """Give away ``share`` of the chosen coordinates' weights; returns the weights given."""
        given = self.weights[indices] * share
        self.weights[indices] -= given
        self.last_shared[indices] = values[indices]
        return given

    def take_back(self, indices: torch.Tensor, given: torch.Tensor) -> None:
        self.weights[indices] += given

    def merge(self, values: torch.Tensor, indices: torch.Tensor, their_values: torch.Tensor,
              their_weights: torch.Tensor) -> None:
        """values[i] <- (w_i v_i + w'_i v'_i) / (w_i + w'_i) on the pushed coordinates, in place."""
        mine = self.weights[indices]
        total = mine + their_weights
        values[indices] = (mine * values[indices] + their_weights * their_values) / total
        self.weights[indices] = total


def pack(indices: torch.Tensor, values: torch.Tensor, weights: torch.Tensor) -> bytes:
    return b"".join((indices.to(torch.int32).numpy().tobytes(), values.to(torch.float32).numpy().tobytes(),
                     weights.to(torch.float32).numpy().tobytes()))


def unpack(payload: bytes | bytearray | memoryview, count: int, total: int) -> tuple[torch.Tensor, ...]:
    """Validate and split a sparse push; FrameError for anything a correct sender never sends."""
    if len(payload) != BYTES_PER_ENTRY * count:
        raise FrameError(f"sparse push of {count} entries must carry {BYTES_PER_ENTRY * count} bytes")
    data = np.frombuffer(payload, dtype=np.uint8)
    indices = torch.from_numpy(data[: 4 * count].view(np.int32).astype(np.int64))
    values = torch.from_numpy(data[4 * count : 8 * count].view(np.float32).copy())
    weights = torch.from_numpy(data[8 * count :].view(np.float32).copy())
    if count and (int(indices[0]) < 0 or int(indices[-1]) >= total or bool((indices[1:] <= indices[:-1]).any())):
        raise FrameError("sparse push indices must be strictly increasing and within the tensors")
    if not (torch.isfinite(values).all() and torch.isfinite(weights).all() and bool((weights > 0).all())):
        raise FrameError("sparse push holds NaN/Inf values or non-positive weights")
    return indices, values, weights
