"""A channel: how two peers exchange frames, whatever carries them (a p2pd stream, a direct TCP
connection). The averaging engine talks only to ``Channel``; transports (transport.py, direct.py)
open and serve them."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Awaitable, Callable

from swarmgrad.net.wire import DEFAULT_MAX_PAYLOAD_BYTES, Frame, error_header


class Channel(ABC):
    """A bidirectional, ordered, authenticated stream of frames with one peer."""

    peer_id: str  # authenticated by the transport, never taken from a frame
    transport_name: str
    bytes_sent: int = 0
    bytes_received: int = 0

    @abstractmethod
    async def send(self, header: dict, payload: bytes | memoryview = b"") -> None: ...

    @abstractmethod
    async def recv_header(self, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES) -> tuple[dict, int]:
        """The next frame's header and payload length, validated; ``recv_payload_into`` must follow.
        FrameError if malformed, RemoteError for an error frame, EOFError when closed."""

    @abstractmethod
    async def recv_payload_into(self, target: memoryview) -> None:
        """Read the pending payload into ``target`` (exactly its length)."""

    async def recv(self, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Frame:
        """Next whole frame (header and payload)."""
        header, length = await self.recv_header(max_payload)
        payload = bytearray(length)
        if length:
            await self.recv_payload_into(memoryview(payload))
        return Frame(header, bytes(payload) if length <= 4096 else payload)  # type: ignore[arg-type]

    @abstractmethod
    async def close(self) -> None:
        """Done with the channel after a clean exchange (a pooled connection may be kept for reuse)."""

    async def abort(self) -> None:
        """Tear the channel down now, e.g. when a round failed: the peer notices at once."""
        await self.close()

    async def send_error(self, message: str) -> None:
        """Tell the peer why we stop talking; best effort (it may be gone already)."""
        try:
            # a last word to a peer that may be gone: never worth more than a moment
            await asyncio.wait_for(self.send(error_header(message)), timeout=1.0)
        except Exception:
            pass

    async def refuse(self, message: str, linger: float = 1.0) -> None:
        """Tell a refused peer why, then drop what it sent until it closes (at most ``linger`` s):
        closing with its request unread resets the stream, and the peer would read an EOF, not why."""
        await self.send_error(message)

        async def drain() -> None:
            while True:
                await self.recv()

        try:
            await asyncio.wait_for(drain(), linger)
        except Exception:  # it closed (EOFError), or sent something we would not read anyway
            pass


ChannelHandler = Callable[[Channel], Awaitable[None]]
