"""Local bans with real peers (real p2pd daemons, a real DHT, loopback) in a public run: a peer that
keeps sending invalid frames to a served protocol, over libp2p and over the direct data plane, is
banned by the peer it pestered: its streams are refused with a frame that says so, its presence
record is ignored (it leaves that peer's member list, not the others'), the ban is listed, and once
``ban_seconds`` pass it is served and listed again."""

from __future__ import annotations

import asyncio
import re
from contextlib import AsyncExitStack

import pytest
import torch
from conftest import eventually, run_async

from swarmgrad.dht import NodeConfig
from swarmgrad.net.accountability import Accountability
from swarmgrad.net.admission import BANNED
from swarmgrad.net.network_runtime import NetworkRuntime
from swarmgrad.net.transport import Libp2pTransport
from swarmgrad.net.wire import RemoteError
from swarmgrad.state.server import StateServer, state_protocol
from swarmgrad.state.snapshot import StateSnapshot
from swarmgrad.state.transfer import download_state
from swarmgrad.timing import Timing

TIMING = Timing(presence_refresh=0.5)
RULE = Accountability(ban_threshold=3, ban_seconds=6, half_life=600)


async def pester(channel) -> str:
    """Send a request the state protocol does not have; the answer is an error frame (its text)."""
    await channel.send({"t": "nonsense"})
    with pytest.raises(RemoteError) as answered:
        await asyncio.wait_for(channel.recv(), 10)
    await channel.close()
    return str(answered.value)


def test_a_peer_that_keeps_sending_invalid_frames_is_banned_then_admitted_again():
    run_id = "bans-invalid-frames"

    async def scenario():
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(NetworkRuntime(run_id, timing=TIMING, accountability=RULE))
            served = await stack.enter_async_context(StateServer(a.transport, state_protocol(run_id)))
            served.publish(StateSnapshot.capture(1, {"w": torch.arange(4.0)}))
            join = NodeConfig(initial_peers=a.node.maddrs)
            b, c = [await stack.enter_async_context(NetworkRuntime(run_id, join, timing=TIMING)) for _ in range(2)]
            everyone = {a.peer_id, b.peer_id, c.peer_id}

            async def listed_by_all() -> bool:
                return all({m.peer_id for m in runtime.members()} == everyone for runtime in (a, b, c))

            await eventually(listed_by_all, 20)
            # c pesters a: twice over a plain libp2p stream, once over its direct data plane
            raw = Libp2pTransport(c.node.p2p)
            answers = [await pester(await raw.open(a.peer_id, served.protocol)) for _ in range(2)]
            answers.append(await pester(await c.transport.open(a.peer_id, served.protocol)))
            assert all("unexpected request" in answer for answer in answers), answers
            assert set(a.admission.misbehaviour.bans()) == {c.peer_id}
            refused_before = a.admission.refused_streams

            # banned: every stream is refused, saying why, over libp2p and the direct plane's setup
            channel = await raw.open(a.peer_id, served.protocol)
            await channel.send({"t": "describe"})
            with pytest.raises(RemoteError, match=f"^{re.escape(BANNED)}"):
                await asyncio.wait_for(channel.recv(), 10)
            await channel.close()
            with pytest.raises(RemoteError, match=f"^{re.escape(BANNED)}"):
                await c.transport.open(a.peer_id, served.protocol)
            assert a.admission.refused_streams >= refused_before + 2

            # its record is ignored at a's next reread (every 0.5 s), well before the last one a took
            # would have expired (6 s); b, which banned nobody, still lists it
            async def gone_from_a() -> bool:
                return {m.peer_id for m in a.members()} == {a.peer_id, b.peer_id}

            await eventually(gone_from_a, TIMING.presence_ttl / 2)
            assert c.peer_id in {m.peer_id for m in b.members()} and a.admission.refused_records >= 1
            assert b.admission.misbehaviour.bans() == {}

            # the ban ends: c is served (it downloads a's state) and listed again
            await asyncio.sleep(a.admission.misbehaviour.bans()[c.peer_id])  # the ban's own deadline
            state = await download_state(c.transport, served.protocol, [a.peer_id], seconds=10)
            assert torch.equal(state.tensors()["w"], torch.arange(4.0))
            await eventually(listed_by_all, 10)
            assert a.admission.misbehaviour.bans() == {} and a.admission.misbehaviour.bans_total == 1

    run_async(scenario())


def test_a_peer_whose_contributions_are_clipped_round_after_round_is_banned_and_honest_ones_are_not():
    """Real moshpit rounds (3 honest Averagers and one that scales what it sends by 1000, fresh values
    every round, as training sends): each round's report goes to the score as ``Peer._record`` hands
    it over. With far rows counted (``far_rows`` 0.5; 0 by default, accountability.py) an owner that
    saw the liar left out in 4 rounds bans it (threshold 2; owners change from round to round);
    nobody bans an honest peer. Then rounds go on: a leader leaves out
    whoever a majority refuses, or a member that refuses one the others keep, so no round fails
    because one member refuses to stream with another (before, each such round failed for all:
    "expected a 'avg' frame, got 'end'")."""
    from test_robust_averaging import GROUP, NUMEL, ScalingLiar, start_runtimes

    from swarmgrad.averaging import Aggregation, Averager

    rule = Accountability(ban_threshold=2, ban_seconds=600, half_life=600, far_rows=0.5)

    async def scenario():
        async with AsyncExitStack() as stack:
            runtimes = await start_runtimes(stack, 4)
            for runtime in runtimes:
                runtime.admission.misbehaviour.settings = rule
            generator = torch.Generator().manual_seed(1)
            tensors = [torch.zeros(NUMEL) for _ in runtimes]
            averagers = [await stack.enter_async_context((ScalingLiar if i == 0 else Averager)(
                runtime, [tensor], settings=GROUP, grid_dims=1, codec="none",
                aggregation=Aggregation(rule="centered-clip")))
                for i, (runtime, tensor) in enumerate(zip(runtimes, tensors))]
            liar, honest = runtimes[0].peer_id, [runtime.peer_id for runtime in runtimes[1:]]
            for round_index in range(12):  # until someone bans (the liar's next round would fail)
                common = torch.randn(NUMEL, generator=generator)
                for tensor in tensors:
                    tensor.copy_(common + torch.randn(NUMEL, generator=generator))
                reports = await asyncio.gather(*(averager.step(weight=1.0) for averager in averagers))
                assert all(report.ok for report in reports), [report.error for report in reports]
                for runtime, report in zip(runtimes, reports):
                    runtime.admission.misbehaviour.note_round(report.suspicions, report.observed)
                if any(runtime.admission.misbehaviour.bans() for runtime in runtimes):
                    break
            assert round_index >= 3  # 4 clipped rounds at the least
            bans = [set(runtime.admission.misbehaviour.bans()) for runtime in runtimes[1:]]
            assert {liar} in bans and all(ban <= {liar} for ban in bans), bans  # the owners banned it, only it
            assert all(not runtime.admission.misbehaviour.banned(peer) for runtime in runtimes for peer in honest)
            banners = {runtime.peer_id for runtime, ban in zip(runtimes[1:], bans) if ban}
            for _ in range(3):
                for tensor in tensors:
                    tensor.copy_(torch.randn(NUMEL, generator=generator))
                reports = (await asyncio.gather(*(averager.step(weight=1.0) for averager in averagers)))[1:]
                for runtime, report in zip(runtimes[1:], reports):
                    # no round fails; a banner sits a round out rather than share a group with the liar
                    # (an honest peer that has not banned it may still be in the liar's group)
                    assert report.ok or report.error.startswith("no group formed"), report.error
                    assert liar not in report.group or runtime.peer_id not in banners, report.group

    run_async(scenario())
