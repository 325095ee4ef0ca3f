"""The direct data plane: encrypted TCP set up through libp2p, with fallback, on real p2pd nodes."""

import asyncio
import socket
import time
from contextlib import AsyncExitStack

import pytest
import torch
from conftest import packed, run_async

from swarmgrad.averaging import Averager, Moshpit
from swarmgrad.dht import NodeConfig, SwarmNode
from swarmgrad.net.direct import TOKEN_BYTES, DirectTransport
from swarmgrad.net.network_runtime import NetworkRuntime
from swarmgrad.net.secure import FrameCipher
from swarmgrad.net.transport import Libp2pTransport
from swarmgrad.net.wire import FrameError, RemoteError
from swarmgrad.state.server import StateServer, state_protocol
from swarmgrad.state.snapshot import StateSnapshot
from swarmgrad.state.transfer import download_state

PROTOCOL = "test/direct-echo"
# a float32 pattern that random data never contains: the plaintext we look for on the wire
MARKER = torch.tensor([1234.5678, -8765.4321, 3.1415926, 2.7182818] * 2048)


async def echo(channel):
    """Echo one frame back (the exchange this test protocol defines)."""
    frame = await channel.recv()
    await channel.send(frame.header, frame.payload)


async def two_nodes(
    stack: AsyncExitStack, second_options: dict | None = None, **direct_options
) -> tuple[DirectTransport, DirectTransport, SwarmNode]:
    first = await stack.enter_async_context(SwarmNode())
    second = await stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first.maddrs)))
    transports = []
    for node, options in ((first, direct_options), (second, direct_options if second_options is None else second_options)):
        transport = DirectTransport(Libp2pTransport(node.p2p), **options)
        await transport.start()
        stack.push_async_callback(transport.stop)
        await transport.serve(PROTOCOL, echo)
        transports.append(transport)
    return transports[0], transports[1], second


class WireTap:
    """A TCP relay on loopback that records every byte it forwards, in both directions."""

    def __init__(self, target: tuple[str, int], drop_after: int | None = None, flip_byte_at: int | None = None):
        self.target, self.seen = target, bytearray()
        self.flip_byte_at = flip_byte_at
        self.server: asyncio.Server | None = None

    async def start(self) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return "127.0.0.1", self.server.sockets[0].getsockname()[1]

    async def _relay(self, client_reader, client_writer):
        server_reader, server_writer = await asyncio.open_connection(*self.target)

        async def pipe(reader, writer, tamper: bool):
            while data := await reader.read(65536):
                if tamper and self.flip_byte_at is not None and len(self.seen) <= self.flip_byte_at < len(self.seen) + len(data):
                    data = bytearray(data)
                    data[self.flip_byte_at - len(self.seen)] ^= 0xFF
                    data = bytes(data)
                self.seen.extend(data)
                writer.write(data)
                await writer.drain()
            writer.close()

        await asyncio.gather(pipe(client_reader, server_writer, True), pipe(server_reader, client_writer, False),
                             return_exceptions=True)

    async def stop(self):
        self.server.close()


def test_direct_channel_is_used_when_reachable_and_encrypted_on_the_wire():
    async def scenario():
        async with AsyncExitStack() as stack:
            first, second, second_node = await two_nodes(stack)
            tap = WireTap(second.addresses[0])
            second.addresses = [await tap.start()]  # the only way to reach the second peer is through the tap
            channel = await first.open(second_node.peer_id, PROTOCOL)
            assert channel.transport_name == "direct"
            payload = MARKER.numpy().tobytes()
            await channel.send({"t": "data", "n": 1}, payload)
            frame = await channel.recv()
            assert frame.header["n"] == 1 and bytes(frame.payload) == payload
            await channel.close()
            await tap.stop()
            assert len(tap.seen) > 2 * len(payload)  # the data did cross the tap
            assert payload[:64] not in tap.seen  # but never as plaintext

    run_async(scenario())


def test_trusted_network_sends_plaintext_only_when_both_sides_opt_in():
    async def scenario():
        async with AsyncExitStack() as stack:
            first, second, second_node = await two_nodes(stack, trusted_network=True)
            tap = WireTap(second.addresses[0])
            second.addresses = [await tap.start()]
            channel = await first.open(second_node.peer_id, PROTOCOL)
            assert channel.transport_name == "direct-plain"
            payload = MARKER.numpy().tobytes()
            await channel.send({"t": "data"}, payload)
            await channel.recv()
            await channel.close()
            assert payload[:64] in tap.seen

        async with AsyncExitStack() as stack:  # only the opening side trusts the network: encrypted
            first, _, second_node = await two_nodes(stack, second_options={}, trusted_network=True)
            channel = await first.open(second_node.peer_id, PROTOCOL)
            assert channel.transport_name == "direct"
            await channel.close()

    run_async(scenario())


def test_one_connection_per_peer_pair_is_reused_across_exchanges():
    async def scenario():
        async with AsyncExitStack() as stack:
            first, second, second_node = await two_nodes(stack)
            tap = WireTap(second.addresses[0])
            second.addresses = [await tap.start()]
            connections = 0
            original = tap._relay

            async def counting(reader, writer):
                nonlocal connections
                connections += 1
                await original(reader, writer)

            tap.server.close()
            tap.server = await asyncio.start_server(counting, *second.addresses[0])
            for n in range(5):
                channel = await first.open(second_node.peer_id, PROTOCOL)
                await channel.send({"t": "data", "n": n}, b"x" * 1000)
                assert (await channel.recv()).header["n"] == n
                await channel.close()
            assert connections == 1
            await tap.stop()

    run_async(scenario())


@pytest.mark.parametrize("unreachable", ["nothing listening", "wrong address", "blackholed port"])
def test_fallback_to_libp2p_when_the_data_port_cannot_be_reached(unreachable):
    async def scenario():
        async with AsyncExitStack() as stack:
            first, second, second_node = await two_nodes(stack, connect_timeout=1.0)
            if unreachable == "nothing listening":
                with socket.socket() as probe:  # a port that was free a moment ago
                    probe.bind(("127.0.0.1", 0))
                    second.addresses = [("127.0.0.1", probe.getsockname()[1])]
            elif unreachable == "wrong address":
                second.addresses = [("127.0.0.1", 1)]
            else:  # accepts nothing: a listening socket whose backlog we never serve, full
                blocked = socket.socket()
                blocked.bind(("127.0.0.1", 0))
                blocked.listen(0)
                stack.callback(blocked.close)
                fillers = []
                for _ in range(8):
                    filler = socket.socket()
                    filler.setblocking(False)
                    filler.connect_ex(blocked.getsockname())
                    fillers.append(filler)
                    stack.callback(filler.close)
                second.addresses = [blocked.getsockname()]
            channel = await first.open(second_node.peer_id, PROTOCOL)
            assert channel.transport_name == "libp2p"
            await channel.send({"t": "data", "n": 7}, b"hello")
            frame = await channel.recv()
            assert frame.header["n"] == 7 and bytes(frame.payload) == b"hello"
            await channel.close()
            # remembered: the next open goes straight to libp2p
            again = await asyncio.wait_for(first.open(second_node.peer_id, PROTOCOL), timeout=5)
            assert again.transport_name == "libp2p"
            await again.close()

    run_async(scenario())


@pytest.mark.parametrize("token", [b"", b"\x00" * TOKEN_BYTES, b"x" * 5])
def test_connection_without_a_valid_token_is_closed(token):
    async def scenario():
        async with AsyncExitStack() as stack:
            _, second, _ = await two_nodes(stack)
            reader, writer = await asyncio.open_connection(*second.addresses[0])
            writer.write(token)
            if token:
                await writer.drain()
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), timeout=10) == b""  # closed, nothing said
            writer.close()
            assert second._pending == {}

    run_async(scenario())


def test_replayed_or_modified_frames_are_rejected():
    key = bytes(range(32))
    sender, receiver = FrameCipher(key, sending=0), FrameCipher(key, sending=1)
    first, second = sender.seal(b"frame one"), sender.seal(b"frame two")
    assert receiver.open(first) == b"frame one"
    with pytest.raises(Exception):
        receiver.open(first)  # replayed: the receiver expects message 1 now
    tampered = bytearray(second)
    tampered[3] ^= 1
    with pytest.raises(Exception):
        FrameCipher(key, sending=1).open(tampered)
    reordered = FrameCipher(key, sending=1)
    with pytest.raises(Exception):
        reordered.open(second)  # message 1 before message 0

    async def scenario():
        async with AsyncExitStack() as stack:
            first_t, second_t, second_node = await two_nodes(stack)
            tap = WireTap(second_t.addresses[0], flip_byte_at=TOKEN_BYTES + 40)  # inside the first sealed frame
            second_t.addresses = [await tap.start()]
            channel = await first_t.open(second_node.peer_id, PROTOCOL)
            assert channel.transport_name == "direct"
            await channel.send({"t": "data"}, MARKER.numpy().tobytes())
            with pytest.raises((RemoteError, EOFError, FrameError, ConnectionError)):
                await asyncio.wait_for(channel.recv(), timeout=10)  # the receiver refused the frame
            await channel.close()

    run_async(scenario())


def test_averaging_reports_the_transport_of_each_peer():
    async def scenario():
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(SwarmNode())
            nodes = [first] + [await stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first.maddrs)))
                               for _ in range(2)]
            tensors = [[torch.full((70_000,), float(i))] for i in range(3)]
            options = [dict(direct=True), dict(direct=True, trusted_network=True), dict(direct=False)]
            runtimes = [await stack.enter_async_context(NetworkRuntime("direct-run", node=node, **option))
                        for node, option in zip(nodes, options)]
            settings = Moshpit(group_size=3, matchmaking_seconds=1.0)
            averagers = [await stack.enter_async_context(
                Averager(runtime, ts, settings=settings, grid_dims=1, codec="none"))
                for runtime, ts in zip(runtimes, tensors)]
            reports = await asyncio.gather(*(a.step() for a in averagers))
            assert all(r.ok for r in reports), [r.error for r in reports]
            for ts in tensors:
                assert torch.equal(ts[0], torch.full((70_000,), 1.0))
            # the libp2p-only peer opens libp2p streams; the others reach each other directly, encrypted
            # (plaintext needs both sides to trust the network)
            assert set(reports[2].transports.values()) == {"libp2p"}
            direct_peers = {nodes[0].peer_id, nodes[1].peer_id}
            for report, node in zip(reports[:2], nodes[:2]):
                other = (direct_peers - {node.peer_id}).pop()
                if other in report.transports:
                    assert report.transports[other] == "direct"

    run_async(scenario())


def test_state_server_answers_over_the_direct_data_plane():
    """A joiner's download from a donor's runtime runs on the direct TCP connection: the state's
    bytes cross the donor's data port (through a tap), encrypted. The joiner says ``done`` at the
    end, so the connection ends cleanly, goes back to the pool, and the next download reuses it."""

    async def scenario():
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(SwarmNode())
            second = await stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first.maddrs)))
            donor = await stack.enter_async_context(NetworkRuntime("state-run", node=first))
            joiner = await stack.enter_async_context(NetworkRuntime("state-run", node=second))
            served = await stack.enter_async_context(StateServer(donor.transport, state_protocol("state-run")))
            assert isinstance(donor.transport, DirectTransport) and isinstance(joiner.transport, DirectTransport)
            connections = 0
            tap = WireTap(donor.transport.addresses[0])

            async def counting(reader, writer):
                nonlocal connections
                connections += 1
                await tap._relay(reader, writer)

            tap.server = await asyncio.start_server(counting, "127.0.0.1", 0)
            donor.transport.addresses = [tap.server.sockets[0].getsockname()]  # the data port is only behind the tap
            snapshot = StateSnapshot.capture(3, {"model/w": MARKER.repeat(128), "model/b": torch.randn(10)},
                                             {"epoch": 3})
            served.publish(snapshot)
            opened = []
            open_channel = joiner.transport.open

            async def recording_open(peer_id, protocol):
                channel = await open_channel(peer_id, protocol)
                opened.append(channel)
                return channel

            joiner.transport.open = recording_open
            for download in range(2):
                started = time.monotonic()
                got = await download_state(joiner.transport, served.protocol, [donor.peer_id], seconds=20)
                assert time.monotonic() - started < 3  # no wait for an end that never comes
                assert got.version == 3 and torch.equal(packed(got), snapshot.data)
                assert opened[download].transport_name == "direct"
                assert len(joiner.transport._idle.get(donor.peer_id, [])) == 1  # ended cleanly: pooled
            assert opened[0] is opened[1] and connections == 1  # one connection, reused
            assert len(tap.seen) > 2 * snapshot.nbytes  # both downloads crossed the data port...
            assert MARKER.numpy().tobytes()[:64] not in tap.seen  # ...encrypted
            await tap.stop()

    run_async(scenario())


@pytest.mark.parametrize("reconnect", [True, False])
def test_a_stream_p2pd_cannot_route_is_opened_at_the_published_addresses(reconnect):
    """A node with no DHT peers of its own cannot find a member through p2pd; the member's presence
    record gave its addresses, and the libp2p transport connects to them and opens the stream. Off,
    the open fails as it did in CI (a ControlFailure, and the round's groupmates waited out the deadline)."""
    from hivemind.p2p import P2PDaemonError

    async def scenario():
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(SwarmNode())
            member = await stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first.maddrs)))
            await Libp2pTransport(member.p2p).serve(PROTOCOL, echo)
            loner = await stack.enter_async_context(SwarmNode())  # nobody to ask where the member is
            loner.remember_addresses(member.peer_id, member.maddrs)  # what its presence record says
            transport = Libp2pTransport(loner.p2p, reconnect=loner.reconnect if reconnect else None)
            if not reconnect:
                with pytest.raises(P2PDaemonError):
                    await transport.open(member.peer_id, PROTOCOL)
                return
            channel = await transport.open(member.peer_id, PROTOCOL)
            await channel.send({"t": "ping"}, b"hello")
            frame = await channel.recv(max_payload=16)
            assert frame.header["t"] == "ping" and bytes(frame.payload) == b"hello"
            await channel.close()

    run_async(scenario())
