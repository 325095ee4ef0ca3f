"""A frame channel that reads straight into the caller's memory.

``asyncio.StreamReader`` copies every received byte twice (socket -> its buffer -> a new bytes
object) and pauses the socket every 128 KiB. For megabyte tensor frames on a 2-core machine those
copies compete with p2pd for the CPU. ``FrameProtocol`` is a ``BufferedProtocol``: small reads
(prefix, header) land in one reusable buffer, and a payload can be received directly into its
destination, e.g. the slice of the result tensor it belongs to.

``FastChannel`` takes over the transport of an existing stream (a p2pd stream from hivemind, or a
TCP connection), carrying over whatever its StreamReader had already buffered.

Rate caps (``ratelimit.py``): a channel given a peer's ``RateLimits`` writes in paced pieces, and its
protocol stops reading the socket while the download bucket is in debt.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Sequence

from swarmgrad.net.channel import Channel
from swarmgrad.net.ratelimit import CHUNK_BYTES, RateLimits, TokenBucket
from swarmgrad.net.wire import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    PREFIX,
    FrameError,
    check_lengths,
    pack_prefix_and_header,
    parse_header,
)

SMALL_BUFFER_BYTES = 256 * 1024  # prefix + header + the start of the next payload
MIN_FREE_BYTES = 64 * 1024  # never offer the socket a sliver: move unread bytes forward first
WRITE_HIGH_WATER_BYTES = 8 * 1024 * 1024


class FrameProtocol(asyncio.BufferedProtocol):
    """Receives into a small ring of its own, or into a caller-provided target buffer."""

    def __init__(self, initial: bytes = b""):
        self.transport: asyncio.Transport | None = None
        size = max(SMALL_BUFFER_BYTES, len(initial))
        self._buffer = bytearray(size)
        self._view = memoryview(self._buffer)
        self._buffer[: len(initial)] = initial
        self._start, self._end = 0, len(initial)  # unread bytes: _buffer[_start:_end]
        self._target: memoryview | None = None  # destination of the payload being read
        self._target_filled = 0
        self._waiter: asyncio.Future | None = None
        self._closed: BaseException | None = None  # EOF or connection error
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._reading_paused = False  # our buffer is full of unread bytes
        self.download: TokenBucket | None = None  # the peer's download cap, when it has one
        self._throttle: asyncio.TimerHandle | None = None  # reading paused until the download debt is paid

    # ---- asyncio callbacks ----------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        # a capped download reads in small pieces, so one read cannot take far more than the budget
        limit = CHUNK_BYTES if self.download is not None else None
        if self._target is not None:
            return self._target[self._target_filled :][:limit]
        if self._start == self._end:  # empty: start over at the front
            self._start = self._end = 0
        elif len(self._buffer) - self._end < MIN_FREE_BYTES:
            self._move_unread_to_front()
        return self._view[self._end :][:limit]

    def buffer_updated(self, nbytes: int) -> None:
        if self.download is not None:
            self._charge_download(nbytes)
        if self._target is not None:
            self._target_filled += nbytes
            if self._target_filled == len(self._target):
                self._target = None  # the next bytes belong to the next frame: back to our buffer
        else:
            self._end += nbytes
            if len(self._buffer) - self._end < MIN_FREE_BYTES and self._start == 0 and self.transport is not None:
                self.transport.pause_reading()  # full of unread bytes; resumed when the reader consumes
                self._reading_paused = True
        self._wake()

    def eof_received(self) -> bool:
        self._closed = EOFError("channel closed by the peer")
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._throttle is not None:
            self._throttle.cancel()
            self._throttle = None
        self._closed = exc or EOFError("channel closed")
        self._can_write.set()
        self._wake()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # ---- reading --------------------------------------------------------------------------

    async def read_exactly(self, count: int) -> bytes:
        """``count`` bytes (at most a quarter of the small buffer) from the stream."""
        while self._end - self._start < count:
            if self._closed is not None:
                raise EOFError("channel closed") from None
            self._move_unread_to_front()
            self._resume_reading()
            await self._wait()
        data = bytes(self._view[self._start : self._start + count])
        self._start += count
        return data

    async def read_into(self, target: memoryview) -> None:
        """Fill ``target`` completely: first from buffered bytes, then straight from the socket."""
        available = min(len(target), self._end - self._start)
        target[:available] = self._view[self._start : self._start + available]
        self._start += available
        if available == len(target):
            return
        remaining = target[available:]
        self._target, self._target_filled = remaining, 0
        self._resume_reading()
        try:
            while self._target is remaining:
                if self._closed is not None:
                    raise EOFError("channel closed in the middle of a frame")
                await self._wait()
        finally:
            self._target = None

    def _move_unread_to_front(self) -> None:
        if self._start:
            unread = self._end - self._start
            self._buffer[:unread] = self._view[self._start : self._end]
            self._start, self._end = 0, unread

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            if self._throttle is None:  # else the throttle's end resumes it
                self.transport.resume_reading()

    def _charge_download(self, nbytes: int) -> None:
        """Pay for bytes that arrived; while in debt, leave them in the kernel (TCP slows the sender)."""
        assert self.download is not None
        delay = self.download.charge(nbytes)
        if delay > 0 and self._throttle is None and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
            self._throttle = asyncio.get_running_loop().call_later(delay, self._end_throttle)

    def _end_throttle(self) -> None:
        self._throttle = None
        if not self._reading_paused and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class FastChannel(Channel):
    """Frames over a transport driven by ``FrameProtocol``; payloads can be read into place."""

    def __init__(self, peer_id: str, transport: asyncio.Transport, protocol: FrameProtocol, transport_name: str):
        self.peer_id, self.transport_name = peer_id, transport_name
        self._transport, self._protocol = transport, protocol
        self.bytes_sent = self.bytes_received = 0
        self._pending_payload = 0  # length of a payload whose header was read but not the bytes
        self._stream_objects: tuple = ()
        # set by a transport that pools connections: called by close() instead of closing
        self.on_close: Callable[[FastChannel], Awaitable[None]] | None = None
        self.aborted = False
        self.upload: TokenBucket | None = None  # the peer's upload cap, when it has one (``limit``)
        self._send_lock: asyncio.Lock | None = None  # paced frames are written in pieces: one frame at a time
        self._torn = False  # a paced send stopped mid-frame: the stream is unusable

    def limit(self, limits: RateLimits) -> FastChannel:
        """Charge this channel's traffic to the peer's buckets (shared by all its channels)."""
        self.upload, self._protocol.download = limits.upload, limits.download
        if limits.upload is not None and self._send_lock is None:
            self._send_lock = asyncio.Lock()
        return self

    @classmethod
    def take_over(
        cls, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, transport_name: str
    ) -> FastChannel:
        """Switch an open stream from StreamReader to FrameProtocol, keeping bytes already read."""
        transport = writer.transport
        protocol = FrameProtocol(bytes(reader._buffer))  # StreamReader has no public way to drain this
        reader._buffer.clear()
        protocol.transport = transport
        if reader.at_eof():
            protocol._closed = EOFError("channel closed by the peer")
        transport.set_protocol(protocol)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES)
        transport.resume_reading()  # StreamReader may have paused it
        channel = cls(peer_id, transport, protocol, transport_name)
        channel._stream_objects = (reader, writer)  # StreamWriter.__del__ would close the transport
        return channel

    async def send(self, header: dict, payload: bytes | memoryview = b"") -> None:
        await self._protocol._can_write.wait()
        if self._protocol._closed is not None and self._transport.is_closing():
            raise ConnectionResetError(f"channel to {self.peer_id} is closed")
        prefix = pack_prefix_and_header(header, len(payload))
        await self._write((prefix, payload) if len(payload) else (prefix,))  # one writev, no join copy
        self.bytes_sent += len(prefix) + len(payload)

    async def _write(self, pieces: Sequence[bytes | memoryview]) -> None:
        """Write one frame's pieces: at once, or, under an upload cap, in paced chunks."""
        if self.upload is None:
            self._transport.writelines(pieces)
            return
        assert self._send_lock is not None
        async with self._send_lock:
            try:
                for piece in pieces:
                    view = memoryview(piece)
                    if view.format != "B" or view.ndim != 1:
                        view = view.cast("B")
                    for start in range(0, len(view), CHUNK_BYTES):
                        chunk = view[start : start + CHUNK_BYTES]
                        await self.upload.take(len(chunk))
                        await self._protocol._can_write.wait()
                        if self._transport.is_closing():
                            raise ConnectionResetError(f"channel to {self.peer_id} is closed")
                        self._transport.write(chunk)
            except BaseException:
                self._torn = True  # cancelled or reset between pieces: never reuse this stream
                raise

    async def recv_header(self, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES) -> tuple[dict, int]:
        """The next frame's header and its payload length; read the payload next."""
        if self._pending_payload:
            raise RuntimeError("the previous frame's payload was not read")
        header_length, payload_length = PREFIX.unpack(await self._protocol.read_exactly(PREFIX.size))
        check_lengths(header_length, payload_length, max_payload)
        header = parse_header(await self._protocol.read_exactly(header_length))
        self.bytes_received += PREFIX.size + header_length + payload_length
        self._pending_payload = payload_length
        return header, payload_length

    async def recv_payload_into(self, target: memoryview) -> None:
        self._claim_payload(target)
        await self._protocol.read_into(target)

    def _claim_payload(self, target: memoryview) -> None:
        if len(target) != self._pending_payload:
            raise FrameError(f"payload is {self._pending_payload} bytes, not {len(target)}")
        self._pending_payload = 0

    @property
    def idle(self) -> bool:
        """Between frames, not aborted, connection open: safe to hand to the next exchange."""
        return not (self.aborted or self._torn or self._pending_payload or self._protocol._closed
                    or self._transport.is_closing())

    def reset_counters(self) -> None:
        self.bytes_sent = self.bytes_received = 0

    async def close(self) -> None:
        if self.on_close is not None and not self.aborted:
            await self.on_close(self)
        else:
            await self.abort()

    async def abort(self) -> None:
        self.aborted = True
        if not self._transport.is_closing():
            self._transport.close()
