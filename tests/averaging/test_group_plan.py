"""A group plan travels from the leader to every member in one frame header; any group `group_size`
allows must get through it, and a bigger one must be refused."""

from __future__ import annotations

import hashlib

import pytest

from swarmgrad.averaging import Moshpit
from swarmgrad.averaging.allreduce import GroupPlan
from swarmgrad.averaging.settings import MAX_GROUP
from swarmgrad.net.wire import PREFIX, FrameError, pack_prefix_and_header, parse_header


def plan_of(members: int) -> GroupPlan:
    # libp2p Ed25519 peer ids are 52 characters: the plan's size as a real group's
    ids = tuple("12D3KooW" + hashlib.sha256(str(i).encode()).hexdigest()[:44] for i in range(members))
    shares = tuple(1.0 / (i + 3) for i in range(members))  # full float64s, the costliest in msgpack
    return GroupPlan("swarmgrad/run/delta/e12/d0/s3", ids, shares, "int8", "ab" * 32, "centered-clip")


def through_a_frame(plan: GroupPlan) -> GroupPlan:
    packed = pack_prefix_and_header({"t": "begin", "plan": plan.to_wire()}, 0)
    return GroupPlan.from_wire(parse_header(packed[PREFIX.size:])["plan"])


def test_the_largest_group_moshpit_allows_round_trips_through_its_begin_frame() -> None:
    assert Moshpit(group_size=MAX_GROUP).group_size == MAX_GROUP == 1024
    plan = plan_of(MAX_GROUP)
    assert through_a_frame(plan) == plan


def test_a_plan_over_the_largest_group_is_refused() -> None:
    with pytest.raises(ValueError):
        Moshpit(group_size=MAX_GROUP + 1)
    with pytest.raises(FrameError, match="bad member list"):
        GroupPlan.from_wire(plan_of(MAX_GROUP + 1).to_wire())
