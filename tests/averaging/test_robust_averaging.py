"""Robust aggregation and bounded weights on real peers (p2pd daemons, DHT matchmaking, the direct
data plane): a liar among four moshpit peers, a peer that claims a huge weight, a gossip pusher
that sends a huge value. The liars are real Averagers and GossipAveragers; only what they send is
changed (a contribution scaled after it was prepared, a claimed weight, the tensor they gossip).
Each test also checks what happens with the defence off (``aggregator="mean"``, no cap)."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest
import torch
from conftest import eventually, run_async

from swarmgrad.averaging import Aggregation, Averager, Gossip, GossipAverager, Moshpit
from swarmgrad.averaging.allreduce import _left_out
from swarmgrad.averaging.privacy import Privacy
from swarmgrad.averaging.rules.base import weighted_mean
from swarmgrad.averaging.rules.trimmed_mean import trim_for, trimmed_mean
from swarmgrad.dht import NodeConfig, SwarmNode
from swarmgrad.net.network_runtime import NetworkRuntime
from swarmgrad.net.wire import FrameError
from swarmgrad.timing import Timing

RUN = "robust-test"
GROUP = Moshpit(group_size=4, matchmaking_seconds=1.0)  # ends once all four declared; a second on a busy machine
NUMEL = 300_000  # two chunks, owned by two of the members: only owners see (and report) contributions


class ScalingLiar(Averager):
    """A real Averager that sends its prepared contribution (after any privacy) scaled by 1000."""

    def _prepare_contribution(self, report) -> bool:
        ready = super()._prepare_contribution(report)
        self._buffer.mul_(1000.0)
        return ready


async def start_runtimes(stack: AsyncExitStack, count: int, timing: Timing | None = None) -> list[NetworkRuntime]:
    first = await stack.enter_async_context(SwarmNode())
    nodes = [first, *await asyncio.gather(
        *(stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first.maddrs))) for _ in range(count - 1)))]
    options = {} if timing is None else {"timing": timing}
    return list(await asyncio.gather(*(stack.enter_async_context(NetworkRuntime(RUN, node=node, **options))
                                       for node in nodes)))


def peer_tensors(count: int, seed: int = 0) -> list[torch.Tensor]:
    """Each peer's values: a common part plus its own noise of the same size."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(NUMEL, generator=generator)
    return [common + torch.randn(NUMEL, generator=generator) for _ in range(count)]


async def one_round(stack: AsyncExitStack, tensors: list[torch.Tensor], weights: list[float],
                    liar: int | None = None, aggregator: str = "centered-clip", weight_cap: float | None = None,
                    **options) -> tuple[list[str], list]:
    """One moshpit round of ``len(tensors)`` peers (peer ``liar`` a ScalingLiar): their ids and reports."""
    runtimes = await start_runtimes(stack, len(tensors))
    aggregation = Aggregation(rule=aggregator, weight_cap=weight_cap)
    averagers = [await stack.enter_async_context(
        (ScalingLiar if i == liar else Averager)(runtime, [tensor], settings=GROUP, grid_dims=1,
                                                 aggregation=aggregation, **options))
        for i, (runtime, tensor) in enumerate(zip(runtimes, tensors))]
    reports = await asyncio.gather(*(a.step(weight=w) for a, w in zip(averagers, weights)))
    assert all(r.ok for r in reports), [r.error for r in reports]
    assert all(len(r.group) == len(tensors) for r in reports)
    return [runtime.peer_id for runtime in runtimes], reports


def distances_to(center: torch.Tensor, tensors: list[torch.Tensor]) -> list[float]:
    return [float((t - center).norm()) for t in tensors]


def suspicions(reports) -> dict[str, set[str]]:
    """Everything the honest peers (all but the first) reported, merged: peer -> reasons."""
    seen: dict[str, set[str]] = {}
    for report in reports[1:]:
        for peer, reasons in report.suspicions.items():
            seen.setdefault(peer, set()).update(reasons)
    return seen


@pytest.mark.parametrize("aggregator", ["mean", "centered-clip", "trimmed-mean"])
def test_a_contribution_scaled_by_1000_moves_the_mean_far_and_robust_aggregates_little(aggregator):
    async def scenario():
        async with AsyncExitStack() as stack:
            tensors = peer_tensors(4)
            honest_mean = sum(tensors[1:]) / 3
            spread = min(distances_to(honest_mean, tensors[1:]))  # how far an honest peer is from it
            ids, reports = await one_round(stack, tensors, [1.0] * 4, liar=0, codec="none", aggregator=aggregator)
            assert torch.equal(tensors[1], tensors[2]) and torch.equal(tensors[2], tensors[3])  # one result
            distance = distances_to(honest_mean, tensors[1:2])[0]
            if aggregator == "mean":  # the defence off: the thousandfold contribution dominates
                assert distance > 100 * spread
                assert all(not r.suspicions for r in reports)
            else:  # nearer the honest peers' mean than any of them was
                assert distance < spread, (distance, spread)
            if aggregator == "centered-clip":  # the honest owners left the liar out (1000x: far past 3 τ), and only him
                assert suspicions(reports) == {ids[0]: {"rejected"}}
            # each contributor learns how much of its contribution the owners' rules left out: all of the
            # liar's (every part's rule rejects it, its own included), none of an honest peer's
            left_out = 1.0 if aggregator == "centered-clip" else 0.0
            assert [r.rejected_share for r in reports] == [left_out, 0.0, 0.0, 0.0]

    run_async(scenario())


@pytest.mark.parametrize("codec, privacy", [("int8", None), ("topk:0.1", None),
                                            ("none", Privacy(clip_norm=1000.0, noise_multiplier=1e-4))])
def test_centered_clip_composes_with_codecs_and_privacy(codec, privacy):
    """The owner clips what it decoded, after the senders clipped, noised and compressed: the liar
    is still bounded. (With the mean the result is ~250 x an honest tensor's norm away.)"""

    async def scenario():
        async with AsyncExitStack() as stack:
            tensors = peer_tensors(4, seed=1)
            honest_mean = sum(tensors[1:]) / 3
            scale = float(tensors[1].norm())
            ids, reports = await one_round(stack, tensors, [1.0] * 4, liar=0, codec=codec, privacy=privacy,
                                           aggregator="centered-clip")
            assert distances_to(honest_mean, tensors[1:2])[0] < 2 * scale
            assert suspicions(reports) == {ids[0]: {"rejected"}}

    run_async(scenario())


@pytest.mark.parametrize("aggregator, cap", [("centered-clip", None), ("trimmed-mean", None), ("mean", 4.0)])
def test_a_claimed_weight_of_1e9_is_cut(aggregator, cap):
    """Robust aggregators cut each claim to 2 x the group's median (1 here); the run's cap (4 here)
    bounds every aggregator's, the mean's too. Uncut, the liar's values would be the result."""

    async def scenario():
        async with AsyncExitStack() as stack:
            tensors = peer_tensors(4, seed=2)
            bounded = torch.tensor([2.0 if cap is None else cap, 1.0, 1.0, 1.0], dtype=torch.float64)
            if aggregator == "trimmed-mean":  # per coordinate, so the whole vector's is every chunk's
                expected = trimmed_mean(torch.stack(tensors), bounded, trim_for(4))
            else:  # no honest-looking row is clipped: the weighted mean with the bounded weights
                expected = weighted_mean(torch.stack(tensors), bounded)
            ids, reports = await one_round(stack, tensors, [1e9, 1.0, 1.0, 1.0], codec="none",
                                           aggregator=aggregator, weight_cap=cap)
            torch.testing.assert_close(tensors[1], expected, rtol=0, atol=1e-4)
            seen = suspicions(reports)
            assert set(seen) == {ids[0]} and "weight cut" in seen[ids[0]], seen

    run_async(scenario())


def test_a_fast_peers_claim_under_the_cap_is_cut_to_twice_the_median_but_not_held_against_it():
    """3 x the median is a fast honest peer (its claim under the run's cap): bounded, not suspected."""

    async def scenario():
        async with AsyncExitStack() as stack:
            tensors = peer_tensors(4, seed=2)
            expected = weighted_mean(torch.stack(tensors), torch.tensor([2.0, 1.0, 1.0, 1.0], dtype=torch.float64))
            ids, reports = await one_round(stack, tensors, [3.0, 1.0, 1.0, 1.0], codec="none",
                                           aggregator="centered-clip", weight_cap=4.0)
            torch.testing.assert_close(tensors[1], expected, rtol=0, atol=1e-4)
            assert suspicions(reports) == {}

    run_async(scenario())


def test_the_mean_with_no_cap_takes_a_claimed_weight_as_it_is():
    """The defence off: the same claim of 1e9, and the result is the liar's values."""

    async def scenario():
        async with AsyncExitStack() as stack:
            tensors = peer_tensors(4, seed=2)
            liar = tensors[0].clone()
            _, reports = await one_round(stack, tensors, [1e9, 1.0, 1.0, 1.0], codec="none", aggregator="mean")
            torch.testing.assert_close(tensors[1], liar, rtol=0, atol=1e-5)
            assert all(not r.suspicions for r in reports)

    run_async(scenario())


def test_peers_that_aggregate_differently_never_meet():
    async def scenario():
        async with AsyncExitStack() as stack:
            runtimes = await start_runtimes(stack, 2)
            tensors = peer_tensors(2)
            averagers = [await stack.enter_async_context(
                Averager(runtime, [tensor], settings=Moshpit(group_size=2, matchmaking_seconds=0.3), grid_dims=1,
                         codec="none", aggregation=Aggregation(rule=aggregator)))
                for runtime, tensor, aggregator in zip(runtimes, tensors, ["mean", "centered-clip"])]
            before = [t.clone() for t in tensors]
            reports = await asyncio.gather(*(a.step() for a in averagers))
            assert not any(r.ok for r in reports) and all(r.group == [rt.peer_id] for r, rt in zip(reports, runtimes))
            assert all(torch.equal(t, b) for t, b in zip(tensors, before))

    run_async(scenario())


# ---- gossip ---------------------------------------------------------------------------------------

PRESENCE = Timing(presence_refresh=0.5)


async def gossip_peers(stack: AsyncExitStack, count: int, aggregator: str,
                       weights: list[float] | None = None) -> tuple[list[str], list, list]:
    runtimes = await start_runtimes(stack, count, timing=PRESENCE)
    generator = torch.Generator().manual_seed(3)
    tensors = [torch.randn(5000, generator=generator) for _ in runtimes]
    gossips = [await stack.enter_async_context(GossipAverager(runtime, [t], settings=Gossip(), codec="none",
                                                              aggregator=aggregator, weight=weight))
               for runtime, t, weight in zip(runtimes, tensors, weights or [1.0] * count)]

    async def everyone_listed():
        return all(len(runtime.members()) == count for runtime in runtimes)

    await eventually(everyone_listed, seconds=10)
    return [runtime.peer_id for runtime in runtimes], tensors, gossips


@pytest.mark.parametrize("aggregator", ["centered-clip", "mean"])
def test_clipped_gossip_keeps_honest_peers_near_each_other_when_one_pushes_a_huge_value(aggregator):
    """Five peers gossip honestly for a few steps (so each has seen its senders' distances), then
    peer 0 pushes 1e6 x its values at every step. Clipped, the honest peers stay within the distance
    they started at from their mean, and the liar's pushes are clipped every time (an honest push now
    and then, when it came from farther than its fellows); with plain push-sum (the defence off) they
    are dragged ~1e5 away."""

    async def scenario():
        async with AsyncExitStack() as stack:
            ids, tensors, gossips = await gossip_peers(stack, 5, aggregator)
            honest = tensors[1:]
            start_mean = sum(honest) / 4
            start_spread = max(float((t - start_mean).norm()) for t in honest)
            huge = tensors[0] * 1e6
            clipped = {peer: 0 for peer in ids}
            liar_merged = 0
            for step in range(16):
                if step >= 4:  # the liar's tensor is its huge value again before each of its pushes
                    tensors[0].copy_(huge)
                pushed = bool((await gossips[0].step()).pushed_to)  # its push is merged in the honest steps next
                reports = await asyncio.gather(*(g.step() for g in gossips[1:]))
                if step >= 4:
                    liar_merged += pushed
                    for report in reports:
                        for peer in report.suspicions:
                            clipped[peer] += 1
            worst = max(float((t - start_mean).norm()) for t in honest)
            if aggregator == "mean":
                assert worst > 1e4 * start_spread
                assert not any(clipped.values())
            else:
                assert worst < start_spread, (worst, start_spread)
                assert clipped[ids[0]] == liar_merged > 0, clipped  # every push it made was clipped

    run_async(scenario())


def test_clipped_gossip_among_honest_peers_still_reaches_the_weighted_mean():
    """No liar: eight peers gossip with clipping on (the run default) and reach the weighted mean
    as plain push-sum does (test_gossip.py), with no push clipped."""

    async def scenario():
        async with AsyncExitStack() as stack:
            _, tensors, gossips = await gossip_peers(stack, 8, "centered-clip", weights=[float(i + 1) for i in range(8)])
            mean = sum((i + 1) * t for i, t in enumerate(tensors)) / 36
            clipped = 0
            for _ in range(30):
                clipped += sum(report.clipped for report in await asyncio.gather(*(g.step() for g in gossips)))
            assert max(float((t - mean).norm() / mean.norm()) for t in tensors) < 1e-3
            assert clipped == 0

    run_async(scenario())


def test_an_owner_reduces_a_few_chunks_at_a_time_and_gets_the_same_result(monkeypatch):
    """Under a rule that needs every member's row, an owner keeps rows only for the chunks it reduces
    now (``OPEN_CHUNKS``), not its whole part: a model-sized buffer per round otherwise. The result is
    the same (to float rounding: new peers, another order of members); with the window wide open every
    chunk of the part is open at once."""
    from swarmgrad.averaging import allreduce

    most_open: list[int] = []
    opened = allreduce.GroupAllReduce._open_chunk

    def counting(self, chunk):
        opened(self, chunk)
        most_open.append(len(self._open))

    monkeypatch.setattr(allreduce.GroupAllReduce, "_open_chunk", counting)
    generator = torch.Generator().manual_seed(5)
    values = [torch.randn(10 * (1 << 18), generator=generator) for _ in range(3)]  # 10 chunks, 3 or 4 per owner

    async def averaged(window: int) -> torch.Tensor:
        monkeypatch.setattr(allreduce, "OPEN_CHUNKS", window)
        most_open.clear()
        tensors = [value.clone() for value in values]
        async with AsyncExitStack() as stack:
            await one_round(stack, tensors, [1.0, 1.0, 1.0], codec="none")  # int8 would round ties either way
        assert all(torch.equal(tensors[0], tensor) for tensor in tensors[1:])
        return tensors[0]

    windowed = run_async(averaged(1))
    assert max(most_open) == 1
    wide = run_async(averaged(100))
    assert max(most_open) >= 3  # the same round without the window: a whole part open at once
    torch.testing.assert_close(windowed, wide, rtol=1e-5, atol=1e-6)


def test_an_averages_frame_may_name_only_members_as_left_out():
    """``"out"`` in an average's frame: absent is none; anything but a short list of member indices is a
    bad frame (the round fails as for any other), not a count to trust."""
    assert _left_out({}, 4) == set()
    assert _left_out({"out": [0, 3]}, 4) == {0, 3}
    for bad in ([4], [-1], ["0"], [0.0], [0, 1, 2, 3, 0], "0"):
        with pytest.raises(FrameError):
            _left_out({"out": bad}, 4)
