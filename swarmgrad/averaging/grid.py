"""The moshpit grid, pure: where each member sits and whom it meets in a round.

N members that average get a grid of d = ceil(log_g N) dimensions (g = the group size) whose sides
are at most g and hold as few cells as possible beyond N: 8 members in groups of 4 get a 4 x 2
grid, 17 get 3 x 3 x 2. A member's cell is the mixed-radix digits of its rank in the grid order
(the members sorted by a hash of a salt and their ids, the same on every peer that sees the same
membership). In round t a member meets those sharing its cell's coordinates except along
dimension t mod d: on a full grid everyone holds the exact mean after d rounds.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from typing import Sequence


@functools.lru_cache(maxsize=256)
def grid_sides(members: int, side: int) -> tuple[int, ...]:
    """The fewest dimensions with a cell for every member, and among the sides 2..``side`` that
    give them, those with the fewest cells (larger sides first): a grid with no empty cell is
    exact after one round per dimension, and each empty cell leaves some slice short."""
    dims, cells = 1, side
    while cells < members:
        dims, cells = dims + 1, cells * side
    candidates = itertools.combinations_with_replacement(range(side, 1, -1), dims)  # non-increasing
    return min((c for c in candidates if math.prod(c) >= members), key=math.prod)


def grid_position(rank: int, sides: Sequence[int]) -> list[int]:
    """The mixed-radix digits of ``rank``, lowest first: rank r sits in cell r mod the cell count."""
    position = []
    for length in sides:
        rank, digit = divmod(rank, length)
        position.append(digit)
    return position


def slice_ranks(rank: int, members: int, dim: int, sides: Sequence[int]) -> list[int]:
    """The ranks among 0..members-1 that share every coordinate of ``rank`` except the one along
    ``dim``: whom it meets in a round along ``dim`` (as many as the side is long inside the grid,
    fewer next to empty cells, more when the grid has fewer cells than members and ranks wrap)."""
    stride, period = math.prod(sides[:dim]), math.prod(sides)
    base = rank % period - ((rank // stride) % sides[dim]) * stride  # the slice's first cell
    return [other for digit in range(sides[dim]) for other in range(base + digit * stride, members, period)]


def grid_order(peer_ids: Sequence[str], salt: str) -> list[str]:
    """The members in grid order: sorted by a hash of (salt, peer id), whatever order they were
    listed in; a new salt lays the swarm out afresh."""
    return sorted(peer_ids, key=lambda peer: hashlib.sha256(f"{salt}/{peer}".encode()).digest())


def slices_reach_everyone(order: Sequence[str], reachable: set[str], dim: int, sides: Sequence[int]) -> bool:
    """Whether every slice along ``dim`` holds a member others can dial: a slice of members that
    nobody can dial (behind NATs) cannot average, since someone must own each part."""
    seen: set[int] = set()
    for rank in range(len(order)):
        if rank in seen:
            continue
        ranks = slice_ranks(rank, len(order), dim, sides)
        seen.update(ranks)
        if not any(order[r] in reachable for r in ranks):
            return False
    return True


def hub_groups(order: Sequence[str], reachable: set[str], group_size: int) -> list[list[str]]:
    """Groups for a round in which the grid would leave some slice without a dialable member:
    ceil(N / g) groups (fewer, and larger, when fewer members can be dialled), each led by a
    dialable member, the others dealt round-robin in ``order`` (a hash the caller salts per round,
    so groups change every round and the swarm still mixes). Empty when nobody can be dialled."""
    hubs = [peer for peer in order if peer in reachable]
    if not hubs:
        return []
    count = min(len(hubs), max(1, math.ceil(len(order) / group_size)))
    groups: list[list[str]] = [[] for _ in range(count)]
    for position, peer in enumerate(hubs[:count] + [p for p in order if p not in set(hubs[:count])]):
        groups[position % count].append(peer)
    return groups
