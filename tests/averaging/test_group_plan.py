"""A group plan travels from the leader to every member in one frame header; any group `group_size`
allows must get through it, and a bigger one must be refused."""

from __future__ import annotations

import hashlib

import pytest
import torch
from conftest import run_async

from swarmgrad.averaging import Moshpit
from swarmgrad.averaging.allreduce import GroupAllReduce
from swarmgrad.averaging.codecs import get_codec
from swarmgrad.averaging.group_plan import GroupPlan
from swarmgrad.averaging.layout import Schema
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


def test_a_members_planned_bytes_are_its_busier_direction() -> None:
    """What a round's deadline is sized by (timing.py RoundTimer): in a group of three with equal
    shares, a member sends its contribution to the two other parts and its part's average to the two
    others, and receives the reverse; a member that owns no part (behind a NAT) sends its whole
    contribution and receives every average; its owners each receive one more contribution."""
    schema = Schema.of([("w", torch.zeros(3000))], chunk_elements=100)  # 30 chunks of 100 elements

    async def planned(shares: tuple[float, ...], codec: str) -> list[int]:
        plan = GroupPlan("r", ("a", "b", "c"), shares, codec, schema.digest)
        return [GroupAllReduce(plan, me, schema, torch.zeros(schema.total), 1.0, get_codec(codec), None,
                               "p").planned_bytes() for me in plan.members]

    assert run_async(planned((1.0, 1.0, 1.0), "none")) == [4 * (2000 + 2 * 1000)] * 3
    int8 = get_codec("int8").encoded_nbytes((100,))  # a chunk's bytes, both ways (int8 averages come back as int8)
    assert run_async(planned((1.0, 1.0, 1.0), "int8")) == [int8 * (20 + 2 * 10)] * 3
    assert run_async(planned((1.0, 1.0, 0.0), "none")) == [4 * (1500 + 2 * 1500)] * 2 + [4 * 3000]
