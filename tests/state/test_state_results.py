"""Round results kept by donors, on real p2pd nodes: what a peer that missed a round replays
(state/results.py). The joiner and donors of test_state_transfer.py, a swarm of this module's own."""

from __future__ import annotations

import asyncio
import math
from contextlib import AsyncExitStack, asynccontextmanager
from types import SimpleNamespace

import pytest
import torch
from conftest import joiner_and_donors, travelled_in
from test_state_transfer import donor_ids, new_protocol, run

from swarmgrad.averaging.codecs import get_codec
from swarmgrad.averaging.result_frames import ResultDecoder
from swarmgrad.net.wire import RemoteError
from swarmgrad.state import kept as state_kept
from swarmgrad.state import results as state_results
from swarmgrad.state.results import download_result, download_result_digest, download_result_in_parts, result_digest
from swarmgrad.state.server import StateServer
from swarmgrad.state.snapshot import StateSnapshot, StateTransferError


@pytest.fixture(scope="module")
def swarm():
    with joiner_and_donors("state-results-test", 2) as started:
        yield started



@asynccontextmanager
async def keeping_results(swarm, protocol: str, kept: list[dict[int, torch.Tensor]]):
    """Donor i keeps the round results kept[i] (epoch -> flat tensor)."""
    async with AsyncExitStack() as stack:
        for transport, results in zip(swarm.transports[1:], kept):
            server = await stack.enter_async_context(StateServer(transport, protocol))
            for epoch, result in results.items():
                server.publish_result(epoch, result)
        yield


def test_a_round_result_comes_as_bfloat16_from_the_donor_that_kept_it(swarm):
    result = torch.randn(300_001, generator=torch.Generator().manual_seed(5))

    async def scenario():
        protocol = new_protocol()
        async with keeping_results(swarm, protocol, [{}, {7: result}]):
            return await download_result(swarm.transports[0], protocol, donor_ids(swarm), 7, result.numel())

    got = run(swarm, scenario())
    assert got.dtype == torch.float32 and torch.equal(got, result.to(torch.bfloat16).float())
    assert torch.allclose(got, result, rtol=2**-8, atol=0)


def test_a_donor_keeps_only_its_last_results(swarm):
    results = {epoch: torch.full((10,), float(epoch)) for epoch in range(1, 4)}

    async def scenario(epoch: int):
        protocol = new_protocol()
        async with keeping_results(swarm, protocol, [results]):
            return await download_result(swarm.transports[0], protocol, donor_ids(swarm)[:1], epoch, 10)

    assert state_kept.KEPT_RESULTS == 2
    assert torch.equal(run(swarm, scenario(3)), results[3]) and torch.equal(run(swarm, scenario(2)), results[2])
    with pytest.raises(StateTransferError, match="result of round 1 is not kept here"):
        run(swarm, scenario(1))


def test_a_donor_that_never_answers_is_named_with_its_timeout(swarm):
    """A timeout's own text is empty: the failure names the exception (a 10 Mbit/s lab run logged
    "2 of 3 asked: A: ; B: ", which says nothing of why)."""

    async def silent(channel):
        await asyncio.sleep(30)

    async def scenario():
        protocol = new_protocol()
        await swarm.transports[1].serve(protocol, silent)
        try:
            return await download_result(swarm.transports[0], protocol, donor_ids(swarm)[:1], 3, 10, seconds=0.5)
        finally:
            await swarm.transports[1].stop_serving(protocol)

    with pytest.raises(StateTransferError, match=r"1 of 1 asked: \S+: TimeoutError\)"):
        run(swarm, scenario())


def test_donors_name_the_digest_of_the_result_they_keep_and_a_download_checks_it(swarm):
    """A donor names the sha256 of the result's bytes it keeps (two donors, two results here); a
    download given one digest skips a donor whose bytes do not have it."""
    result = torch.randn(50_000, generator=torch.Generator().manual_seed(6))
    other = result.clone()
    other[123] += 1.0

    async def scenario():
        protocol = new_protocol()
        async with keeping_results(swarm, protocol, [{2: other}, {2: result}]):
            donors = donor_ids(swarm)
            named = [await download_result_digest(swarm.transports[0], protocol, donor, 2) for donor in donors]
            got = await download_result(swarm.transports[0], protocol, donors, 2, result.numel(), digest=named[1])
            with pytest.raises(StateTransferError, match="not the one it and others described"):
                await download_result(swarm.transports[0], protocol, donors[:1], 2, result.numel(), digest=named[1])
            with pytest.raises(RemoteError, match="not kept here"):
                await download_result_digest(swarm.transports[0], protocol, donors[0], 3)
            return named, got

    named, got = run(swarm, scenario())
    assert named[1] == result_digest(result.to(torch.bfloat16)) and named[0] != named[1]
    assert torch.equal(got, result.to(torch.bfloat16).float())


async def on_disk(server: StateServer, epoch: int) -> None:
    """Until the donor's thread wrote round ``epoch``'s result to disk."""
    for _ in range(500):
        if server.results[epoch].on_disk:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the result of round {epoch} was not written to disk in 5 s")


def test_a_result_kept_with_its_frames_comes_in_them_to_the_bit(swarm):
    """A donor that kept the frames a round travelled in keeps only those (q2: 0.31 bytes an element,
    against bfloat16's 2) and serves them to a peer that can decode them: it gets them as they came
    (no float32 copy), which read exactly the float32 values the donor applied, and they still have
    the digest the donor names (that of their bfloat16 bytes). A peer that cannot decode frames is
    told so. Frames out of order are refused."""
    schema, result, frames = travelled_in(torch.randn(20_000, generator=torch.Generator().manual_seed(7)), "q2")
    decoder = ResultDecoder(schema, get_codec("q2"))
    assert sum(len(payload) for _, payload in frames) < result.numel() * 2 / 6

    async def scenario(kept_frames):
        protocol = new_protocol()
        donor = donor_ids(swarm)[:1]
        async with AsyncExitStack() as stack:
            server = await stack.enter_async_context(StateServer(swarm.transports[1], protocol))
            server.publish_result(5, result, kept_frames)
            await on_disk(server, 5)  # served from the file it was written to (state/kept.py)
            digest = await download_result_digest(swarm.transports[0], protocol, donor[0], 5)
            assert server.results.nbytes() == sum(len(payload) for _, payload in kept_frames)
            framed = await download_result(swarm.transports[0], protocol, donor, 5, result.numel(), digest=digest,
                                           decoder=decoder)
            with pytest.raises(StateTransferError, match="kept only in the frames"):
                await download_result(swarm.transports[0], protocol, donor, 5, result.numel(), digest=digest)
            return framed

    framed = run(swarm, scenario(frames))
    assert not isinstance(framed, torch.Tensor) and [p for _, p in framed.frames] == [p for _, p in frames]
    assert torch.equal(framed.dense(), result) and torch.equal(framed[100:15_000], result[100:15_000])
    with pytest.raises(StateTransferError, match="expected the result's chunk 0"):
        run(swarm, scenario(frames[1:] + frames[:1]))


@pytest.mark.parametrize("donor", ["honest", "corrupt", "older"])
def test_a_result_comes_in_parts_from_the_donors_that_named_it(swarm, donor):
    """Donors that named the same digest hold the very same frames: each sends a share of them at
    once, and the parts are checked as one result (headers, finite, the digest). A donor whose part
    is not what it named, or one that does not know parts (sends every frame), fails the whole: the
    caller then takes the result from one donor."""
    schema, result, frames = travelled_in(torch.randn(60_000, generator=torch.Generator().manual_seed(9)), "q2")
    decoder = ResultDecoder(schema, get_codec("q2"))
    sent: list[list[int]] = [[], []]

    class Donor(StateServer):
        index = 0

        async def _serve(self, channel) -> None:
            send = channel.send

            async def watched_send(header, payload=b""):
                if header.get("t") == "avg":
                    sent[self.index].append(header["c"])
                    if donor == "corrupt" and self.index == 1:
                        payload = bytes(reversed(bytes(payload)))
                await send(header, payload)

            async def older_recv(*args, **kwargs):
                request = await receive(*args, **kwargs)
                request.header.pop("first", None)  # a donor from before parts: it sends every frame
                request.header.pop("count", None)
                return request

            receive = channel.recv
            channel.send = watched_send
            if donor == "older" and self.index == 1:
                channel.recv = older_recv
            await super()._serve(channel)

    async def scenario():
        protocol = new_protocol()
        async with AsyncExitStack() as stack:
            for index, transport in enumerate(swarm.transports[1:3]):
                server = Donor(transport, protocol)
                server.index = index
                await stack.enter_async_context(server)
                server.publish_result(5, decoder.framed(frames), frames)
            digest = await download_result_digest(swarm.transports[0], protocol, donor_ids(swarm)[0], 5)
            return await download_result_in_parts(swarm.transports[0], protocol, donor_ids(swarm)[:2], 5,
                                                  result.numel(), seconds=30.0, digest=digest, decoder=decoder)

    count = len(frames)
    if donor != "honest":
        with pytest.raises(StateTransferError, match="in parts"):
            run(swarm, scenario())
        return
    framed = run(swarm, scenario())
    assert torch.equal(framed.dense(), result)
    assert sent == [list(range(count // 2)), list(range(count // 2, count))]  # each its share, once


@pytest.mark.parametrize("bad", ["size", "nan"])
def test_a_result_of_another_size_or_not_finite_is_refused(swarm, bad):
    result = torch.ones(1000)
    if bad == "nan":
        result[17] = float("nan")

    async def scenario():
        protocol = new_protocol()
        async with keeping_results(swarm, protocol, [{4: result}]):
            return await download_result(swarm.transports[0], protocol, donor_ids(swarm)[:1], 4,
                                         999 if bad == "size" else 1000)

    with pytest.raises(StateTransferError, match=r"\(999 values\), got 'result' of round 4 \(1000" if bad == "size"
                       else "NaN or Inf"):
        run(swarm, scenario())


def test_a_result_above_the_frame_limit_travels_in_several_frames(swarm, monkeypatch):
    """A result larger than one frame may hold (a lowered RESULT_CHUNK_BYTES stands in for AES-GCM's
    2 GiB) comes in chunks of at most that, read into one tensor; an older peer that does not ask for
    chunks still gets it in one frame."""
    monkeypatch.setattr(state_results, "RESULT_CHUNK_BYTES", 256 * 1024)
    result = torch.randn(1_500_001, generator=torch.Generator().manual_seed(8))  # 3 MB of bfloat16
    sent: list[tuple[str, int]] = []

    class Watched(StateServer):
        async def _serve(self, channel) -> None:
            send = channel.send

            async def watched_send(header, payload=b""):
                sent.append((header["t"], len(payload)))
                await send(header, payload)

            channel.send = watched_send
            await super()._serve(channel)

    async def scenario():
        protocol = new_protocol()
        async with Watched(swarm.transports[1], protocol) as server:
            server.publish_result(3, result)
            await on_disk(server, 3)
            got = await download_result(swarm.transports[0], protocol, donor_ids(swarm)[:1], 3, result.numel())
            channel = await swarm.transports[0].open(donor_ids(swarm)[0], protocol)
            try:
                await channel.send({"t": "result", "epoch": 3})  # an older peer's request
                header, length = await channel.recv_header(max_payload=result.numel() * 2)
                await channel.recv_payload_into(memoryview(bytearray(length)))
                await channel.send({"t": "done"})
            finally:
                await channel.close()
            return got, header, length

    got, header, length = run(swarm, scenario())
    assert torch.equal(got, result.to(torch.bfloat16).float())
    chunks = [size for kind, size in sent if kind == "result-chunk"]
    assert len(chunks) == math.ceil(result.numel() * 2 / (256 * 1024)) == 12
    assert max(chunks) == 256 * 1024 and sum(chunks) == result.numel() * 2
    assert "chunks" not in header and length == result.numel() * 2


@pytest.mark.parametrize("fault", ["short", "order"])
def test_a_result_in_chunks_that_do_not_add_up_is_refused(swarm, monkeypatch, fault):
    monkeypatch.setattr(state_results, "RESULT_CHUNK_BYTES", 64 * 1024)
    result = torch.randn(100_000, generator=torch.Generator().manual_seed(9))

    class Faulty(StateServer):
        async def _serve(self, channel) -> None:
            send = channel.send

            async def faulty_send(header, payload=b""):
                if header["t"] == "result-chunk" and header["index"] == 1:
                    header, payload = ({**header, "index": 2}, payload) if fault == "order" else (header, payload[:-2])
                await send(header, payload)

            channel.send = faulty_send
            await super()._serve(channel)

    async def scenario():
        protocol = new_protocol()
        async with Faulty(swarm.transports[1], protocol) as server:
            server.publish_result(3, result)
            await download_result(swarm.transports[0], protocol, donor_ids(swarm)[:1], 3, result.numel())

    with pytest.raises(StateTransferError, match="expected chunk 1 of the result of round 3" if fault == "order"
                       else "chunk\\(s\\) hold 199998 bytes, expected 200000"):
        run(swarm, scenario())


def test_a_donor_keeps_the_results_a_download_of_its_state_will_replay_within_its_byte_cap(swarm, monkeypatch):
    """A joiner that described version 4 replays the rounds from 4 on once its state is in: the donor
    keeps their results past its last KEPT_RESULTS while the joiner reads and for idle_seconds after
    its last request, each request letting the rounds before it go; within a cap of bytes an element
    beyond the last two (4 here: two bfloat16 results), the oldest dropped first; then as before."""
    clock = [1000.0]
    monkeypatch.setattr(state_kept, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    numel = 1000
    result = {epoch: torch.full((numel,), float(epoch)) for epoch in range(20)}

    async def scenario():
        protocol = new_protocol()
        async with StateServer(swarm.transports[1], protocol, idle_seconds=30.0, held_result_bytes=4.0) as server:
            server.publish(StateSnapshot.capture(4, {"w": torch.zeros(10)}, {}))
            kept = lambda: server.results.epochs()  # noqa: E731

            def publish(*epochs: int) -> None:
                for epoch in epochs:
                    server.publish_result(epoch, result[epoch])

            publish(2, 3)
            channel = await swarm.transports[0].open(donor_ids(swarm)[0], protocol)
            await channel.send({"t": "describe"})
            assert (await channel.recv(max_payload=1 << 20)).header["version"] == 4
            publish(4, 5, 6, 7)  # the swarm goes on while the joiner reads version 4
            reading = kept()
            publish(8)  # past the cap: 4, 5, 6 and 7 held would be 8 bytes an element
            capped, held_bytes = kept(), server.results.nbytes()
            await channel.send({"t": "done"})
            await channel.close()
            while any(hold.channels for hold in server.holds._holds.values()):  # the donor saw it end
                await asyncio.sleep(0.01)
            clock[0] += 29.0  # the joiner's replay comes within idle_seconds of its download's end
            digest = await download_result_digest(swarm.transports[0], protocol, donor_ids(swarm)[0], 7)
            publish(9)
            replaying = kept()
            clock[0] += 31.0  # then it went quiet
            publish(10)
            return reading, capped, held_bytes, replaying, kept(), digest

    reading, capped, held_bytes, replaying, after, digest = run(swarm, scenario())
    assert reading == [4, 5, 6, 7]
    assert capped == [5, 6, 7, 8] and held_bytes == 4 * numel * 2
    assert replaying == [7, 8, 9] and digest == result_digest(result[7])  # asked for 7: 5 and 6 let go
    assert after == [9, 10]  # no joiner needs more: the last KEPT_RESULTS


def test_a_donor_keeps_results_for_a_bounded_number_of_joiners():
    """Any peer may open a channel: at most MAX_RESULT_HOLDERS joiners are remembered, the one idle
    longest forgotten first (the bytes they keep are capped apart from that)."""
    holds = state_kept.ResultHolds(idle_seconds=60.0)
    for index in range(state_kept.MAX_RESULT_HOLDERS):
        holds.reading(f"peer{index}", 100 + index)
        if index:
            holds.read(f"peer{index}")  # its download ended: idle from now on; peer0 still reads
    holds.reading("late", 500)
    assert len(holds._holds) == state_kept.MAX_RESULT_HOLDERS and "peer1" not in holds._holds
    assert holds.floor() == 100  # peer0, still reading, is kept


def test_a_result_kept_as_its_frames_is_named_in_a_thread_and_served_by_its_digest(swarm):
    """A round's average handed over as its frames (``FramedAverage``) is named off the round's path:
    the digest a peer asks for is that of its decoded bfloat16 bytes, as for a float32 result."""
    from swarmgrad.averaging.result_frames import FramedAverage

    schema, result, frames = travelled_in(torch.randn(20_000, generator=torch.Generator().manual_seed(8)), "q2")
    framed = FramedAverage(frames, schema, get_codec("q2"))

    async def scenario():
        protocol = new_protocol()
        async with AsyncExitStack() as stack:
            server = await stack.enter_async_context(StateServer(swarm.transports[1], protocol))
            server.publish_result(4, framed, frames)
            assert server.results.nbytes() == framed.nbytes()
            return await download_result_digest(swarm.transports[0], protocol, donor_ids(swarm)[0], 4)

    assert run(swarm, scenario()) == result_digest(result)
