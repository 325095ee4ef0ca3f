"""Malformed input never changes state and never stops a peer from serving (DESIGN invariant 4)."""

import asyncio
import math
from contextlib import AsyncExitStack

import msgpack
import pytest
import torch
from conftest import run_async
from hivemind.p2p import P2P, PeerID

from swarmgrad.averaging import Averager, GroupAllReduce, GroupPlan, Moshpit, get_codec
from swarmgrad.averaging.frames import encoded_to_frame
from swarmgrad.averaging.layout import Schema
from swarmgrad.dht import NodeConfig, SwarmNode
from swarmgrad.net.network_runtime import NetworkRuntime
from swarmgrad.net.transport import Libp2pTransport, StreamChannel
from swarmgrad.net.wire import PREFIX, FrameError, RemoteError, expect_kind, pack_prefix_and_header


def frame_bytes(header: dict, payload: bytes = b"") -> bytes:
    return pack_prefix_and_header(header, len(payload)) + payload


async def read_channel(data: bytes) -> StreamChannel:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return StreamChannel("peer", reader, None, "memory")  # type: ignore[arg-type]


@pytest.mark.parametrize("data, message", [
    (b"\x00\x00\x00\x05\x00\x00\x00\x00\xc1\xc1\xc1\xc1\xc1", "not msgpack"),
    (PREFIX.pack(10**6, 0), "header"),
    (PREFIX.pack(5, 0xFFFFFFFF) + b"x" * 5, "exceeds the limit"),
    (PREFIX.pack(3, 0) + msgpack.packb([1, 2]), "must be a map"),
    (PREFIX.pack(len(msgpack.packb({"t": "x", "v": 99})), 0) + msgpack.packb({"t": "x", "v": 99}), "wire version"),
])
def test_malformed_frames_are_rejected_before_allocation(data, message):
    async def scenario():
        channel = await read_channel(data)
        with pytest.raises(FrameError, match=message):
            await channel.recv(max_payload=1024)

    run_async(scenario())


def test_truncated_frames_and_error_frames():
    async def scenario():
        whole = frame_bytes({"t": "chunk", "c": 1}, b"x" * 100)
        with pytest.raises(EOFError):
            await (await read_channel(whole[:-10])).recv()
        with pytest.raises(RemoteError, match="go away"):
            await (await read_channel(frame_bytes({"t": "error", "message": "go away"}))).recv()
        frame = await (await read_channel(whole)).recv()
        assert frame.header["c"] == 1 and frame.payload == b"x" * 100

    run_async(scenario())


def test_garbage_on_the_averaging_protocol_gets_an_error_and_the_peer_keeps_serving():
    async def scenario():
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(SwarmNode())
            second = await stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first.maddrs)))
            tensors = [[torch.full((1000,), 1.0)], [torch.full((1000,), 3.0)]]
            runtimes = [await stack.enter_async_context(NetworkRuntime("robust", node=node))
                        for node in (first, second)]
            settings = Moshpit(group_size=2, matchmaking_seconds=0.3)
            averagers = [await stack.enter_async_context(
                Averager(runtime, ts, settings=settings, grid_dims=1, codec="none"))
                for runtime, ts in zip(runtimes, tensors)]
            attacker = await P2P.create(initial_peers=first.maddrs, nat_port_map=False, auto_nat=False)
            try:
                victim = PeerID.from_base58(first.peer_id)
                attacks = [
                    b"\xff" * 64,  # random bytes: an absurd header length
                    PREFIX.pack(8, 0xFFFFFFFF) + b"\x00" * 8,  # claims a 4 GiB payload
                    frame_bytes({"t": "part", "round": "no-such-round", "weight": 1.0}),
                    frame_bytes({"t": "chunk", "c": 0}),  # not the opening frame
                ]
                for data in attacks:
                    _, reader, writer = await attacker.call_binary_stream_handler(victim, averagers[0]._allreduce_protocol)
                    writer.write(data)
                    await writer.drain()
                    channel = StreamChannel(first.peer_id, reader, writer, "libp2p")
                    with pytest.raises((RemoteError, EOFError)):
                        await asyncio.wait_for(channel.recv(), timeout=15)
                    await channel.close()
                assert torch.equal(tensors[0][0], torch.full((1000,), 1.0))
                reports = await asyncio.gather(*(a.step() for a in averagers))  # still serving
                assert all(r.ok for r in reports), [r.error for r in reports]
                assert torch.equal(tensors[0][0], torch.full((1000,), 2.0))
            finally:
                await attacker.shutdown()

    run_async(scenario())


def _chunk_frame(index: int, values: torch.Tensor, **overrides) -> tuple[dict, bytes]:
    header, payload = encoded_to_frame(get_codec("none").encode(values))
    header["enc"].update(overrides.pop("enc", {}))
    header.update(overrides)
    return {"t": "chunk", "c": index, **header}, overrides.pop("payload", payload)


NAN = torch.tensor([math.nan] * 100)
BAD_CHUNKS = {
    "wrong shape": lambda: _chunk_frame(0, torch.zeros(50)),
    "wrong dtype": lambda: _chunk_frame(0, torch.zeros(100), enc={"dtype": "int64"}),
    "NaN values": lambda: ({"t": "chunk", "c": 0, **encoded_to_frame(get_codec("none").encode(torch.zeros(100)))[0]},
                           NAN.numpy().tobytes()),
    "huge declared size": lambda: _chunk_frame(0, torch.zeros(100), enc={"shape": [10**12]}),
    "size mismatch": lambda: ({**_chunk_frame(0, torch.zeros(100))[0], "sizes": [["data", 10]]}, b"x" * 400),
    "unknown chunk": lambda: _chunk_frame(7, torch.zeros(100)),
}


@pytest.mark.parametrize("case", sorted(BAD_CHUNKS))
def test_bad_contribution_inside_a_round_fails_it_cleanly(case):
    async def scenario():
        async with SwarmNode() as owner:
            attacker = await P2P.create(initial_peers=owner.maddrs, nat_port_map=False, auto_nat=False)
            try:
                tensor = torch.arange(100, dtype=torch.float32)
                schema = Schema.of([("w", tensor)])
                plan = GroupPlan("round-x", (owner.peer_id, attacker.peer_id.to_base58()), (1.0, 0.0), "none",
                                 schema.digest)
                flat = tensor.clone()
                transport = Libp2pTransport(owner.p2p)
                allreduce = GroupAllReduce(plan, owner.peer_id, schema, flat, 1.0, get_codec("none"), transport,
                                           "test/allreduce")

                async def serve(channel):
                    await allreduce.accept(channel, expect_kind(await channel.recv(0), "part"))

                await transport.serve("test/allreduce", serve)
                run = asyncio.ensure_future(allreduce.run(10.0))
                _, reader, writer = await attacker.call_binary_stream_handler(
                    PeerID.from_base58(owner.peer_id), "test/allreduce")
                channel = StreamChannel(owner.peer_id, reader, writer, "libp2p")
                await channel.send({"t": "part", "round": "round-x", "weight": 1.0})
                header, payload = BAD_CHUNKS[case]()
                await channel.send(header, payload)
                with pytest.raises((RemoteError, EOFError)):
                    await asyncio.wait_for(channel.recv(), timeout=10)
                report = await run
                assert not report.ok and "invalid frame" in report.error, report.error
                assert torch.equal(flat, tensor)  # the contribution buffer is untouched
            finally:
                await attacker.shutdown()

    run_async(scenario())


# ---- typed header fields and error frames, without a stream -------------------------------------

def test_typed_fields_accept_what_they_say_and_name_what_they_refuse():
    from swarmgrad.net.wire import Frame, error_header, field, int_field

    header = {"w": 3, "f": 2.5, "b": True, "s": "x", "n": 7}
    assert field(header, "w", float) == 3.0 and type(field(header, "w", float)) is float  # msgpack packs 3.0 as 3
    assert field(header, "f", float) == 2.5 and field(header, "s", str) == "x"
    assert field(header, "w", int) == 3 and type(field(header, "w", int)) is int
    assert field(header, "f", (int, float)) == 2.5
    with pytest.raises(FrameError, match="^frame field 'b' must be int, got bool$"):
        field(header, "b", int)
    with pytest.raises(FrameError, match="^frame field 'f' must be int, got float$"):
        field(header, "f", int)
    with pytest.raises(FrameError, match="^frame field 's' must be int/float, got str$"):
        field(header, "s", (int, float))
    with pytest.raises(FrameError, match="^frame field 'missing' must be str, got NoneType$"):
        field(header, "missing", str)
    with pytest.raises(FrameError, match="^frame field 'w' must be str, got int$"):
        field(header, "w", str)
    assert int_field(header, "n", 7, 7) == 7 and int_field(header, "n", 0, 10) == 7
    for low, high in ((8, 10), (0, 6)):
        with pytest.raises(FrameError, match=rf"^frame field 'n'=7 is outside {low}\.\.{high}$"):
            int_field(header, "n", low, high)
    with pytest.raises(FrameError, match="^frame field 'b' must be int, got bool$"):
        int_field(header, "b", 0, 1)
    assert error_header("x" * 600) == {"t": "error", "message": "x" * 500}
    with pytest.raises(FrameError, match="^expected a 'ack' frame, got 'push'$"):
        expect_kind(Frame({"t": "push"}), "ack")
    frame = Frame({"t": "ack"}, b"abc")
    assert expect_kind(frame, "ack") is frame and frame.kind == "ack"


def test_header_limits_are_exact():
    from swarmgrad.net.wire import MAX_HEADER_BYTES, check_lengths, parse_header

    check_lengths(1, 10, 10)
    check_lengths(MAX_HEADER_BYTES, 0, 0)
    for header_length in (0, MAX_HEADER_BYTES + 1):
        with pytest.raises(FrameError, match=rf"^frame header of {header_length} bytes is outside 1\.\.65536$"):
            check_lengths(header_length, 0, 10)
    with pytest.raises(FrameError, match="^frame payload of 11 bytes exceeds the limit of 10$"):
        check_lengths(1, 11, 10)
    largest = {"t": "x", "pad": "p" * (MAX_HEADER_BYTES - 20)}
    while len(pack_prefix_and_header(largest, 0)) - PREFIX.size < MAX_HEADER_BYTES:
        largest["pad"] += "p"
    assert len(pack_prefix_and_header(largest, 0)) - PREFIX.size == MAX_HEADER_BYTES
    largest["pad"] += "p"
    with pytest.raises(FrameError, match=rf"^header of {MAX_HEADER_BYTES + 1} bytes exceeds {MAX_HEADER_BYTES}$"):
        pack_prefix_and_header(largest, 0)
    with pytest.raises(FrameError, match="^frame header is not msgpack: "):
        parse_header(b"\xc1")
    with pytest.raises(FrameError, match="^frame header must be a map with a string field 't'$"):
        parse_header(msgpack.packb({"t": 1, "v": 1}))
    with pytest.raises(FrameError, match=r"^unsupported wire version None \(this peer speaks 1\)$"):
        parse_header(msgpack.packb({"t": "x"}))
    with pytest.raises(FrameError, match=r"^unsupported wire version 2 \(this peer speaks 1\)$"):
        parse_header(msgpack.packb({"t": "x", "v": 2}))
    with pytest.raises(FrameError, match="^frame header is not msgpack: "):  # keys are strings only
        parse_header(msgpack.packb({"t": "x", "v": 1, 7: "seven"}))
    with pytest.raises(FrameError, match="^frame header is not msgpack: "):  # no bin field above the limit
        parse_header(msgpack.packb({"t": "x", "v": 1, "b": b"x" * (MAX_HEADER_BYTES + 1)}))
    with pytest.raises(RemoteError, match="^unspecified error$"):
        parse_header(msgpack.packb({"t": "error", "v": 1}))
    with pytest.raises(RemoteError, match="^y{500}$"):
        parse_header(msgpack.packb({"t": "error", "v": 1, "message": "y" * 900}))
