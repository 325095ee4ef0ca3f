"""The aggregation rules (averaging/rules/) and clipped gossip's arithmetic (rules/centered_clip.py) against
plain reference implementations written here as numpy loops, on seeded random data, plus their
properties. Tolerance: the torch versions compute in float32 where the references use float64, so
results agree to 1e-5 of the data's scale (2e-5 relative for centered-clip, whose stopping rule
leaves up to TOLERANCE x τ of a step undone)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from swarmgrad.averaging.pushsum import Push, merge
from swarmgrad.averaging.rules import UnknownRule, get_rule
from swarmgrad.averaging.rules import centered_clip as centered_clip_rule
from swarmgrad.averaging.rules.base import Aggregate, bound_weights, median, weighted_mean
from swarmgrad.averaging.rules.centered_clip import (
    REJECT_FACTOR,
    TAU_FACTOR,
    TOLERANCE,
    ClipScale,
    centered_clip,
    choose_tau,
    clip_pushes,
    clip_toward,
    pairwise_distances,
    weighted_medoid,
)
from swarmgrad.averaging.rules.trimmed_mean import trim_for, trimmed_mean

SHAPES = [(1, 7), (2, 5), (3, 40), (4, 300), (5, 64), (7, 129), (16, 33)]


def random_case(seed: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    stack = torch.randn(rows, cols, generator=generator) * 3 + torch.randn(cols, generator=generator)
    weights = torch.rand(rows, generator=generator, dtype=torch.float64) * 9 + 1
    return stack, weights


def aggregate(rule: str, stack: torch.Tensor, weights: torch.Tensor) -> Aggregate:
    return get_rule(rule).aggregate(stack, weights)


# ---- references: one coordinate, one row at a time -------------------------------------------


def ref_median(values: list[float]) -> float:
    ordered, n = sorted(values), len(values)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def ref_distance(a: np.ndarray, b: np.ndarray) -> float:
    return math.sqrt(sum((a[j] - b[j]) ** 2 for j in range(len(a))))


def ref_weighted_medoid(x: np.ndarray, w: np.ndarray) -> int:
    costs = [sum(w[j] * ref_distance(x[i], x[j]) for j in range(len(x))) for i in range(len(x))]
    return min(range(len(x)), key=lambda i: (costs[i], i))


def ref_centered_clip(x: np.ndarray, w: np.ndarray, tau: float, start: np.ndarray) -> np.ndarray:
    v = start.copy()
    for _ in range(10_000):
        step = np.zeros_like(v)
        for i in range(len(x)):
            distance = math.sqrt(sum((x[i, j] - v[j]) ** 2 for j in range(len(v))))
            factor = 1.0 if distance == 0 else min(1.0, tau / distance)
            step += w[i] / w.sum() * (x[i] - v) * factor
        v = v + step
        if np.linalg.norm(step) <= 1e-12 * max(tau, 1e-300):
            break
    return v


def ref_robust_centered_clip(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """robust_aggregate's centered-clip: from the medoid with τ by the rule, then, while fewer than
    half the rows lie over REJECT_FACTOR x τ from the result, on from there without them."""
    start = x[ref_weighted_medoid(x, w)]
    tau = TAU_FACTOR * ref_median([ref_distance(row, start) for row in x])
    v = ref_centered_clip(x, w, tau, start)
    far = [i for i in range(len(x)) if ref_distance(x[i], v) > REJECT_FACTOR * tau]
    if not far or len(far) >= len(x) / 2:
        return v, []
    kept = [i for i in range(len(x)) if i not in far]
    return ref_centered_clip(x[kept], w[kept], tau, v), far


def ref_trimmed_mean(x: np.ndarray, w: np.ndarray, trim: int) -> np.ndarray:
    out = np.empty(x.shape[1])
    for j in range(x.shape[1]):
        pairs = sorted(zip(x[:, j], w))  # by value, ties by weight
        kept = pairs[trim : len(pairs) - trim]
        out[j] = sum(value * weight for value, weight in kept) / sum(weight for _, weight in kept)
    return out


def ref_weighted_mean(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return sum(w[i] * x[i] for i in range(len(x))) / w.sum()


def close(actual: torch.Tensor, expected: np.ndarray, scale: float, rel: float = 1e-5) -> None:
    np.testing.assert_allclose(actual.double().numpy(), expected, rtol=0, atol=rel * scale)


# ---- against the references ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_weighted_medoid_and_mean_match_the_reference(seed, rows, cols):
    stack, weights = random_case(seed, rows, cols)
    x, w = stack.double().numpy(), weights.numpy()
    assert weighted_medoid(stack, weights) == ref_weighted_medoid(x, w)
    close(weighted_mean(stack, weights), ref_weighted_mean(x, w), float(stack.abs().max()))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("tau_scale", [0.3, 1.0, 3.0])
def test_centered_clip_matches_the_reference(seed, rows, cols, tau_scale):
    stack, weights = random_case(seed, rows, cols)
    x, w = stack.double().numpy(), weights.numpy()
    start = stack[weighted_medoid(stack, weights)]
    tau = tau_scale * float(np.median(np.linalg.norm(x - start.double().numpy(), axis=1))) + 1e-3
    got = centered_clip(stack, weights, tau, tol=1e-7, max_iters=2000, start=start)
    close(got, ref_centered_clip(x, w, tau, start.double().numpy()), float(stack.abs().max()), rel=2e-5)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rows, cols", [(3, 40), (5, 64), (7, 129), (8, 300), (16, 33)])
@pytest.mark.parametrize("liars", [0, 1, 2, 4, 8])
def test_centered_clip_with_rejection_matches_the_reference(seed, rows, cols, liars):
    """robust_aggregate's whole rule (medoid, τ, clip, reject, clip again) against the reference,
    with ``liars`` rows (as many as there are) sign-flipped x10: rejected while they are a minority."""
    stack, weights = random_case(seed, rows, cols)
    stack[: min(liars, rows)] *= -10
    expected, far = ref_robust_centered_clip(stack.double().numpy(), weights.numpy())
    outcome = aggregate("centered-clip", stack, weights)
    close(outcome.value, expected, float(stack.abs().max()), rel=2e-5)
    assert outcome.rejected == far and not set(far) & set(outcome.clipped)
    assert len(far) < rows / 2
    if 0 < liars < rows / 2:  # a minority of liars that far is left out, and only they are
        assert far == list(range(liars))


@pytest.mark.parametrize("seed", range(4))
def test_two_sign_flipped_rows_of_eight_are_rejected_where_clipping_alone_lets_them_pull(seed, monkeypatch):
    """Honest rows u + noise with the noise larger than the update u (DiLoCo pseudo-gradients of
    peers on different shards), two rows -10 x their own: the result stays by u (bias along -u under
    a tenth of ||u||) where clipping alone loses most of u (its τ comes from the noise)."""
    generator = torch.Generator().manual_seed(seed)
    update = torch.randn(20_000, generator=generator)
    stack = update + 3 * torch.randn(8, 20_000, generator=generator)
    stack[:2] *= -10
    weights = torch.ones(8, dtype=torch.float64)
    honest_mean = stack[2:].mean(dim=0)

    def along_update(value: torch.Tensor) -> float:
        return float((value - honest_mean) @ update / update.norm() ** 2)  # in units of ||u||

    outcome = aggregate("centered-clip", stack, weights)
    assert outcome.rejected == [0, 1] and outcome.clipped == []
    assert abs(along_update(outcome.value)) < 0.1
    monkeypatch.setattr(centered_clip_rule, "REJECT_FACTOR", math.inf)  # clipping alone: each liar pulls τ / 8
    clipped = aggregate("centered-clip", stack, weights)
    assert clipped.rejected == [] and clipped.clipped == [0, 1] and along_update(clipped.value) < -0.5


def test_a_row_within_the_rejection_radius_is_clipped_not_rejected():
    # the medoid is the origin, τ = 1.5 x the median distance from it (1): 1.5
    stack = torch.tensor([[0.0, 0.0], [-1.0, 0.0], [1.0, 0.0], [0.0, -1.0], [0.0, 1.0], [4.0, 0.0]])
    ones = torch.ones(6, dtype=torch.float64)
    outcome = aggregate("centered-clip", stack, ones)
    assert outcome.clipped == [5] and outcome.rejected == [] and 1 < outcome.reach[5] < REJECT_FACTOR
    stack[5] = torch.tensor([100.0, 0.0])
    outcome = aggregate("centered-clip", stack, ones)
    assert outcome.rejected == [5] and outcome.clipped == [] and outcome.reach[5] > 40
    torch.testing.assert_close(outcome.value, torch.zeros(2))  # without it: the honest rows' own result


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_trimmed_mean_matches_the_reference(seed, rows, cols):
    stack, weights = random_case(seed, rows, cols)
    x, w = stack.double().numpy(), weights.numpy()
    for trim in range((rows - 1) // 2 + 1):
        close(trimmed_mean(stack, weights, trim), ref_trimmed_mean(x, w, trim), float(stack.abs().max()))


def test_centered_clip_matches_the_reference_at_small_scales():
    """τ below 1 (values of a hundredth): the iteration still runs, as the reference's."""
    stack, weights = random_case(7, 5, 30)
    stack *= 0.01
    start = stack[weighted_medoid(stack, weights)]
    tau = choose_tau(stack, start)
    assert 0 < tau < 1
    got = centered_clip(stack, weights, tau, tol=1e-7, max_iters=2000, start=start)
    close(got, ref_centered_clip(stack.double().numpy(), weights.numpy(), tau, start.double().numpy()),
          float(stack.abs().max()), rel=2e-5)
    assert not torch.equal(got, start)


def test_pairwise_distances_match_the_reference_for_many_close_rows_and_huge_ones():
    """Many rows (more than cdist's 25 before it would switch to a Gram matrix that cancels for
    close rows), rows near float32's range, and no rows at all."""
    generator = torch.Generator().manual_seed(8)
    close_rows = 1000 + 1e-3 * torch.randn(30, 64, generator=generator)
    huge = torch.tensor([[3e38, -3e38, 1.0], [-3e38, 3e38, 2.0], [1.0, 2.0, 3.0]])
    large = torch.full((2, 4096), 1e18)  # finite differences whose squares add up past float32's range
    large[1] *= -1
    for stack in (close_rows, huge, large):
        x = stack.double().numpy()
        want = np.array([[ref_distance(a, b) for b in x] for a in x])
        np.testing.assert_allclose(pairwise_distances(stack).numpy(), want, rtol=1e-3, atol=1e-9)
    assert pairwise_distances(torch.zeros(0, 3)).shape == (0, 0)


def test_trimmed_mean_breaks_ties_by_weight_whatever_the_row_order():
    stack = torch.tensor([[0.0], [0.0], [5.0], [9.0]])
    weights = torch.tensor([1.0, 3.0, 1.0, 1.0], dtype=torch.float64)
    want = ref_trimmed_mean(stack.double().numpy(), weights.numpy(), 1)  # drops the lighter 0 and the 9
    for order in ([0, 1, 2, 3], [1, 0, 3, 2], [3, 2, 1, 0]):
        close(trimmed_mean(stack[order], weights[order], 1), want, 1.0)
    assert float(trimmed_mean(stack, weights, 1)) == pytest.approx(5 / 4)


def test_trimmed_mean_of_many_tied_values_drops_the_lightest_and_heaviest_ties():
    """Forty rows of 0s and 1s (torch sorts that many rows in another order unless asked to keep it)."""
    generator = torch.Generator().manual_seed(10)
    stack = torch.randint(0, 2, (40, 50), generator=generator).float()
    weights = torch.randperm(40, generator=generator).double() + 1  # distinct: ties of value, not of pairs
    close(trimmed_mean(stack, weights, 10), ref_trimmed_mean(stack.double().numpy(), weights.numpy(), 10), 1.0)


def test_tau_weights_and_the_trim_follow_their_rules():
    stack, weights = random_case(4, 5, 50)
    start = stack[weighted_medoid(stack, weights)]
    distances = [float(np.linalg.norm(row)) for row in (stack - start).double().numpy()]
    assert choose_tau(stack, start) == pytest.approx(TAU_FACTOR * ref_median(distances))
    assert choose_tau(stack, start, factor=3.0) == pytest.approx(3.0 * ref_median(distances))
    claims = torch.tensor([1.0, 2.0, 3.0, 1e9], dtype=torch.float64)
    assert bound_weights(claims).tolist() == [1.0, 2.0, 3.0, 5.0]  # 2 x the median (2.5)
    assert bound_weights(claims, cap=2.5).tolist() == [1.0, 2.0, 2.5, 2.5]
    assert bound_weights(claims, cap=100.0, factor=None).tolist() == [1.0, 2.0, 3.0, 100.0]
    assert bound_weights(torch.tensor([1.0, 1e9], dtype=torch.float64)).tolist() == [1.0, 1e9]  # no majority of two
    assert [trim_for(n) for n in (1, 2, 3, 4, 7, 8, 16)] == [0, 0, 1, 1, 1, 2, 4]


# ---- properties --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rows", [3, 4, 6, 9])
def test_one_outlier_scaled_by_a_million_moves_centered_clip_by_at_most_tau(seed, rows):
    stack, weights = random_case(seed, rows, 200)
    weights = bound_weights(weights)
    honest_result = aggregate("centered-clip", stack[1:], weights[1:]).value
    attacked = stack.clone()
    attacked[0] *= 1e6
    outcome = aggregate("centered-clip", attacked, weights)
    tau = choose_tau(attacked, attacked[weighted_medoid(attacked, weights)])
    assert outcome.rejected == [0] and 0 not in outcome.clipped  # the outlier was left out, and it is named
    assert outcome.reach[0] > 1e5
    assert float((outcome.value - honest_result).norm()) <= 1.05 * tau
    assert float((weighted_mean(attacked, weights) - honest_result).norm()) > 1e3 * tau  # the mean is gone
    trimmed = trimmed_mean(attacked, weights, trim_for(rows))
    spread = float((stack[1:] - honest_result).abs().max())
    assert float((trimmed - honest_result).abs().max()) <= 2 * spread  # within the honest values' range


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_without_outliers_and_a_generous_tau_centered_clip_is_the_weighted_mean(seed, rows, cols):
    stack, weights = random_case(seed, rows, cols)
    mean = weighted_mean(stack, weights)
    generous = 2 * float((stack - mean).norm(dim=1).max()) + 1.0
    close(centered_clip(stack, weights, generous), ref_weighted_mean(stack.double().numpy(), weights.numpy()),
          float(stack.abs().max()))


@pytest.mark.parametrize("seed", range(4))
def test_the_rule_keeps_honest_high_dimensional_rows_unclipped(seed):
    """Rows of a chunk-sized vector around a common mean sit at about the same distance from the
    median: τ = 1.5 x that distance clips none, so centered-clip is then the weighted mean."""
    stack, weights = random_case(seed, 6, 20_000)
    outcome = aggregate("centered-clip", stack, weights)
    assert outcome.clipped == []
    close(outcome.value, ref_weighted_mean(stack.double().numpy(), weights.numpy()), float(stack.abs().max()))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("aggregator", ["mean", "centered-clip", "trimmed-mean"])
def test_aggregates_do_not_depend_on_the_order_of_the_rows(seed, aggregator):
    stack, weights = random_case(seed, 7, 90)
    stack[2] *= 1e4  # with an outlier, so that clipping and trimming are at work
    order = torch.randperm(7, generator=torch.Generator().manual_seed(seed))
    first = aggregate(aggregator, stack, weights)
    second = aggregate(aggregator, stack[order], weights[order])
    if aggregator == "mean":
        torch.testing.assert_close(first.value, weighted_mean(stack, weights))
    torch.testing.assert_close(first.value, second.value, rtol=0, atol=1e-4 * float(stack[order[0]].abs().max()))
    assert sorted(int(order[i]) for i in second.clipped) == first.clipped


def test_small_groups():
    stack, weights = random_case(9, 3, 30)
    uneven = torch.tensor([1.0, 9.0], dtype=torch.float64)  # two rows are the weighted mean, however uneven
    torch.testing.assert_close(aggregate("centered-clip", stack[:2], uneven).value, weighted_mean(stack[:2], uneven))
    one = aggregate("centered-clip", stack[:1], weights[:1])
    assert torch.equal(one.value, stack[0])
    liar = stack[:2].clone()
    liar[1] *= 1e6
    for aggregator in ("centered-clip", "trimmed-mean"):  # two rows cannot out-vote a liar: the weighted mean
        two = aggregate(aggregator, liar, weights[:2])
        torch.testing.assert_close(two.value, weighted_mean(liar, weights[:2]))
    three = aggregate("trimmed-mean", stack, torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(three.value, stack.median(dim=0).values)  # one dropped at each end


def test_coinciding_rows_and_a_zero_tau():
    rows = torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [40.0, -7.0]])
    outcome = aggregate("centered-clip", rows, torch.ones(4, dtype=torch.float64))
    assert torch.equal(outcome.value, rows[0]) and outcome.clipped == []  # half coincide: τ = 0, nobody suspected
    start = torch.tensor([5.0, 5.0])
    assert torch.equal(centered_clip(rows, torch.ones(4, dtype=torch.float64), 0.0, start=start), start)


def test_values_at_the_edge_of_float32_are_clipped_as_in_float64():
    """Two liars near float32's largest values (their differences overflow float32) among three
    honest rows: the result is the float64 reference's, near the honest rows."""
    stack = torch.tensor([[3e38, -3e38], [-3e38, 3e38], [1.0, 1.0], [2.0, 2.0], [1.5, 1.0]])
    weights = torch.ones(5, dtype=torch.float64)
    expected, far = ref_robust_centered_clip(stack.double().numpy(), weights.numpy())
    outcome = aggregate("centered-clip", stack, weights)
    close(outcome.value, expected, 1.0, rel=1e-4)
    assert outcome.rejected == far == [0, 1] and float(outcome.value.abs().max()) < 3
    assert bool(torch.isfinite(aggregate("trimmed-mean", stack, weights).value).all())


def test_centered_clip_from_a_far_start_measures_overflowing_differences_in_float64():
    stack = torch.tensor([[3.3e38, -3.3e38], [-3.3e38, 3.3e38], [1.0, 1.0], [2.0, 2.0], [1.5, 1.0]])
    weights = torch.ones(5, dtype=torch.float64)
    x = stack.double().numpy()
    for tau in (1.0, 1e38):
        got = centered_clip(stack, weights, tau, tol=1e-9, max_iters=500, start=stack[1])  # x_0 - start overflows
        close(got, ref_centered_clip(x, weights.numpy(), tau, x[1]), max(tau, 1.0), rel=1e-4)


def test_clip_toward_moves_by_tau_whatever_the_magnitude():
    for here, there in ((torch.tensor([-3e38, 3e38]), torch.tensor([3e38, -3e38])),  # the change overflows
                        (torch.tensor([0.0, 0.0]), torch.tensor([1e20, 1e20]))):  # its float32 norm would
        moved = clip_toward(here, there, 1e18)
        assert moved.dtype == torch.float32
        distance = float((moved.double() - here.double()).norm())
        assert distance == pytest.approx(1e18, rel=1e-3) or (here.abs().max() > 1e38 and distance <= 1e32)
    torch.testing.assert_close(clip_toward(torch.zeros(2), torch.tensor([3e19, 4e19]), 5.0), torch.tensor([3.0, 4.0]))


def test_centered_clip_stops_at_its_tolerance():
    stack, weights = random_case(3, 5, 40)
    stack[0] *= 1e3
    start = stack[weighted_medoid(stack, weights)]
    tau = choose_tau(stack, start)
    loose = centered_clip(stack, weights, tau, start=start)
    exact = torch.tensor(ref_centered_clip(stack.double().numpy(), weights.numpy(), tau, start.double().numpy()))
    # the undone rest is a geometric tail of steps below TOLERANCE x τ (contraction of about 1/2)
    assert float((loose.double() - exact).norm()) <= 4 * TOLERANCE * tau
    assert not torch.equal(centered_clip(stack, weights, tau, max_iters=1, start=start), loose)
    coarse = centered_clip(stack, weights, tau, tol=0.05, start=start)  # stops within 5% of τ per step, earlier
    assert 1e-6 * tau < float((coarse.double() - exact).norm()) <= 4 * 0.05 * tau


def test_an_unknown_aggregator_is_refused():
    with pytest.raises(UnknownRule, match="^unknown aggregator 'krum'; use one of centered-clip, mean, "):
        aggregate("krum", torch.zeros(3, 2), torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="cannot trim 2 of 4"):
        trimmed_mean(torch.zeros(4, 2), torch.ones(4, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="^the median of nothing$"):
        median(torch.zeros(0))
    with pytest.raises(ValueError, match="max_iters must be at least 1, got 0"):
        centered_clip(torch.zeros(3, 2), torch.ones(3, dtype=torch.float64), 1.0, max_iters=0)


# ---- clipped gossip ----------------------------------------------------------------------------


def test_clip_toward_moves_at_most_tau_along_the_line():
    generator = torch.Generator().manual_seed(5)
    here, there = torch.randn(100, generator=generator), torch.randn(100, generator=generator) * 50
    moved = clip_toward(here, there, 2.0)
    assert float((moved - here).norm()) == pytest.approx(2.0, rel=1e-5)
    direction = (there - here) / (there - here).norm()
    torch.testing.assert_close((moved - here) / 2.0, direction, rtol=0, atol=1e-5)
    assert torch.equal(clip_toward(here, here + 0.001, 2.0), here + 0.001)  # within τ: unchanged


def test_clip_scale_is_the_lower_median_of_each_senders_latest_distance():
    scale = ClipScale(window=3)
    assert scale.tau({}) == math.inf  # nothing known yet
    assert scale.tau({"a": 2.0}) == pytest.approx(TAU_FACTOR * 2.0)  # a first push is its own scale
    assert scale.tau({"liar": 1e9}) == pytest.approx(TAU_FACTOR * 2.0)  # lower median of [2, 1e9]
    assert scale.tau({"liar": 1e12}) == pytest.approx(TAU_FACTOR * 2.0)  # pushing often counts once
    assert scale.tau({"b": 4.0, "c": 6.0}) == pytest.approx(TAU_FACTOR * 6.0)  # of [4, 6, 1e12]: "a" is forgotten
    assert list(scale.latest) == ["liar", "b", "c"]


def test_one_push_moves_a_peer_by_at_most_its_share_of_tau():
    generator = torch.Generator().manual_seed(6)
    values = torch.randn(500, generator=generator)
    scale = ClipScale()
    honest = [Push(1.0, values + 0.1 * torch.randn(500, generator=generator), sender=f"h{i}") for i in range(3)]
    clip_pushes(values, honest, scale)  # history: three honest senders
    liar = Push(5.0, values * 1e6, sender="liar")
    pushes, clipped = clip_pushes(values, [liar, *honest], scale)
    tau = TAU_FACTOR * sorted(scale.latest.values())[1]
    assert clipped == [0] and float((pushes[0].values - values).norm()) == pytest.approx(tau, rel=1e-4)
    assert all(push is original for push, original in zip(pushes[1:], honest))  # honest pushes untouched
    merged = values.clone()
    weight = merge(merged, 2.0, pushes)  # each push moves it by its share w_k / W of at most τ
    assert float((merged - values).norm()) <= tau * (weight - 2.0) / weight + 1e-4
    unclipped = values.clone()
    merge(unclipped, 2.0, [liar, *honest])
    assert float((unclipped - values).norm()) > 1e4 * tau


def test_clip_pushes_measures_each_push_from_here_and_counts_a_sender_once():
    values = torch.full((4,), 5.0)
    scale = ClipScale()
    pushes = [Push(1.0, values + torch.tensor([2.0, 0, 0, 0]), sender="a"),
              Push(1.0, values + torch.tensor([0, 3.0, 0, 0]), sender="b"),
              Push(1.0, values + torch.tensor([0, 0, 0.5, 0]), sender="b"),
              Push(1.0, values + torch.tensor([0, 0, 0, 0.25]), sender="c")]
    kept, clipped = clip_pushes(values, pushes, scale)
    assert scale.latest == {"a": 2.0, "b": 3.0, "c": 0.25}  # distances from here; b's farthest push
    assert clipped == [] and all(k is p for k, p in zip(kept, pushes))  # b at exactly τ = 1.5 x 2 is not cut
    liar = Push(1.0, values + 1e20, sender="liar")
    honest = [Push(1.0, values + 2e19 * torch.tensor([1.0, 0, 0, 0]), sender=name) for name in ("c", "d")]
    kept, clipped = clip_pushes(values, [liar, *honest], ClipScale())  # every float32 norm here would overflow
    assert clipped == [0] and kept[0].sender == "liar"
    assert float((kept[0].values.double() - values.double()).norm()) == pytest.approx(TAU_FACTOR * 2e19, rel=1e-4)


def test_clip_scale_remembers_the_most_recent_senders():
    scale = ClipScale(window=3)
    for sender in ("a", "b", "a", "c", "d"):  # a pushed again after b: b is the oldest when d comes
        scale.tau({sender: 1.0})
    assert list(scale.latest) == ["a", "c", "d"]


def test_sparse_pushes_are_clipped_on_their_coordinates():
    values = torch.zeros(10)
    scale = ClipScale()
    scale.tau({"a": 1.0, "b": 1.0})
    push = Push(torch.ones(3), torch.tensor([100.0, 0.0, 0.0]), torch.tensor([1, 4, 7]), "liar")
    (clipped_push,), clipped = clip_pushes(values, [push], scale)
    assert clipped == [0] and torch.equal(clipped_push.indices, push.indices)
    torch.testing.assert_close(clipped_push.values, torch.tensor([TAU_FACTOR, 0.0, 0.0]))
