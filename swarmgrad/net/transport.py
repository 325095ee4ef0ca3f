"""Channels: how two peers exchange frames, independent of what carries them.

The averaging engine talks only to ``Channel`` (send frame, receive frame, close) and
``Transport`` (open a channel to a peer, serve incoming channels). ``Libp2pTransport`` carries
channels over p2pd binary streams; a direct-TCP transport can slot in beside it.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from typing import Awaitable, Callable

from hivemind.p2p import P2P, P2PDaemonError, PeerID

from swarmgrad.net.admission import Admission
from swarmgrad.net.channel import Channel, ChannelHandler
from swarmgrad.net.framestream import FastChannel
from swarmgrad.net.ratelimit import UNLIMITED, RateLimits
from swarmgrad.net.wire import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    PREFIX,
    FrameError,
    check_lengths,
    pack_prefix_and_header,
    parse_header,
)

logger = logging.getLogger(__name__)

# asyncio's 64 KiB defaults pause the socket every few frames; megabyte frames want deeper buffers.
READ_BUFFER_BYTES = 4 * 1024 * 1024
WRITE_BUFFER_BYTES = 8 * 1024 * 1024


class Transport(ABC):
    name: str
    # who may open streams to this peer (net/admission.py); None: anyone. Every served stream asks it.
    admission: Admission | None = None

    async def start(self) -> None:
        """Bring up whatever the transport listens on (nothing for libp2p: p2pd already listens)."""

    async def stop(self) -> None:
        """Release what ``start`` took."""

    @abstractmethod
    async def open(self, peer_id: str, protocol: str) -> Channel: ...

    @abstractmethod
    async def serve(self, protocol: str, handler: ChannelHandler) -> None: ...

    @abstractmethod
    async def stop_serving(self, protocol: str) -> None: ...


class StreamChannel(Channel):
    """Frames over an asyncio reader/writer pair (a p2pd stream, or a TCP connection)."""

    def __init__(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, transport_name: str):
        self.peer_id, self.transport_name = peer_id, transport_name
        self._reader, self._writer = reader, writer
        self.bytes_sent = self.bytes_received = 0
        self._pending = 0
        reader._limit = max(reader._limit, READ_BUFFER_BYTES)  # no public setter; read before the first await
        if writer is not None and writer.transport is not None:
            writer.transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)

    async def send(self, header: dict, payload: bytes | memoryview = b"") -> None:
        prefix = pack_prefix_and_header(header, len(payload))
        self._writer.write(prefix)
        if len(payload):
            self._writer.write(payload)
        self.bytes_sent += len(prefix) + len(payload)
        await self._writer.drain()

    async def recv_header(self, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES) -> tuple[dict, int]:
        try:
            header_length, payload_length = PREFIX.unpack(await self._reader.readexactly(PREFIX.size))
            check_lengths(header_length, payload_length, max_payload)
            header = parse_header(await self._reader.readexactly(header_length))
        except asyncio.IncompleteReadError:
            raise EOFError(f"channel to {self.peer_id} closed") from None
        self.bytes_received += PREFIX.size + header_length + payload_length
        self._pending = payload_length
        return header, payload_length

    async def recv_payload_into(self, target: memoryview) -> None:
        if len(target) != self._pending:
            raise FrameError(f"payload is {self._pending} bytes, not {len(target)}")
        self._pending = 0
        try:
            target[:] = await self._reader.readexactly(len(target))
        except asyncio.IncompleteReadError:
            raise EOFError(f"channel to {self.peer_id} closed") from None

    async def close(self) -> None:
        if not self._writer.is_closing():
            self._writer.close()
        try:
            await asyncio.wait_for(self._writer.wait_closed(), timeout=1.0)  # a local close: instant unless the peer stalls
        except Exception:  # already reset by the peer, or slow to close: nothing left to do
            pass


class Libp2pTransport(Transport):
    """Channels over p2pd streams: authenticated and encrypted by libp2p, through the daemon."""

    name = "libp2p"

    def __init__(self, p2p: P2P, limits: RateLimits = UNLIMITED,
                 introduce: Callable[[str], Awaitable[None]] | None = None, admission: Admission | None = None,
                 reconnect: Callable[[str], Awaitable[bool]] | None = None):
        self.p2p, self.admission = p2p, admission
        self.limits = limits  # the peer's caps; they pace the stream to p2pd, and so what p2pd sends
        self.introduce = introduce  # SwarmNode.introduce: connects to a relayed peer through its relays
        self.reconnect = reconnect  # SwarmNode.reconnect: connects to the addresses a peer published

    async def open(self, peer_id: str, protocol: str) -> Channel:
        if self.introduce is not None:
            await self.introduce(peer_id)
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol)
        except P2PDaemonError as error:  # p2pd could not reach it: once more, connected where it said it is
            if self.reconnect is None or not await self.reconnect(peer_id):
                raise
            logger.info("p2pd could not open a stream to %s (%s); connected to its published addresses, again",
                        peer_id, error)
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol)
        return _fast_channel(peer_id, reader, writer, self.name, self.limits)

    async def serve(self, protocol: str, handler: ChannelHandler) -> None:
        async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            channel = _fast_channel(info.peer_id.to_base58(), reader, writer, self.name, self.limits)
            try:
                # libp2p authenticated the remote peer id; the direct plane's setup comes this way too
                if self.admission is not None and not await self.admission.admit(channel.peer_id):
                    refusal = self.admission.refusal(channel.peer_id)
                    logger.info("refused a stream from %s on %s: %s", channel.peer_id, protocol, refusal.split(":")[0])
                    await channel.refuse(refusal)
                    return
                await handler(channel)
            except FrameError as error:
                logger.info("bad frame from %s on %s: %s", channel.peer_id, protocol, error)
                if self.admission is not None:  # counts toward a ban (accountability.py)
                    self.admission.blame(channel.peer_id, "invalid frame", str(error))
                await channel.send_error(str(error))
            except Exception as error:  # one peer's stream must never take the node down
                logger.info("stream from %s on %s failed: %s: %s", channel.peer_id, protocol, type(error).__name__, error)
            finally:
                await channel.close()

        await self.p2p.add_binary_stream_handler(protocol, on_stream)

    async def stop_serving(self, protocol: str) -> None:
        await self.p2p.remove_binary_stream_handler(protocol)


def _fast_channel(peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str,
                  limits: RateLimits) -> Channel:
    return FastChannel.take_over(peer_id, reader, writer, name).limit(limits)
