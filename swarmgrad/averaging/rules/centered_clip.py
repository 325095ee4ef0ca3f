"""centered-clip (CenteredClip from Karimireddy et al., arXiv 2012.10333, as BTARD uses it, arXiv
2106.11257), and its gossip form, clipped gossip (ClippedGossip, arXiv 2202.01545).

A part's owner starts at the weighted medoid s (the row with the least weighted sum of distances to
the others: a row far from the rest with less than half the weight never is) and takes τ =
``TAU_FACTOR`` x the median of the rows' distances ||x_i - s|| (at least half the rows must be far
for τ to be large). It then iterates
  v <- v + Σ w_i (x_i - v) min(1, τ / ||x_i - v||) / Σ w_i
until a step is shorter than ``TOLERANCE`` x τ, or for ``MAX_ITERATIONS`` steps (on the coefficients of
the rows, through their Gram matrix: ``_in_span``; a step costs no pass over them). A row pulls the
result by at most its weight share x τ, whatever it sent; when no row is farther than τ from the
weighted mean, the result is the weighted mean. Rows then farther than ``REJECT_FACTOR`` x τ from
the result are *rejected* (while fewer than half the rows are) and the iteration goes on from there
without them. Honest rows set τ and mostly sit within about τ / 1.5, while a few far rows pulling τ
every round add up: two sign-flipped rows of eight, only clipped, cost the swarm 11-14 accuracy
points (attack benchmark). Late in training, when most rows nearly coincide (shards learnt by
heart), honest rows can lie far out too; rejecting one then moves the result by at most its share x
τ more than clipping it would. A liar that stays within the radius still moves the result by at
most its share x τ. When half the rows coincide (members of an earlier group that meet again hold
one value) τ is 0 and that value is the result: the data cannot tell an honest odd row from a liar
there, so repeated averaging of fixed values (a consensus) wants ``mean``; fresh contributions
every round (DiLoCo, sync) never coincide.

Clipped gossip (x_i <- x_i + Σ_j w_ij clip(x_j - x_i, τ_i)): ``clip_pushes`` replaces each push's
estimate x_k by x + clip(x_k - x, τ) before the merge, so one push moves a peer by at most its share
w_k / W of τ. ``ClipScale`` chooses τ: ``TAU_FACTOR`` x the lower median, over the last
``CLIP_WINDOW`` senders, of each one's latest distance ||x_k - x|| (this merge's included). One
entry per sender, so a liar that pushes often still counts once, and the lower median holds while
at most half the senders lie. A clipped push drops the mass of what was cut, as in ClippedGossip:
exact conservation is traded for a bound on any one push. A peer's first merge has no history: its
τ comes from that merge's pushes alone. Clipping comes after decoding and after the sender's
privacy noise, so it composes with every codec and with privacy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from swarmgrad.averaging.pushsum import Push
from swarmgrad.averaging.rules.base import Aggregate, GossipForm, Rule, median

TAU_FACTOR = 1.5  # honest rows of a high-dimensional chunk sit at about the same distance: none is clipped
REJECT_FACTOR = 3.0  # a row this many τ from the result is left out (honest rows: mostly within ~τ / 1.5)
TOLERANCE = 1e-4  # relative to τ: the last step moved the result by less than this fraction of τ
MAX_ITERATIONS = 50  # steps shrink about as the clipped weight share (each on the n x n Gram matrix: _in_span)
CLIP_WINDOW = 16  # senders remembered: more than a peer's in-neighbours on the exponential graph of 2^16 peers


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
    """||x_i - center|| of every row, as float64 (``_differences``)."""
    return _differences(stack, center, torch.empty_like(stack))[1]


def _differences(stack: torch.Tensor, center: torch.Tensor,
                 out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_i - center into ``out``, each row's norm, and each row's scale: ``out[i] * scale[i]`` is the
    difference. The scale is 1 except where a difference passes float32's range (values near 3e38
    on both sides): that row is measured in float64 and stored as a unit vector, its norm as scale.
    Norms are summed in float32 (torch's cascade sum: within 2e-6 of float64's at 262,144 elements),
    as the pairwise distances are: in float64 they were half of every iteration's time (1.0 of 1.9 ms
    on 3 rows of 262,144), the loop where a profile of q2 rounds of three at 201M found most samples."""
    torch.sub(stack, center, out=out)
    norms = torch.linalg.vector_norm(out, dim=1).double()
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
    if tau <= 0:
        return start.clone(), distances(stack, start)
    in_span = _in_span(stack, share, tau, tol, max_iters, start)
    if in_span is not None:
        return in_span
    center = start.clone()
    difference = torch.empty_like(stack)
    for _ in range(max_iters):
        _, norms, scales = _differences(stack, center, difference)
        factors = share * (tau / norms).clamp(max=1.0) * scales  # a row at the center: no pull, factor 1
        step = torch.mv(difference.t(), factors.to(stack.dtype))
        center.add_(step)
        moved = float(torch.linalg.vector_norm(step))
        if not math.isfinite(moved):  # past float32's range: measured again in float64
            moved = float(torch.linalg.vector_norm(step, dtype=torch.float64))
        if moved <= tol * tau:
            break
    return center, norms


def _in_span(stack: torch.Tensor, share: torch.Tensor, tau: float, tol: float, max_iters: int,
             start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The same iteration on coefficients: every step adds a combination of the rows less the
    center, so the center stays start + Σ b_i y_i with y_i = x_i - start, and with the Gram matrix G
    of the y_i (float64) ||x_i - v||² = G_ii - 2 (G b)_i + bᵀ G b and the step is Δb = f - (Σ f) b.
    Two passes over the rows (the differences, G) and one for the result, however many steps: the
    whole rule on 3 rows of 262,144 elements (one thread) took 5-6 ms a chunk, 15.5 with a clipped row
    (9 steps), stepping on the rows themselves; 4.6-6 ms either way this way. None where a
    difference or G is not finite (rows near float32's range): the caller steps
    on the rows themselves then. Distances that cancel (a row close to the center, far from the
    start) are off by about 1e-8 of the rows' spread: such a row is within τ, pulled in full either way."""
    differences = stack - start
    exact = differences.double()
    gram = torch.mm(exact, exact.t())
    del exact
    if not bool(torch.isfinite(gram).all()):
        return None
    diagonal = gram.diagonal()
    coefficients = torch.zeros(len(stack), dtype=torch.float64)
    for _ in range(max_iters):
        along = gram @ coefficients
        norms = (diagonal - 2 * along + coefficients @ along).clamp(min=0).sqrt()
        factors = share * (tau / norms).clamp(max=1.0)  # a row at the center: no pull, factor 1
        step = factors - factors.sum() * coefficients
        coefficients += step
        moved = math.sqrt(max(0.0, float(step @ (gram @ step))))
        if moved <= tol * tau:
            break
    center = torch.addmv(start, differences.t(), coefficients.to(stack.dtype))
    return center, norms


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


class CenteredClip(Rule):
    name = "centered-clip"

    def combine(self, rows: torch.Tensor, weights: torch.Tensor) -> Aggregate:
        # from the medoid: the pairwise distances give it and τ in one go
        pairwise = pairwise_distances(rows)
        medoid = _medoid(pairwise, weights)
        tau = tau_from(pairwise[medoid], TAU_FACTOR)
        value, last = _centered_clip(rows, weights, tau, TOLERANCE, MAX_ITERATIONS, rows[medoid])
        if tau <= 0:  # half the rows coincide: the data cannot tell an honest odd row from a liar (peers
            return Aggregate(value)  # on the same data and state send equal rows): nobody is suspected
        far = last > REJECT_FACTOR * tau
        if 0 < int(far.sum()) < len(rows) / 2:  # a majority stays: go on from here without the far rows
            value, _ = _centered_clip(rows[~far], weights[~far], tau, TOLERANCE, MAX_ITERATIONS, value)
            last = distances(rows, value)
        else:
            far = torch.zeros_like(far)
        # the rows beyond τ in the last step (it moved the result by less than TOLERANCE x τ)
        rejected = [int(i) for i in torch.nonzero(far).flatten()]
        clipped = [int(i) for i in torch.nonzero((last > tau) & ~far).flatten()]
        reach = {row: float(last[row]) / tau for row in rejected + clipped}
        return Aggregate(value, clipped, rejected, reach)

    def gossip(self) -> GossipForm:
        return ClippedGossip()


class ClippedGossip(GossipForm):
    """No push moves this peer by more than τ (``clip_pushes``)."""

    def __init__(self) -> None:
        self.scale = ClipScale()

    def admit(self, values: torch.Tensor, pushes: list[Push]) -> tuple[list[Push], list[int]]:
        return clip_pushes(values, pushes, self.scale)


RULE = CenteredClip()
