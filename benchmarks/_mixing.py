"""The mixing benchmarks/scale_sim.py simulates: moshpit grid rounds and push-sum gossip on numpy arrays,
with churn, lost pushes and failed groups, the bytes each rule sends, and rounds to consensus.

What is simulated is each averager's own rule, not a textbook variant:
- moshpit (moshpit.py with grid.py; groups of consensus.py's GROUP_SIZE g, equal weights as
  consensus.py and scale.py pass): the N members get grid.grid_sides' grid (d = ceil(log_g N)
  dimensions, sides of at most g, the fewest cells), each sits at the mixed-radix digits of its
  rank in grid.grid_order (called here, salted per cycle of d rounds: every cycle lays the swarm
  out afresh), and in round t the peers that share every digit but digit t mod d average. A slice
  of one keeps its vector ("no group"). --grid base: the plain rule, base-g digits of the rank in
  the sorted ids, d fixed, never reshuffled. Churn: each round each peer is absent with p=--churn
  (it neither averages nor changes); ranks come from the full membership (presence records outlive
  a short absence), or with --rerank also from the peers present, as everyone sees them. A group's
  all-reduce fails with p=--group-failure and leaves all its members unchanged.
- gossip (gossip.py, pushsum.py): push-sum on (estimate, weight), weights rank + 1 as in
  consensus.py. A step merges what arrived, then gives weight / (k + 1) of what it has left to each
  of its k neighbours in turn (k = fanout, Gossip()'s default 1; neighbours from
  pushsum.exponential_neighbors, called here). Asynchrony is modelled as synchronous steps: a push
  sent in step s is merged in the receiver's step s + 1. "own clocks" (--async-activity a < 1):
  in each tick each peer steps with chance a, its own step count picks its neighbours, and pushes
  wait for the receiver's next step. "lost pushes": each push is lost with p=--churn, its share
  with it (gossip.py: a push that may have arrived is never counted twice).

Consensus is consensus.py's metric: the max over peers of ||x_i - mean|| / ||mean|| after each
round or step (gossip: mean steps per peer), x_i standard normal vectors of --dim (64) entries.
Mixing is linear and acts on every coordinate alike, so rounds do not depend on the dimension
(only the spread of the max over peers does, a little). Moshpit keeps the plain mean exactly,
churn or not; gossip that loses pushes converges to the mean of the mass that survived (its drift
from the initial mean is reported) and is measured against that.

Bytes, for --numel float32 with codec none: a member of an all-reduce group of m sends (m - 1)/m of
the vector as a contributor and as much again as an owner, and receives as much (allreduce.py); a
failed group's attempt counts as sent. A gossip push sends the whole vector to each neighbour
(lost ones count).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from consensus import GROUP_SIZE

from swarmgrad.averaging.grid import grid_order, grid_sides
from swarmgrad.averaging.pushsum import exponential_neighbors
from swarmgrad.averaging.settings import Gossip

FLOAT32_BYTES = 4  # codec none
TARGET = 1e-3  # as consensus.py and scale.py
DIM = 64
NUMEL = 1_000_000
MAX_ROUNDS = 400  # rounds or steps; a run that has not reached the target by then reports none


# ---------------------------------------------------------------- the mixing rules


def grid_dims(peers: int, side: int) -> int:
    """d = ceil(log_side peers), at least 1: the fewest dimensions grid.grid_sides gives."""
    return max(1, math.ceil(math.log(max(1, peers)) / math.log(side) - 1e-9))


def sides_for(members: int, side: int, grid: str) -> tuple[int, ...]:
    """The grid's sides: moshpit.py's (grid.grid_sides: fewest cells) or the plain base-``side`` grid."""
    return grid_sides(members, side) if grid == "real" else (side,) * grid_dims(members, side)


def slice_keys(ranks: np.ndarray, dim: int, sides: tuple[int, ...]) -> np.ndarray:
    """One key per slice of the grid along ``dim``: the rank with its mixed-radix digit ``dim``
    zeroed (grid.grid_position's digits), so the ranks that share every other digit share a key."""
    stride = math.prod(sides[:dim])
    return ranks - (ranks // stride % sides[dim]) * stride


def peer_id(index: int) -> str:
    return f"peer-{index:06d}"  # sorted ids are indices


@functools.lru_cache(maxsize=64)
def _grid_ranks(members: tuple[int, ...], salt: str) -> np.ndarray:
    order = grid_order([peer_id(i) for i in members], salt)
    ranks = np.empty(max(members) + 1, dtype=np.int64)
    ranks[[int(p.rsplit("-", 1)[1]) for p in order]] = np.arange(len(order))
    ranks.flags.writeable = False
    return ranks


def grid_ranks(members: np.ndarray, round_index: int, dims: int, grid: str, salt: str) -> np.ndarray:
    """Each member's rank in the grid order of this round: moshpit.py's (grid.grid_order, salted
    by the cycle of ``dims`` rounds, so every cycle lays the swarm out afresh) or the sorted ids."""
    if grid != "real":
        return np.arange(len(members))
    return _grid_ranks(tuple(members.tolist()), f"{salt}/{round_index // dims}")[members]


def allreduce_bytes(members: int | np.ndarray, numel: int) -> float | np.ndarray:
    """Bytes one member of a butterfly all-reduce of ``members`` sends, and as many it receives: its
    contribution to the m - 1 parts others own, then as an owner the average of its own part back
    to the m - 1 others, (m - 1)/m of the vector each way (allreduce.py). 0 for a group of one."""
    m = np.asarray(members, dtype=np.float64)
    sent = np.where(m > 1, 2 * (m - 1) / np.maximum(m, 1), 0.0) * numel * FLOAT32_BYTES
    return float(sent) if sent.ndim == 0 else sent


def push_bytes(numel: int) -> float:
    """Bytes of one dense gossip push (the whole vector, codec none)."""
    return float(numel * FLOAT32_BYTES)


def max_rel_error(x: np.ndarray, mean: np.ndarray) -> float:
    """consensus.py's metric: max over peers of ||x_i - mean|| / ||mean||."""
    return float(np.sqrt(((x - mean) ** 2).sum(axis=1).max()) / np.linalg.norm(mean))


def moshpit_round(x: np.ndarray, members: np.ndarray, ranks: np.ndarray, dim: int, sides: tuple[int, ...],
                  failure: float, rng: np.random.Generator) -> np.ndarray:
    """One moshpit round on ``x`` (peers x dim) in place: the ``members`` present, at grid ``ranks``,
    meet along ``dim``. Returns each peer's group size (0: in no group, as a group of one)."""
    sizes_out = np.zeros(len(x), dtype=np.int64)
    if len(members) < 2:
        return sizes_out
    keys = slice_keys(ranks, dim, sides)
    order = np.argsort(keys, kind="stable")
    peers, sorted_keys = members[order], keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    sizes = np.diff(np.r_[starts, len(peers)])
    attempted = sizes > 1  # alone in its slice: skips the round
    ok = attempted & (rng.random(len(sizes)) >= failure) if failure > 0 else attempted
    means = np.add.reduceat(x[peers], starts, axis=0) / sizes[:, None]
    ok_peer = np.repeat(ok, sizes)
    x[peers[ok_peer]] = np.repeat(means, sizes, axis=0)[ok_peer]
    sizes_out[peers] = np.repeat(np.where(attempted, sizes, 0), sizes)
    return sizes_out


def gossip_offsets(peers: int, step: int, fanout: int) -> tuple[int, ...]:
    """This step's neighbour offsets, from pushsum.exponential_neighbors itself: with every peer seeing
    the same sorted ids the rule is the same shift for everyone, so peer 0's neighbours give it."""
    # its offsets are 2^((step + k) mod ceil(log2 N)): one period of steps is all there is to cache
    return _offsets(peers, step % max(1, math.ceil(math.log2(peers))), fanout)


@functools.lru_cache(maxsize=4096)
def _offsets(peers: int, step: int, fanout: int) -> tuple[int, ...]:
    ids = [peer_id(i) for i in range(peers)]
    return tuple(int(peer.rsplit("-", 1)[1]) for peer in exponential_neighbors(ids, ids[0], step, fanout))


@dataclass
class PushSum:
    """Every peer's push-sum state, and the pushes waiting for each receiver's next merge."""

    x: np.ndarray  # estimates, peers x dim
    w: np.ndarray  # weights
    inbox_mass: np.ndarray  # sum of w_k x_k pushed to each peer, not merged yet
    inbox_weight: np.ndarray
    steps: np.ndarray  # steps each peer has taken (picks its neighbours)
    outgoing: np.ndarray  # scratch: the pushes of this step, peers x dim
    scratch: np.ndarray

    @classmethod
    def start(cls, x: np.ndarray, w: np.ndarray) -> PushSum:
        return cls(x.copy(), w.astype(np.float64), np.zeros_like(x), np.zeros(len(x)), np.zeros(len(x), dtype=np.int64),
                   np.zeros_like(x), np.zeros_like(x))

    def mean(self) -> np.ndarray:
        """The weighted mean of all the mass there is (peers and pushes in flight)."""
        mass = (self.w[:, None] * self.x).sum(axis=0) + self.inbox_mass.sum(axis=0)
        return mass / (self.w.sum() + self.inbox_weight.sum())


def _subset(mask: np.ndarray) -> slice | np.ndarray:
    """Index for the peers in ``mask``: a slice when it is everyone, so that the arrays are views."""
    return slice(None) if mask.all() else np.flatnonzero(mask)


def gossip_step(state: PushSum, active: np.ndarray, fanout: int, drop: float, rng: np.random.Generator) -> np.ndarray:
    """One step of the ``active`` peers: merge their inbox (pushsum.merge), then push (pushsum.give
    per neighbour in turn). Returns the pushes each peer sent."""
    n = len(state.x)
    merging = _subset(active & (state.inbox_weight > 0))
    total = state.w[merging] + state.inbox_weight[merging]
    if isinstance(merging, slice):  # everyone: in place
        state.x *= (state.w / total)[:, None]
        state.inbox_mass /= total[:, None]
        state.x += state.inbox_mass
    else:
        state.x[merging] = (state.x[merging] * (state.w[merging] / total)[:, None]
                            + state.inbox_mass[merging] / total[:, None])
    state.w[merging] = total
    state.inbox_mass[merging], state.inbox_weight[merging] = 0.0, 0.0
    sent = np.zeros(n, dtype=np.int64)
    # pushes land after every active peer has merged: the receiver merges them at its next step
    outgoing_mass, outgoing_weight = state.outgoing, np.zeros(n)
    outgoing_mass.fill(0.0)
    for phase in np.unique(state.steps[active]):
        senders = _subset(active & (state.steps == phase))
        offsets = gossip_offsets(n, int(phase), fanout)
        for offset in offsets:
            given = state.w[senders] / (len(offsets) + 1)  # of what is left, as gossip._push takes it
            state.w[senders] -= given
            sent[senders] += 1
            if isinstance(senders, slice):  # everyone pushes along one shift: a roll
                if drop > 0:  # a lost push's share is gone
                    given = given * (rng.random(n) >= drop)
                pushed = np.multiply(state.x, given[:, None], out=state.scratch)
                outgoing_mass[offset:] += pushed[: n - offset]
                outgoing_mass[:offset] += pushed[n - offset :]
                outgoing_weight += np.roll(given, offset)
                continue
            indices = np.arange(n)[senders]
            delivered = rng.random(len(indices)) >= drop if drop > 0 else slice(None)
            arrived, share = indices[delivered], given[delivered]
            receivers = (arrived + offset) % n  # one shift: distinct receivers
            outgoing_mass[receivers] += share[:, None] * state.x[arrived]
            outgoing_weight[receivers] += share
    state.inbox_mass += outgoing_mass
    state.inbox_weight += outgoing_weight
    state.steps[active] += 1
    return sent


# ---------------------------------------------------------------- one simulated run


@dataclass
class Run:
    rounds: float | None  # rounds (moshpit) or mean steps per peer (gossip) to target; None: not reached
    bytes_per_peer: float  # sent until then (or until the cap), mean over peers
    final_error: float
    drift: float = 0.0  # ||mean it converges to - initial mean|| / ||initial mean||
    no_group: float = 0.0  # moshpit: share of present peer-rounds in no group


def initial(peers: int, seed: int, dim: int) -> np.ndarray:
    return np.random.default_rng((seed, peers)).standard_normal((peers, dim))


def simulate_moshpit(peers: int, seed: int, *, side: int = GROUP_SIZE, grid: str = "real", dim: int = DIM,
                     numel: int = NUMEL, target: float = TARGET, churn: float = 0.0, failure: float = 0.0,
                     rerank: bool = False, max_rounds: int = MAX_ROUNDS) -> Run:
    """Rounds to target. The grid is laid out from the full membership (presence records outlive a
    short absence), or with ``rerank`` from the peers present in that round, as everyone sees them."""
    x = initial(peers, seed, dim)
    mean = x.mean(axis=0)
    rng, everyone = np.random.default_rng((seed, peers, 1)), np.arange(peers)
    sent, alone, attended = np.zeros(peers), 0, 0
    error = max_rel_error(x, mean)
    for round_index in range(max_rounds):
        present = rng.random(peers) >= churn if churn > 0 else np.ones(peers, dtype=bool)
        laid_out = np.flatnonzero(present) if rerank else everyone
        sides = sides_for(len(laid_out), side, grid)
        ranks = grid_ranks(laid_out, round_index, len(sides), grid, f"sim-{seed}")
        members = np.flatnonzero(present)
        member_ranks = ranks if rerank else ranks[members]
        sizes = moshpit_round(x, members, member_ranks, round_index % len(sides), sides, failure, rng)
        sent += allreduce_bytes(sizes, numel)
        alone, attended = alone + int((present & (sizes == 0)).sum()), attended + int(present.sum())
        error = max_rel_error(x, mean)
        if error <= target:
            return Run(round_index + 1, float(sent.mean()), error, no_group=alone / attended)
    return Run(None, float(sent.mean()), error, no_group=alone / max(1, attended))


def simulate_gossip(peers: int, seed: int, *, fanout: int = Gossip().fanout, dim: int = DIM, numel: int = NUMEL,
                    target: float = TARGET, drop: float = 0.0, activity: float = 1.0,
                    max_rounds: int = MAX_ROUNDS) -> Run:
    """Steps to target, measured after each step's merge (consensus.py measures after ``step()``)."""
    x = initial(peers, seed, dim)
    weights = np.arange(1, peers + 1, dtype=np.float64)  # consensus.py: weight rank + 1
    start_mean = (weights[:, None] * x).sum(axis=0) / weights.sum()
    state, rng = PushSum.start(x, weights), np.random.default_rng((seed, peers, 2))
    sent, error, mean = np.zeros(peers), max_rel_error(x, start_mean), start_mean
    while state.steps.mean() < max_rounds:
        active = rng.random(peers) < activity if activity < 1 else np.ones(peers, dtype=bool)
        sent += gossip_step(state, active, fanout, drop, rng) * push_bytes(numel)
        # after the merge, before the pushes land: the estimates every peer reports from this step
        mean = state.mean() if drop > 0 else start_mean  # lost pushes move the point they agree on
        error = max_rel_error(state.x, mean)
        if error <= target:
            return Run(float(state.steps.mean()), float(sent.mean()), error, _drift(mean, start_mean))
    return Run(None, float(sent.mean()), error, _drift(mean, start_mean))


def _drift(mean: np.ndarray, start: np.ndarray) -> float:
    return float(np.linalg.norm(mean - start) / np.linalg.norm(start))
