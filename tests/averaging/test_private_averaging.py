"""Privacy applied by the averaging engine: what a receiver sees, the budget stop, the report."""

import asyncio
from contextlib import AsyncExitStack

import torch
from conftest import eventually, run_async

from swarmgrad.averaging import Averager, Moshpit
from swarmgrad.averaging.allreduce import GroupAllReduce
from swarmgrad.averaging.privacy import Privacy
from swarmgrad.dht import Membership, NodeConfig, SwarmNode, list_members
from swarmgrad.net.network_runtime import NetworkRuntime

RUN = "private-run"
PAIR = Moshpit(group_size=2, matchmaking_seconds=1.0)


async def two_runtimes(stack: AsyncExitStack) -> list[NetworkRuntime]:
    first = await stack.enter_async_context(SwarmNode())
    second = await stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first.maddrs)))
    return [await stack.enter_async_context(NetworkRuntime(RUN, node=node)) for node in (first, second)]


def test_receiver_never_sees_the_raw_update(monkeypatch):
    received: list[tuple[str, torch.Tensor]] = []  # (receiving peer, decoded contribution) on the owner side
    original = GroupAllReduce._decode_chunk

    def recording(self, header, payload, chunk, codec):
        values = original(self, header, payload, chunk, codec)
        if codec is self.codec:  # a contribution, not an average coming back
            received.append((self.me, values.clone()))
        return values

    monkeypatch.setattr(GroupAllReduce, "_decode_chunk", recording)
    privacy = Privacy(clip_norm=1.0, noise_multiplier=0.5)

    async def scenario():
        async with AsyncExitStack() as stack:
            runtimes = await two_runtimes(stack)
            raw = [torch.full((600_000,), 3.0), torch.full((600_000,), -2.0)]
            tensors = [[raw[0].clone()], [raw[1].clone()]]
            averagers = [await stack.enter_async_context(
                Averager(runtime, ts, settings=PAIR, grid_dims=1, codec="none", privacy=privacy))
                for runtime, ts in zip(runtimes, tensors)]
            reports = await asyncio.gather(*(a.step() for a in averagers))
            assert all(r.ok for r in reports), [r.error for r in reports]
            assert all(r.privacy["releases"] == 1 and r.privacy["epsilon"] > 0 for r in reports)
            assert received, "no contribution crossed the wire"
            for _receiver, values in received:
                for update in raw:  # nothing that arrived is (a piece of) either raw update...
                    assert not torch.allclose(values, update[: len(values)], atol=0.5)
                # ...and what arrived is noise around a clipped update: tiny mean, std ~ 0.5
                assert abs(float(values.mean())) < 0.05 and 0.45 < float(values.std()) < 0.55
            assert torch.equal(tensors[0][0], tensors[1][0])  # both hold the same (noisy) average
            assert not torch.equal(tensors[0][0], raw[0])

    run_async(scenario())


def test_budget_stop_keeps_tensors_and_reports_why():
    privacy = Privacy(clip_norm=1.0, noise_multiplier=1.0, max_epsilon=1.5, delta=1e-5)

    async def scenario():
        async with AsyncExitStack() as stack:
            runtimes = await two_runtimes(stack)
            tensors = [[torch.randn(1000)], [torch.randn(1000)]]
            averagers = [await stack.enter_async_context(
                Averager(runtime, ts, settings=PAIR, grid_dims=1, codec="none", privacy=privacy))
                for runtime, ts in zip(runtimes, tensors)]
            for _ in range(20):
                before = [ts[0].clone() for ts in tensors]
                reports = await asyncio.gather(*(a.step() for a in averagers))
                if any("budget exhausted" in (r.error or "") for r in reports):
                    break
            else:
                raise AssertionError("the budget never ran out")
            stopped = [i for i, r in enumerate(reports) if "budget exhausted" in (r.error or "")]
            for i in stopped:
                assert torch.equal(tensors[i][0], before[i])  # nothing released, nothing changed
                assert reports[i].privacy["exhausted"] and reports[i].privacy["epsilon"] <= 1.5

    run_async(scenario())


def test_epsilon_travels_in_the_membership_record():
    async def scenario():
        async with SwarmNode() as node, Membership(node, RUN, ttl=10) as membership:
            membership.update(epsilon=2.5)
            await membership.announce()
            [member] = await list_members(node, RUN)
            assert member.epsilon == 2.5 and member.to_json()["epsilon"] == 2.5
            membership.update(epsilon=float("inf"))
            await membership.announce()
            [member] = await list_members(node, RUN)
            assert member.to_json()["epsilon"] == "inf"

    run_async(scenario())


def test_private_gossip_sends_only_clipped_noised_differences(monkeypatch):
    from swarmgrad.averaging import GossipAverager
    from swarmgrad.averaging.gossip import GossipAverager as Gossip

    arrivals: list[torch.Tensor] = []
    original = Gossip._receive

    async def recording(self, channel):
        await original(self, channel)
        if self._pending:
            arrivals.append(self._pending[-1].values.clone())

    monkeypatch.setattr(Gossip, "_receive", recording)
    privacy = Privacy(clip_norm=1.0, noise_multiplier=0.3)

    async def scenario():
        async with AsyncExitStack() as stack:
            runtimes = await two_runtimes(stack)

            async def both_listed():  # gossip picks its neighbours from the runtime's presence
                return all(len(runtime.members()) == 2 for runtime in runtimes)

            await eventually(both_listed, seconds=10)
            raw = [torch.full((10_000,), 5.0), torch.full((10_000,), -5.0)]
            tensors = [raw[0].clone(), raw[1].clone()]
            gossips = [await stack.enter_async_context(GossipAverager(runtime, [t], codec="none", privacy=privacy))
                       for runtime, t in zip(runtimes, tensors)]
            reports = await asyncio.gather(*(g.step() for g in gossips))
            assert all(r.pushed_to for r in reports), reports
            assert all(r.privacy["releases"] == 1 for r in reports)
            assert torch.equal(tensors[0], raw[0]) and torch.equal(tensors[1], raw[1])  # never noised locally
            assert len(arrivals) == 2
            for values in arrivals:  # noise (std 0.3) around a clipped vector (norm <= 1): never +-5
                assert abs(float(values.mean())) < 0.05 and 0.25 < float(values.std()) < 0.35

    run_async(scenario())
