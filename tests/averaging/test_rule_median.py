"""The coordinate-wise median rule (averaging/rules/median.py): against a reference written here as a
loop over one coordinate, against outliers (where the mean gives way), through the registry and the
run configuration, and in one real moshpit round (p2pd daemons, DHT matchmaking, the direct plane)
where two of five peers lie."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import numpy as np
import pytest
import torch
from conftest import run_async
from test_robust_averaging import NUMEL, ScalingLiar, peer_tensors, start_runtimes

from swarmgrad.averaging import Aggregation, Averager, Moshpit
from swarmgrad.averaging.rules import RULE_NAMES, get_rule
from swarmgrad.averaging.rules.base import weighted_mean
from swarmgrad.errors import ConfigError
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.strategies.gossip import GossipSGD

MEDIAN = get_rule("median")


def ref_weighted_median(column: list[float], weights: list[float]) -> float:
    """The smallest value with at least half the weight up to it, and the smallest with more than half,
    averaged."""
    pairs = sorted(zip(column, weights))
    total, seen, low, high = sum(weights), 0.0, None, None
    for value, weight in pairs:
        seen += weight
        if low is None and seen >= total / 2:
            low = value
        if high is None and seen > total / 2:
            high = value
    return (low + high) / 2


def random_case(seed: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    stack = torch.randn(rows, cols, generator=generator) * 3 + torch.randn(cols, generator=generator)
    weights = torch.randint(1, 5, (rows,), generator=generator).double()  # small integers: ties at half occur
    return stack, weights


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rows", [3, 4, 5, 8, 13])
def test_the_median_matches_the_reference(seed, rows):
    stack, weights = random_case(seed, rows, 50)
    got = MEDIAN.aggregate(stack, weights)
    expected = [ref_weighted_median(stack[:, j].tolist(), weights.tolist()) for j in range(stack.shape[1])]
    np.testing.assert_allclose(got.value.numpy(), expected, rtol=1e-6, atol=1e-6)
    assert got.clipped == [] and got.rejected == []  # nobody is suspected: the median names no row
    equal = MEDIAN.aggregate(stack, torch.ones(rows, dtype=torch.float64)).value
    torch.testing.assert_close(equal, stack.double().quantile(0.5, dim=0).float())  # equal weights: the usual median


def test_the_median_does_not_depend_on_the_order_of_the_rows():
    stack, weights = random_case(7, 9, 200)
    stack[3] = stack[5]  # equal rows of different weight: ties broken by weight
    order = torch.randperm(9, generator=torch.Generator().manual_seed(7))
    assert torch.equal(MEDIAN.aggregate(stack, weights).value, MEDIAN.aggregate(stack[order], weights[order]).value)


def test_a_minority_of_outliers_moves_the_mean_far_and_the_median_stays_among_the_honest_rows():
    """Six honest rows of a chunk-sized vector and four rows x1e6 (four of ten, on both sides): every
    coordinate of the median lies within the honest rows' range; the mean is thousands of times farther."""
    generator = torch.Generator().manual_seed(0)
    honest = torch.randn(20_000, generator=generator) + torch.randn(6, 20_000, generator=generator)
    liars = torch.randn(4, 20_000, generator=generator) * 1e6
    stack, weights = torch.cat([liars, honest]), torch.ones(10, dtype=torch.float64)
    median = MEDIAN.aggregate(stack, weights).value
    assert bool(((median >= honest.min(dim=0).values) & (median <= honest.max(dim=0).values)).all())
    honest_mean = honest.mean(dim=0)
    spread = float((honest - honest_mean).norm(dim=1).min())  # how far an honest row is from their mean
    assert float((median - honest_mean).norm()) < spread
    assert float((weighted_mean(stack, weights) - honest_mean).norm()) > 1000 * spread


def test_two_rows_are_their_weighted_mean_as_under_every_rule():
    stack, weights = random_case(1, 2, 30)
    torch.testing.assert_close(MEDIAN.aggregate(stack, weights).value, weighted_mean(stack, weights))


def test_the_median_is_a_registered_moshpit_rule_without_a_gossip_form():
    assert "median" in RULE_NAMES and MEDIAN.name == "median" and not MEDIAN.streams
    assert MEDIAN.gossip() is None
    assert RunConfig(aggregator="median").aggregator == "median"
    with pytest.raises(ConfigError, match="for gossip averaging, got 'median' \\(it needs a group"):
        RunConfig(strategy=GossipSGD(), aggregator="median")


def test_a_real_moshpit_round_under_the_median_keeps_two_liars_of_five_out():
    """Five real peers in one group, two of them sending their values x1000: every honest peer ends
    with the same tensor, each coordinate within the honest peers' range (trimmed-mean, which drops
    one row at each end of five, would keep a liar's value wherever both lie on one side)."""

    async def scenario():
        async with AsyncExitStack() as stack:
            tensors = peer_tensors(5, seed=4)
            honest = torch.stack(tensors[2:])
            runtimes = await start_runtimes(stack, 5)
            settings = Moshpit(group_size=5, matchmaking_seconds=5.0)  # ends once all five declared
            averagers = [await stack.enter_async_context(
                (ScalingLiar if i < 2 else Averager)(runtime, [tensor], settings=settings, grid_dims=1, codec="none",
                                                     aggregation=Aggregation(rule="median")))
                for i, (runtime, tensor) in enumerate(zip(runtimes, tensors))]
            reports = await asyncio.gather(*(averager.step() for averager in averagers))
            assert all(r.ok and len(r.group) == 5 for r in reports), [r.error for r in reports]
            assert torch.equal(tensors[2], tensors[3]) and torch.equal(tensors[3], tensors[4])
            assert bool(((tensors[2] >= honest.min(dim=0).values) & (tensors[2] <= honest.max(dim=0).values)).all())
            assert tensors[2].numel() == NUMEL

    run_async(scenario())
