"""Push-sum gossip on a real swarm: consensus, conserved mass, crashes, slow peers, bad pushes.

Every peer is a ``NetworkRuntime`` around a SwarmNode; gossip picks its neighbours from the runtime's
presence, reread every ``PRESENCE.presence_refresh`` seconds.
"""

import asyncio
import json
import math
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import eventually, run_async
from hivemind.p2p import PeerID

from swarmgrad.averaging import Gossip, GossipAverager
from swarmgrad.averaging.gossip import MIN_WEIGHT_FRACTION
from swarmgrad.averaging.pushsum import Push, exponential_neighbors
from swarmgrad.dht import NodeConfig, SwarmNode
from swarmgrad.net.framestream import FastChannel
from swarmgrad.net.network_runtime import NetworkRuntime
from swarmgrad.net.wire import RemoteError
from swarmgrad.timing import Timing

RUN = "gossip-test"
PRESENCE = Timing(presence_refresh=0.5)  # members reread every 0.5 s; a record lives max(6, 6 x 0.5) = 6 s


async def gossip_swarm(stack: AsyncExitStack, count: int, codec: str = "none", numel: int = 5000,
                       aggregator: str = "mean", **settings):
    """``count`` gossiping peers; plain push-sum unless ``aggregator`` says otherwise (these tests check
    its exact arithmetic and mass; clipped gossip, the run default, is test_robust_averaging.py's)."""
    first = await stack.enter_async_context(SwarmNode())
    nodes = [first] + list(await asyncio.gather(
        *(stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first.maddrs))) for _ in range(count - 1))))
    runtimes = list(await asyncio.gather(
        *(stack.enter_async_context(NetworkRuntime(RUN, node=node, timing=PRESENCE)) for node in nodes)))
    generator = torch.Generator().manual_seed(7)
    tensors = [torch.randn(numel, generator=generator) for _ in nodes]
    weights = [float(i + 1) for i in range(count)]
    mean = sum(w * t for w, t in zip(weights, tensors)) / sum(weights)
    gossips = [await stack.enter_async_context(
        GossipAverager(runtime, [t], settings=Gossip(**settings), weight=w, codec=codec, aggregator=aggregator))
        for runtime, t, w in zip(runtimes, tensors, weights)]

    async def everyone_listed():  # by every peer's presence: gossip picks its neighbours from there
        return all(len(runtime.members()) == count for runtime in runtimes)

    await eventually(everyone_listed, seconds=10)
    return nodes, tensors, weights, mean, gossips


def relative_error(tensors, mean) -> float:
    return max(float((t - mean).norm() / mean.norm()) for t in tensors)


def total_mass(gossips) -> float:
    return sum(g.weight for g in gossips) + sum(p.weight for g in gossips for p in g._pending)


def test_exponential_graph_visits_every_offset():
    members = [f"peer{i:02d}" for i in range(8)]
    seen = {tuple(exponential_neighbors(members, "peer00", step, fanout=1)) for step in range(3)}
    assert seen == {("peer01",), ("peer02",), ("peer04",)}
    assert exponential_neighbors(["only"], "only", 0, 2) == []
    assert len(exponential_neighbors(members, "peer03", 0, fanout=2)) == 2


def lone_averager(values: torch.Tensor, weight: float = 1.0) -> GossipAverager:
    """An averager whose pushes are faked (no node, no transport; a runtime that lists one other
    training member): for the local push-sum arithmetic."""
    members = [SimpleNamespace(peer_id=peer, role="peer", paused=False, last_seen=0.0) for peer in ("me", "other")]
    runtime = SimpleNamespace(node=SimpleNamespace(peer_id="me"), run_id="arith", timing=Timing(),
                              transport=None, members=lambda: members, can_reach=lambda _peer: True)
    averager = GossipAverager(runtime, [values], weight=weight, codec="int8", aggregator="mean")
    averager.schema.flatten_into(averager.tensors, averager._values)
    return averager


def test_a_peer_that_only_pushes_stays_finite_and_waits_once_starved():
    """Each push halves the weight. A peer that receives nothing (its groupmates slow or busy) used
    to reach weights float32 cannot carry, and its model turned to garbage, then NaN, mid-run. Now
    the arithmetic never puts a weight into the tensors, and a starved peer waits to receive."""
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    averager, original = lone_averager(values.clone()), values.clone()
    generator = torch.Generator().manual_seed(1)
    pushes = 0

    async def push(peer: str, neighbors: int) -> tuple[bool, int]:
        nonlocal pushes
        pushes += 1
        lossy = averager._values + 1e-3 * torch.randn(1000, generator=generator)  # what int8 delivers
        averager._give(averager.weight / (neighbors + 1), lossy)
        return True, 0

    averager._push = push
    for _ in range(300):
        run_async(averager.step())
    assert pushes == 41 and averager.weight == 2.0**-41  # gave until below 2**-40, then waited
    assert averager.weight < MIN_WEIGHT_FRACTION
    assert bool(torch.isfinite(averager.tensors[0]).all())
    assert (averager.tensors[0] - original).abs().max() < 0.05  # only the compression errors it kept
    # one push in and it mixes again: the arriving values dominate a starved peer's estimate
    arriving = torch.zeros(1000)
    averager._pending.append(Push(0.5, arriving))
    run_async(averager.step())
    assert pushes == 42 and averager.weight == pytest.approx((0.5 + 2.0**-41) / 2)
    assert (averager.tensors[0] - arriving).abs().max() < 0.01  # the push after the merge kept its error


def test_weight_lost_by_the_whole_swarm_does_not_stop_the_mixing():
    """Failed pushes lose mass, and everyone's weight shrinks alike: a peer light in absolute terms
    but not against its neighbours keeps pushing."""
    averager = lone_averager(torch.ones(8))
    pushes = []

    async def push(peer: str, neighbors: int) -> tuple[bool, int]:
        pushes.append(averager.weight)
        averager._give(averager.weight / 2, averager._values.clone())
        return True, 0

    averager._push = push
    averager.weight = 2.0**-60  # far below its starting weight of 1
    averager._pending.append(Push(2.0**-61, torch.ones(8)))
    run_async(averager.step())
    assert pushes == [2.0**-60 + 2.0**-61]


def test_push_sum_arithmetic_holds_at_any_weight_magnitude():
    for weight in (1e-300, 1.0, 1e14):
        values = torch.randn(64, generator=torch.Generator().manual_seed(2))
        averager = lone_averager(values.clone(), weight=weight)
        other = torch.randn(64, generator=torch.Generator().manual_seed(3))
        averager._pending.append(Push(weight / 3, other))
        averager._merge()
        torch.testing.assert_close(averager.tensors[0], (3 * values + other) / 4)
        arrives = averager._values + 0.01
        averager._give(averager.weight / 2, arrives)  # keeps x - (x^ - x): the error stays here
        torch.testing.assert_close(averager.tensors[0], (3 * values + other) / 4 - 0.01)
        assert averager.weight == pytest.approx(weight * 4 / 3 / 2)


def test_eight_peers_reach_the_weighted_mean_and_conserve_mass():
    async def scenario():
        async with AsyncExitStack() as stack:
            _, tensors, weights, mean, gossips = await gossip_swarm(stack, 8)
            for _ in range(30):
                await asyncio.gather(*(g.step() for g in gossips))
                assert math.isclose(total_mass(gossips), sum(weights), rel_tol=1e-9)  # nobody failed: conserved
                if relative_error(tensors, mean) < 1e-3:
                    break
            assert relative_error(tensors, mean) < 1e-3

    run_async(scenario())


@pytest.mark.parametrize("codec, steps, target", [("int8", 40, 1e-3), ("fp16", 30, 1e-3)])
def test_lossy_gossip_still_reaches_consensus(codec, steps, target):
    async def scenario():
        async with AsyncExitStack() as stack:
            _, tensors, weights, mean, gossips = await gossip_swarm(stack, 8, codec=codec)
            for _ in range(steps):
                await asyncio.gather(*(g.step() for g in gossips))
                if relative_error(tensors, mean) < target:
                    break
            assert relative_error(tensors, mean) < target
            assert math.isclose(total_mass(gossips), sum(weights), rel_tol=1e-9)

    run_async(scenario())


def test_topk_gossip_reaches_the_weighted_mean_with_per_coordinate_mass():
    """Sparse pushes (10% of coordinates each) run one push-sum per coordinate: mass is conserved
    per coordinate, exactly, and the swarm still reaches the weighted mean."""

    async def scenario():
        async with AsyncExitStack() as stack:
            _, tensors, weights, mean, gossips = await gossip_swarm(stack, 4, codec="topk:0.1", numel=2000)
            for _ in range(300):
                await asyncio.gather(*(g.step() for g in gossips))
                per_coordinate = sum(g.sparse.weights for g in gossips) + sum(
                    torch.zeros(2000).index_add_(0, p.indices, p.weight) for g in gossips for p in g._pending)
                torch.testing.assert_close(per_coordinate, torch.full((2000,), sum(weights)))
                if relative_error(tensors, mean) < 1e-3:
                    break
            assert relative_error(tensors, mean) < 1e-3
            report = await gossips[0].step()
            assert 0 < report.bytes_sent < 0.4 * 4 * 2000  # 10% of coordinates at 12 bytes: 30% of a dense push

    run_async(scenario())


def test_sparse_push_payloads_are_validated():
    from swarmgrad.averaging.sparse_gossip import pack, unpack
    from swarmgrad.net.wire import FrameError

    good = pack(torch.tensor([1, 5, 9]), torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.5, 0.5]))
    indices, values, weights = unpack(good, 3, 10)
    assert indices.tolist() == [1, 5, 9] and values.tolist() == [1.0, 2.0, 3.0]
    bad = {
        "unsorted": pack(torch.tensor([5, 1, 9]), torch.ones(3), torch.ones(3)),
        "duplicate": pack(torch.tensor([1, 1, 9]), torch.ones(3), torch.ones(3)),
        "out of range": pack(torch.tensor([1, 5, 10]), torch.ones(3), torch.ones(3)),
        "negative": pack(torch.tensor([-1, 5, 9]), torch.ones(3), torch.ones(3)),
        "NaN": pack(torch.tensor([1, 5, 9]), torch.tensor([1.0, float("nan"), 3.0]), torch.ones(3)),
        "zero weight": pack(torch.tensor([1, 5, 9]), torch.ones(3), torch.tensor([1.0, 0.0, 1.0])),
        "truncated": good[:-4],
    }
    for name, payload in bad.items():
        with pytest.raises(FrameError):
            unpack(payload, 3, 10)


def test_survivors_reach_consensus_after_a_peer_is_killed():
    async def scenario():
        async with AsyncExitStack() as stack:
            nodes, tensors, _, _, gossips = await gossip_swarm(stack, 7)
            victim = subprocess.Popen(
                [sys.executable, str(Path(__file__).parents[1] / "gossip_peer.py"), nodes[0].maddrs[0], RUN, "50.0",
                 "5000", "8.0"], stdout=subprocess.PIPE, text=True)
            try:
                ready = json.loads(await asyncio.to_thread(victim.stdout.readline))
                victim_id = ready["ready"]

                async def victim_listed():  # by everyone: it is somebody's neighbour
                    return all(victim_id in [m.peer_id for m in g.runtime.members()] for g in gossips)

                await eventually(victim_listed, seconds=10)
                for _ in range(6):
                    await asyncio.gather(*(g.step() for g in gossips))
                    await asyncio.sleep(0.05)
                victim.kill()
                victim.wait()
                failed = [0] * len(gossips)  # pushes that went nowhere: all to the victim

                def listed() -> list[float]:  # the expiry of the victim's record in each survivor's listing
                    return [m.expires for g in gossips for m in g.runtime.members() if m.peer_id == victim_id]

                # its last record lives ttl (6 s) stretched by its beats' measured work: until its own
                # expiry, as the survivors see it, and a reread after that
                deadline = time.monotonic() + 60
                while listed() and time.monotonic() < deadline:
                    reports = await asyncio.gather(*(g.step() for g in gossips))
                    for index, report in enumerate(reports):
                        failed[index] += len(report.failed)
                    await asyncio.sleep(0.05)
                # a peer a push failed to reach is skipped for 3 presence TTLs and then for as long as
                # it sends no new heartbeat: one failed push each at most, not one whenever it is a neighbour
                assert max(failed) <= 1 <= sum(failed), failed  # and it was somebody's neighbour
                assert not listed()
                for _ in range(60):
                    await asyncio.gather(*(g.step() for g in gossips))
                    await asyncio.sleep(0.05)
                    consensus = torch.stack(tensors).mean(0)
                    if relative_error(tensors, consensus) < 1e-3:
                        break
                consensus = torch.stack(tensors).mean(0)
                assert relative_error(tensors, consensus) < 1e-3
                assert all(torch.isfinite(t).all() for t in tensors)
            finally:
                victim.kill()
                victim.wait()

    run_async(scenario())


def test_a_slow_peer_does_not_slow_the_others():
    """Peer 0 steps once for every five steps of the others, in lockstep (no clocks, so load cannot
    decide it): their pushes to it wait in its queue until it merges, so every push is taken at once.
    A receiver that only took pushes while stepping would leave theirs hanging until push_timeout."""
    async def scenario():
        async with AsyncExitStack() as stack:
            _, _, _, _, gossips = await gossip_swarm(stack, 4, numel=20_000, push_timeout=10)
            slow, mass = gossips[0], total_mass(gossips)
            slow_id = slow.node.peer_id
            pushes_to_slow, most_waiting = 0, 0
            for round_index in range(30):
                stepping = gossips if round_index % 5 == 0 else gossips[1:]
                reports = (await asyncio.gather(*(g.step() for g in stepping)))[-3:]  # the fast peers'
                assert not any(report.failed for report in reports), [r.failed for r in reports]
                pushes_to_slow += sum(slow_id in report.pushed_to for report in reports)
                most_waiting = max(most_waiting, len(slow._pending))
            assert pushes_to_slow >= 10 and most_waiting >= 3, (pushes_to_slow, most_waiting)
            assert total_mass(gossips) == pytest.approx(mass, rel=1e-6)

    run_async(scenario())


def test_bad_pushes_are_refused_without_touching_state():
    async def scenario():
        async with AsyncExitStack() as stack:
            nodes, tensors, weights, _, gossips = await gossip_swarm(stack, 2, numel=1000)
            target, attacker = gossips[0], nodes[1]
            before, weight_before = tensors[0].clone(), target.weight
            chunk = target.schema.chunks[0]
            good_header = {"codec": "none", "shape": list(chunk.view), "dtype": "float32", "meta": {}}
            nan = torch.full((chunk.length,), float("nan")).numpy().tobytes()
            attempts = [
                ({"t": "push", "weight": -1.0, "chunks": 1, "ref": 0}, None),
                ({"t": "push", "weight": 1.0, "chunks": 5, "ref": 0}, None),
                ({"t": "push", "weight": 1.0, "chunks": 1, "ref": 3}, None),  # a reference never agreed on
                ({"t": "push", "weight": 1.0, "chunks": 1, "ref": 0},
                 ({"t": "chunk", "c": 0, "enc": good_header, "sizes": [["data", len(nan)]]}, nan)),
            ]
            for push, chunk_frame in attempts:
                _, reader, writer = await attacker.p2p.call_binary_stream_handler(
                    PeerID.from_base58(nodes[0].peer_id), target.protocol)
                channel = FastChannel.take_over(nodes[0].peer_id, reader, writer, "libp2p")
                await channel.send(push)
                if chunk_frame:
                    await channel.send(*chunk_frame)
                with pytest.raises((RemoteError, EOFError)):
                    await asyncio.wait_for(channel.recv(), timeout=10)
                await channel.close()
            await target.step()
            assert target._pending == [] and target.weight <= weight_before
            assert torch.equal(tensors[0], before)  # nothing merged; a lossless push keeps the values

    run_async(scenario())


def test_samples_added_as_weight_pull_the_mean_toward_the_peer_that_trained_on_them():
    """Issue 38: push-sum mass comes from samples (``add_weight``, which the gossip backend calls
    with the samples since the last step), not one unit a peer: a peer with 97 more samples counts
    97 times more in the mean the swarm reaches."""
    async def scenario():
        async with AsyncExitStack() as stack:
            _, tensors, weights, _, gossips = await gossip_swarm(stack, 2)
            gossips[0].add_weight(97.0)
            gossips[1].add_weight(float("nan"))  # not a sample count: ignored
            weights = [weights[0] + 97.0, weights[1]]
            mean = (weights[0] * tensors[0] + weights[1] * tensors[1]) / sum(weights)
            for _ in range(30):
                await asyncio.gather(*(g.step() for g in gossips))
                if relative_error(tensors, mean) < 1e-3:
                    break
            assert relative_error(tensors, mean) < 1e-3 and math.isclose(total_mass(gossips), sum(weights))

    run_async(scenario())


def test_lossy_pushes_to_several_neighbours_conserve_mass():
    """With fanout 2 the second push of a step must start from what the first one left."""

    async def scenario():
        async with AsyncExitStack() as stack:
            _, tensors, weights, _, gossips = await gossip_swarm(stack, 6, codec="int8", fanout=2)
            before = sum(w * t for w, t in zip(weights, tensors))
            for _ in range(10):
                await asyncio.gather(*(g.step() for g in gossips))
            after = sum(g.weight * t for g, t in zip(gossips, tensors)) + sum(
                p.weight * p.values for g in gossips for p in g._pending)
            assert float((after - before).norm() / before.norm()) < 1e-5

    run_async(scenario())
