"""Robust aggregation: what a part's owner makes of the contributions it received when any of them
may lie (BTARD, arXiv 2106.11257; CenteredClip from Karimireddy et al., arXiv 2012.10333). Pure
functions: a stack of contributions (one row each, float32) and their sample weights in, a tensor
out; no I/O, no state. allreduce.py applies them per chunk, gossip.py clips pushes with
``clip_toward``.

The rules (README "Robust aggregation" says the same):

- **centered-clip** starts at the weighted medoid s (the row with the least weighted sum of
  distances to the others: a row far from the rest with less than half the weight never is) and
  takes τ = ``TAU_FACTOR`` x the median of the rows' distances ||x_i - s|| (at least half the rows
  must be far for τ to be large). It then iterates
  v <- v + Σ w_i (x_i - v) min(1, τ / ||x_i - v||) / Σ w_i
  until a step is shorter than ``TOLERANCE`` x τ, or for ``MAX_ITERATIONS`` steps. A row pulls the
  result by at most its weight share x τ, whatever it sent; when no row is farther than τ from the
  weighted mean, the result is the weighted mean. Rows then farther than ``REJECT_FACTOR`` x τ
  from the result are *rejected* (while fewer than half the rows are) and the iteration goes on
  from there without them. Honest rows set τ and mostly sit within about τ / 1.5, while a few far
  rows pulling τ every round add up: two sign-flipped rows of eight, only clipped, cost the swarm
  11-14 accuracy points (attack benchmark). Late in training, when most rows nearly coincide (shards
  learnt by heart), honest rows can lie far out too; rejecting one then moves the result by at most
  its share x τ more than clipping it would. A liar that stays within the radius still moves the
  result by at most its share x τ. When half the rows coincide (members of an
  earlier group that meet again hold one value) τ is 0 and that value is the result: the data
  cannot tell an honest odd row from a liar there, so repeated averaging of fixed values (a
  consensus) wants ``mean``; fresh contributions every round (DiLoCo, sync) never coincide.
- **trimmed-mean** drops, per coordinate, the ``trim_for(n)`` lowest and highest values (by count,
  so a heavy row is dropped like a light one), then takes the weighted mean of the rest.
- **weights**: each claimed weight is cut to min(cap, ``WEIGHT_FACTOR`` x the median claim);
  ``cap`` comes from the run's settings (peer layer). With factor 2 one peer never holds more
  than half the weight of a group of three or more, the point where centered-clip breaks down.
- **small groups**: one row is its own result. A group of two cannot out-vote a liar (there is no
  majority to keep): ``robust_aggregate`` returns the weighted mean of two rows, and the median
  rule cuts no weight there, so only ``cap`` bounds what a liar claims. Three rows tolerate one
  liar (the trimmed mean is then the median).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarmgrad.averaging.settings import AGGREGATORS

TAU_FACTOR = 1.5  # honest rows of a high-dimensional chunk sit at about the same distance: none is clipped
REJECT_FACTOR = 3.0  # a row this many τ from the result is left out (honest rows: mostly within ~τ / 1.5)
TOLERANCE = 1e-4  # relative to τ: the last step moved the result by less than this fraction of τ
MAX_ITERATIONS = 50  # a step is ~3 passes over the stack; steps shrink about as the clipped weight share
TRIM_FRACTION = 0.25  # share of the rows dropped at each end (at least one from three rows on)
WEIGHT_FACTOR = 2.0


@dataclass
class Aggregate:
    """A chunk's robust result and the rows whose pull it bounded: clipped (farther than τ from the
    result) or rejected (farther than ``REJECT_FACTOR`` x τ: left out), for centered-clip; ``reach``:
    those rows' distance from the result, in τ (what the log shows)."""

    value: torch.Tensor
    clipped: list[int]
    rejected: list[int] = field(default_factory=list)
    reach: dict[int, float] = field(default_factory=dict)


def median(values: torch.Tensor) -> float:
    """The middle of a 1-D tensor (the mean of the two middle values when their number is even)."""
    ordered = values.double().sort().values
    n = len(ordered)
    if n == 0:
        raise ValueError("the median of nothing")
    return float(ordered[n // 2]) if n % 2 else float((ordered[n // 2 - 1] + ordered[n // 2]) / 2)


def weighted_medoid(stack: torch.Tensor, weights: torch.Tensor) -> int:
    """The row whose weighted sum of distances to the rows is least (the first, on a tie)."""
    return _medoid(pairwise_distances(stack), weights)


def _medoid(pairwise: torch.Tensor, weights: torch.Tensor) -> int:
    return int((pairwise * weights.double()).sum(dim=1).argmin())


def pairwise_distances(stack: torch.Tensor) -> torch.Tensor:
    """||x_i - x_j|| for every pair of rows, as float64 n x n (summed in float32; costs about n passes
    over the stack, so the start grows as n^2 per chunk: 6 ms for 4 rows of 1 MiB, 70 ms for 16, here)."""
    pairwise = _cdist(stack)
    if not bool(torch.isfinite(pairwise).all()):  # sums of squares past float32's range: again in float64
        pairwise = _cdist(stack.double())
    return pairwise.double()


def _cdist(rows: torch.Tensor) -> torch.Tensor:
    # never through a Gram matrix (torch's choice past 25 rows): it cancels for rows close to each other
    return torch.cdist(rows, rows, compute_mode="donot_use_mm_for_euclid_dist")


def distances(stack: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
    """||x_i - center|| of every row, accumulated in float64."""
    return _differences(stack, center, torch.empty_like(stack))[1]


def _differences(stack: torch.Tensor, center: torch.Tensor,
                 out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_i - center into ``out``, each row's norm, and each row's scale: ``out[i] * scale[i]`` is the
    difference. The scale is 1 except where a difference passes float32's range (values near 3e38
    on both sides): that row is measured in float64 and stored as a unit vector, its norm as scale."""
    torch.sub(stack, center, out=out)
    norms = torch.linalg.vector_norm(out, dim=1, dtype=torch.float64)
    scales = torch.ones_like(norms)
    for row in torch.nonzero(~torch.isfinite(norms)).flatten().tolist():
        exact = stack[row].double() - center.double()
        norms[row] = scales[row] = torch.linalg.vector_norm(exact)
        out[row] = (exact / norms[row]).to(out.dtype)
    return out, norms, scales


def choose_tau(stack: torch.Tensor, center: torch.Tensor, factor: float = TAU_FACTOR) -> float:
    """τ = ``factor`` x the median distance of the rows from ``center`` (a robust start)."""
    return tau_from(distances(stack, center), factor)


def tau_from(distances_from_start: torch.Tensor, factor: float) -> float:
    """The τ rule on distances already measured from the start."""
    return factor * median(distances_from_start)


def centered_clip(stack: torch.Tensor, weights: torch.Tensor, tau: float, tol: float = TOLERANCE,
                  max_iters: int = MAX_ITERATIONS, start: torch.Tensor | None = None) -> torch.Tensor:
    """CenteredClip: v <- v + Σ w_i (x_i - v) min(1, τ / ||x_i - v||) / Σ w_i from ``start`` (the
    weighted medoid by default), until a step is shorter than ``tol`` x τ or ``max_iters`` steps."""
    start = stack[weighted_medoid(stack, weights)] if start is None else start
    return _centered_clip(stack, weights, tau, tol, max_iters, start)[0]


def _centered_clip(stack: torch.Tensor, weights: torch.Tensor, tau: float, tol: float, max_iters: int,
                   start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The result, and the rows' distances from the center of the last step (for who was clipped)."""
    if max_iters < 1:
        raise ValueError(f"max_iters must be at least 1, got {max_iters}")
    share = weights.double() / weights.sum()
    center = start.clone()
    if tau <= 0:
        return center, distances(stack, center)
    difference = torch.empty_like(stack)
    for _ in range(max_iters):
        _, norms, scales = _differences(stack, center, difference)
        factors = share * (tau / norms).clamp(max=1.0) * scales  # a row at the center: no pull, factor 1
        step = torch.mv(difference.t(), factors.to(stack.dtype))
        center.add_(step)
        if float(torch.linalg.vector_norm(step, dtype=torch.float64)) <= tol * tau:
            break
    return center, norms


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


def weighted_mean(stack: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.mv(stack.t(), (weights.double() / weights.sum()).to(stack.dtype))


def bound_weights(weights: torch.Tensor, cap: float | None = None,
                  factor: float | None = WEIGHT_FACTOR) -> torch.Tensor:
    """Each weight cut to min(``cap``, ``factor`` x the median weight); None leaves that bound out."""
    limit = float("inf") if cap is None else cap
    if factor is not None and len(weights):
        limit = min(limit, factor * median(weights))
    return weights.double().clamp(max=limit)


def robust_aggregate(aggregator: str, stack: torch.Tensor, weights: torch.Tensor) -> Aggregate:
    """One chunk's result under ``aggregator`` (weights already bounded); two rows or fewer: their weighted mean."""
    if aggregator not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {aggregator!r}; use one of {', '.join(AGGREGATORS)}")
    if aggregator == "mean" or len(stack) <= 2:
        return Aggregate(weighted_mean(stack, weights), [])
    if aggregator == "centered-clip":  # from the medoid: the pairwise distances give it and τ in one go
        pairwise = pairwise_distances(stack)
        medoid = _medoid(pairwise, weights)
        tau = tau_from(pairwise[medoid], TAU_FACTOR)
        value, last = _centered_clip(stack, weights, tau, TOLERANCE, MAX_ITERATIONS, stack[medoid])
        if tau <= 0:  # half the rows coincide: the data cannot tell an honest odd row from a liar (peers
            return Aggregate(value, [])  # on the same data and state send equal rows): nobody is suspected
        far = last > REJECT_FACTOR * tau
        if 0 < int(far.sum()) < len(stack) / 2:  # a majority stays: go on from here without the far rows
            value, _ = _centered_clip(stack[~far], weights[~far], tau, TOLERANCE, MAX_ITERATIONS, value)
            last = distances(stack, value)
        else:
            far = torch.zeros_like(far)
        # the rows beyond τ in the last step (it moved the result by less than TOLERANCE x τ)
        rejected = [int(i) for i in torch.nonzero(far).flatten()]
        clipped = [int(i) for i in torch.nonzero((last > tau) & ~far).flatten()]
        reach = {row: float(last[row]) / tau for row in rejected + clipped}
        return Aggregate(value, clipped, rejected, reach)
    return Aggregate(trimmed_mean(stack, weights, trim_for(len(stack))), [])


def clip_toward(current: torch.Tensor, target: torch.Tensor, tau: float) -> torch.Tensor:
    """The point on the way from ``current`` to ``target`` at most τ from ``current`` (a new tensor):
    current + (target - current) min(1, τ / ||target - current||)."""
    change = target - current
    norm = float(torch.linalg.vector_norm(change, dtype=torch.float64))
    if norm <= tau:
        return change.add_(current)
    if not torch.isfinite(change).all():  # past float32's range: scale it down in float64
        exact = target.double() - current.double()
        return exact.mul_(tau / float(torch.linalg.vector_norm(exact))).add_(current).to(current.dtype)
    return change.mul_(tau / norm).add_(current)
