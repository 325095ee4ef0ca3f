"""The moshpit grid, pure (swarmgrad/averaging/grid.py): sides, a rank's cell, slice sizes, the
grid order, and how fast averaging along the slices mixes (the arithmetic behind a round's key)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.averaging.grid import grid_order, grid_position, grid_sides, slice_ranks


def reference_slice(rank: int, members: int, dim: int, sides: tuple[int, ...]) -> list[int]:
    """Plain reference: the ranks whose cell matches ours outside ``dim``."""
    mine = grid_position(rank, sides)
    return [
        other for other in range(members)
        if all(a == b for k, (a, b) in enumerate(zip(mine, grid_position(other, sides))) if k != dim)
    ]


def slices(members: int, dim: int, sides: tuple[int, ...]) -> list[list[int]]:
    """The ranks grouped by the round key they meet under along ``dim``."""
    groups: dict[tuple, list[int]] = {}
    for rank in range(members):
        cell = grid_position(rank, sides)
        groups.setdefault(tuple(c for k, c in enumerate(cell) if k != dim), []).append(rank)
    return list(groups.values())


@pytest.mark.parametrize("members, side, sides", [
    (1, 4, (2,)), (3, 4, (3,)), (4, 4, (4,)), (5, 4, (3, 2)), (8, 4, (4, 2)), (12, 4, (4, 3)),
    (16, 4, (4, 4)), (17, 4, (3, 3, 2)), (32, 4, (4, 4, 2)), (64, 4, (4, 4, 4)), (100, 4, (4, 3, 3, 3)),
    (10_000, 4, (4, 4, 4, 4, 4, 4, 3)), (9, 2, (2, 2, 2, 2)), (40, 16, (10, 4)),
])
def test_sides_are_the_fewest_dimensions_with_the_fewest_cells(members, side, sides):
    assert grid_sides(members, side) == sides


@given(st.integers(1, 5000), st.integers(2, 8))
def test_sides_fit_every_member_in_as_few_dimensions_as_the_group_size_allows(members, side):
    sides = grid_sides(members, side)
    assert all(2 <= length <= side for length in sides) and list(sides) == sorted(sides, reverse=True)
    assert math.prod(sides) >= members
    assert len(sides) == 1 or side ** (len(sides) - 1) < members


@given(st.integers(1, 300), st.integers(2, 6))
def test_ranks_fill_distinct_cells(members, side):
    sides = grid_sides(members, side)
    cells = {tuple(grid_position(rank, sides)) for rank in range(members)}
    assert len(cells) == members
    assert all(0 <= c < length for cell in cells for c, length in zip(cell, sides))


@given(st.integers(1, 200), st.lists(st.integers(2, 5), min_size=1, max_size=4), st.data())
def test_slice_ranks_match_the_reference(members, sides, data):
    """On any grid, including one with fewer cells than members (ranks wrap around it)."""
    sides = tuple(sides)
    rank = data.draw(st.integers(0, members - 1))
    dim = data.draw(st.integers(0, len(sides) - 1))
    assert sorted(slice_ranks(rank, members, dim, sides)) == reference_slice(rank, members, dim, sides)


@pytest.mark.parametrize("members", [8, 12, 16, 24, 32, 48, 64, 256])
def test_full_grids_give_full_slices_along_every_dimension(members):
    """No empty cell: every slice holds the side's length, so no peer is ever alone and no
    peer-round goes without a group."""
    sides = grid_sides(members, 4)
    assert math.prod(sides) == members
    for dim, length in enumerate(sides):
        assert all(len(group) == length for group in slices(members, dim, sides))
        assert all(len(slice_ranks(rank, members, dim, sides)) == length for rank in range(members))


def test_grid_order_is_a_permutation_fixed_by_its_salt():
    peers = [f"peer-{i}" for i in range(50)]
    first = grid_order(peers, "run/delta/0")
    assert sorted(first) == sorted(peers)
    assert grid_order(list(reversed(peers)), "run/delta/0") == first  # whatever order the listing came in
    assert grid_order(peers, "run/delta/1") != first  # the next cycle lays the swarm out afresh


def mix(members: int, rounds: int, side: int = 4) -> list[float]:
    """Rounds of moshpit on the rank grid, equal weights, a fresh order every cycle as the Averager
    draws it; the max relative error after each round."""
    values = torch.randn(members, 64, generator=torch.Generator().manual_seed(members), dtype=torch.float64)
    peers = [f"peer-{i}" for i in range(members)]
    sides = grid_sides(members, side)
    mean, errors = values.mean(0), []
    for round_index in range(rounds):
        order = [int(peer.split("-")[1]) for peer in grid_order(peers, f"run/{round_index // len(sides)}")]
        for group in slices(members, round_index % len(sides), sides):
            at = [order[rank] for rank in group]
            values[at] = values[at].mean(0)
        errors.append(float(((values - mean).norm(dim=1) / mean.norm()).max()))
    return errors


@pytest.mark.parametrize("members", [8, 16, 32, 64])
def test_full_grids_are_exact_after_one_round_per_dimension(members):
    dims = len(grid_sides(members, 4))
    errors = mix(members, dims)
    assert errors[-1] < 1e-12
    assert all(error > 1e-3 for error in errors[:-1])  # and not sooner: every dimension is needed


@pytest.mark.parametrize("members, within", [(10, 9), (17, 12), (50, 12), (100, 14)])
def test_grids_with_empty_cells_still_mix_geometrically(members, within):
    """Empty cells leave some slices short, so N that fills no grid needs more rounds than log_4 N
    (measured with this order: 8, 11, 11 and 13 rounds to 1e-3)."""
    errors = mix(members, within)
    assert min(errors) <= 1e-3, errors
    assert all(later <= 1.01 * earlier for earlier, later in zip(errors, errors[1:]))  # never worse
