"""Round results kept by donors, on real p2pd nodes: what a peer that missed a round replays
(state/results.py). The joiner and donors of test_state_transfer.py, a swarm of this module's own."""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import torch
from conftest import joiner_and_donors
from test_state_transfer import donor_ids, new_protocol, run

from swarmgrad.averaging.codecs import get_codec
from swarmgrad.averaging.frames import decode_chunk, encode_chunk
from swarmgrad.averaging.layout import Schema
from swarmgrad.averaging.result_frames import ResultDecoder
from swarmgrad.net.wire import RemoteError
from swarmgrad.state import server as state_server
from swarmgrad.state.results import download_result, download_result_digest, result_digest
from swarmgrad.state.server import StateServer
from swarmgrad.state.snapshot import StateTransferError


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

    assert state_server.KEPT_RESULTS == 2
    assert torch.equal(run(swarm, scenario(3)), results[3]) and torch.equal(run(swarm, scenario(2)), results[2])
    with pytest.raises(StateTransferError, match="result of round 1 is not kept here"):
        run(swarm, scenario(1))


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


def travelled_in_q2(values: torch.Tensor) -> tuple[Schema, torch.Tensor, list[tuple[dict, bytes]]]:
    """A result as a q2 round hands it to every member: each chunk encoded by its owner, decoded."""
    schema, codec = Schema.of([("w", values)], chunk_elements=4096), get_codec("q2")
    frames, result = [], torch.empty_like(values)
    for chunk in schema.chunks:
        header, payload = encode_chunk(codec, values[chunk.start : chunk.start + chunk.length].view(chunk.view))
        frames.append(({"t": "avg", "c": chunk.index, **header}, bytes(payload)))
        result[chunk.start : chunk.start + chunk.length] = decode_chunk(codec, header, payload, chunk.view)
    return schema, result, frames


def test_a_result_kept_with_its_frames_comes_in_them_to_the_bit(swarm):
    """A donor that kept the frames a round travelled in keeps only those (q2: 0.31 bytes an element,
    against bfloat16's 2) and serves them to a peer that can decode them: it gets exactly the float32
    values the donor applied, and they still have the digest the donor names (that of their bfloat16
    bytes). A peer that cannot decode frames is told so. Frames out of order are refused."""
    schema, result, frames = travelled_in_q2(torch.randn(20_000, generator=torch.Generator().manual_seed(7)))
    decoder = ResultDecoder(schema, get_codec("q2"))
    assert sum(len(payload) for _, payload in frames) < result.numel() * 2 / 6

    async def scenario(kept_frames):
        protocol = new_protocol()
        donor = donor_ids(swarm)[:1]
        async with AsyncExitStack() as stack:
            server = await stack.enter_async_context(StateServer(swarm.transports[1], protocol))
            server.publish_result(5, result, kept_frames)
            digest = await download_result_digest(swarm.transports[0], protocol, donor[0], 5)
            assert server.held_bytes()["kept_results"] == sum(len(payload) for _, payload in kept_frames)
            framed = await download_result(swarm.transports[0], protocol, donor, 5, result.numel(), digest=digest,
                                           decoder=decoder)
            with pytest.raises(StateTransferError, match="kept only in the frames"):
                await download_result(swarm.transports[0], protocol, donor, 5, result.numel(), digest=digest)
            return framed

    framed = run(swarm, scenario(frames))
    assert torch.equal(framed, result)
    with pytest.raises(StateTransferError, match="expected the result's chunk 0"):
        run(swarm, scenario(frames[1:] + frames[:1]))


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

    with pytest.raises(StateTransferError, match="2000 bytes exceeds" if bad == "size" else "NaN or Inf"):
        run(swarm, scenario())
