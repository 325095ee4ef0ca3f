"""A round's result, kept by the peers that applied it, for a peer that missed the round to replay on
its own state (peer/catch_up.py) instead of downloading the whole state again: a fraction of the
bytes. A donor (state/server.py) keeps each result as bfloat16, names its sha256, and keeps the
frames it travelled in where it has them (averaging/result_frames.py): those decode to exactly the
float32 values it applied.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from swarmgrad.eventloop import timeout
from swarmgrad.net.channel import Channel
from swarmgrad.net.transport import Transport
from swarmgrad.net.wire import FrameError, RemoteError, expect_kind, field, int_field
from swarmgrad.state.snapshot import StateTransferError
from swarmgrad.timing import DEFAULT_TIMING

# a round's result travels as bfloat16: half the bytes, and its rounding (2^-8 relative) is below
# what the round's own codec already changed
RESULT_DTYPE = torch.bfloat16
# a result travels in frames of at most this: one frame is one AES-GCM message (net/secure.py), which
# holds under 2 GiB (1.07B bfloat16 values), and the encrypted channel receives a frame's sealed
# bytes in a scratch buffer of its size
RESULT_CHUNK_BYTES = 64 * 1024 * 1024


class ResultPieces(Protocol):
    """A result read a piece at a time, in order, or a slice at a time (averaging/result_frames.py
    ``FramedAverage``), held as the frames it travelled in."""

    frames: list[tuple[dict, bytes]]

    def numel(self) -> int: ...

    def pieces(self) -> Iterator[tuple[int, torch.Tensor]]: ...

    def __getitem__(self, span: slice) -> torch.Tensor: ...

    def dense(self) -> torch.Tensor: ...


DIGEST_ELEMENTS = 1 << 22  # converted to bfloat16 this many at a time: no copy of the whole result
# a donor computes a framed result's digest when first asked (state/kept.py): every frame decoded, then
# bfloat16 and sha256: 2.8 (int8) to 3.7 (q2) CPU-nanoseconds an element, measured beside a lab run
# (201M, q2: 0.75 s); an asker waits ten times that beside its control timeout (a donor's cores are busy)
DIGEST_SECONDS_PER_ELEMENT = 40e-9


def digest_seconds(numel: int) -> float:
    """How long a donor may take to name a result of ``numel`` elements (beyond the exchange itself)."""
    return numel * DIGEST_SECONDS_PER_ELEMENT


def result_digest(result: torch.Tensor | ResultPieces) -> str:
    """The sha256 of a result's bytes as bfloat16 (flat), in hex: what a donor says it holds."""
    digest = hashlib.sha256()
    if not isinstance(result, torch.Tensor):  # frames: each decoded once, no copy of it
        for _, piece in result.pieces():
            _hash_piece(digest, piece)
        return digest.hexdigest()
    flat = result.detach().reshape(-1)
    for start in range(0, flat.numel(), DIGEST_ELEMENTS):
        piece = flat[start : start + DIGEST_ELEMENTS].to("cpu").to(RESULT_DTYPE)
        digest.update(memoryview(piece.view(torch.uint8).numpy()))
    return digest.hexdigest()


def _hash_piece(digest: Any, piece: torch.Tensor) -> None:  # digest: a hashlib sha256
    digest.update(memoryview(piece.to(RESULT_DTYPE).view(torch.uint8).numpy()))


def framed_and_named(decoder: ResultFrames, frames: Sequence[tuple[dict, bytes]]) -> tuple[ResultPieces, str]:
    """Received frames as a result (checked: ``decoder.framed``) and their digest (``result_digest``),
    each frame decoded once for both (a replayed round at 201M: one pass over the model's size less)."""
    digest = hashlib.sha256()
    framed = decoder.framed(frames, each=lambda values: _hash_piece(digest, values))
    return framed, digest.hexdigest()


async def download_result_digest(transport: Transport, protocol: str, donor: str, epoch: int) -> str:
    """The digest of the result of round ``epoch`` that ``donor`` keeps (``result_digest``)."""
    channel = await transport.open(donor, protocol)
    clean = False
    try:
        await channel.send({"t": "digest", "epoch": epoch})
        reply = expect_kind(await channel.recv(max_payload=0), "digest")
        digest = field(reply.header, "sha256", str)
        if field(reply.header, "epoch", int) != epoch or len(digest) != 64:
            raise FrameError(f"expected the sha256 of the result of round {epoch}, got {reply.header!r}")
        await channel.send({"t": "done"})
        clean = True
    finally:
        await (channel.close() if clean else channel.abort())
    return digest


class ResultFrames(Protocol):
    """What decodes a result's frames (averaging/result_frames.py ``ResultDecoder``)."""

    frames: int
    max_payload: int
    nbytes: int

    def check_header(self, index: int, header: dict) -> None: ...

    def decode(self, frames: Sequence[tuple[dict, bytes]]) -> torch.Tensor: ...

    def framed(self, frames: Sequence[tuple[dict, bytes]],
               each: Callable[[torch.Tensor], None] | None = None) -> ResultPieces: ...


async def download_result(transport: Transport, protocol: str, donors: list[str], epoch: int, numel: int, *,
                          seconds: float = DEFAULT_TIMING.control_timeout, digest: str | None = None,
                          decoder: ResultFrames | None = None) -> torch.Tensor | ResultPieces:
    """The result of round ``epoch`` (``numel`` floats, as float32) from the first of ``donors``, in
    order, that kept it (and, given ``digest``, whose bytes have it); all within ``seconds``. With a
    ``decoder`` a donor that kept the frames the round travelled in sends those, which decode to
    the float32 values it applied, and they are handed over as they came (``ResultPieces``: no
    float32 copy of the result); else its bfloat16 copy, as float32. StateTransferError when none did."""
    if not donors:
        raise StateTransferError("no peer to take the round's result from")
    failures = []
    deadline = asyncio.get_running_loop().time() + seconds
    for donor in donors:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            break
        try:
            async with timeout(left):
                return await _fetch_result(transport, protocol, donor, epoch, numel, digest, decoder)
        except (FrameError, RemoteError, StateTransferError, EOFError, OSError, ConnectionError,
                asyncio.TimeoutError, TimeoutError) as error:
            failures.append(f"{donor}: {str(error) or type(error).__name__}")  # a timeout says nothing itself
    raise StateTransferError(f"no donor handed over the result of round {epoch} "
                             f"({len(failures)} of {len(donors)} asked: {'; '.join(failures[:2])})")


async def _fetch_result(transport: Transport, protocol: str, donor: str, epoch: int, numel: int,
                        digest: str | None, decoder: ResultFrames | None) -> torch.Tensor | ResultPieces:
    element = torch.empty(0, dtype=RESULT_DTYPE).element_size()
    channel = await transport.open(donor, protocol)
    clean = False
    result: torch.Tensor | ResultPieces  # its frames, or the bfloat16 copy as it came
    named = None  # the frames' digest, taken as they were checked
    try:
        await channel.send({"t": "result", "epoch": epoch, "chunks": True,
                            **({"frames": True} if decoder is not None else {})})
        header, length = await channel.recv_header(max_payload=numel * element)
        if header.get("t") != "result" or header.get("epoch") != epoch or header.get("numel") != numel:
            raise FrameError(f"expected the result of round {epoch} ({numel} values), got {header.get('t')!r} "
                             f"of round {header.get('epoch')!r} ({header.get('numel')!r} values)")
        if "frames" in header:
            if decoder is None or length:
                raise FrameError("a result in frames that were not asked for, or with a payload")
            int_field(header, "frames", decoder.frames, decoder.frames)
            frames = await _read_frames(channel, decoder, 0, decoder.frames)
            # each frame decoded once: checked, finite, and hashed; off the event loop (seconds at 200M)
            framed, named = await asyncio.to_thread(framed_and_named, decoder, frames)
            if framed.numel() != numel:
                raise FrameError(f"the result's frames hold {framed.numel()} values, expected {numel}")
            result = framed
        else:
            result = torch.empty(numel, dtype=RESULT_DTYPE)
            target = memoryview(result.view(torch.uint8).numpy())
            if "chunks" in header:
                if length:
                    raise FrameError("a result in chunks with a payload")
                await _read_chunks(channel, epoch, int_field(header, "chunks", 0, len(target)), target)
            else:  # an older donor sends it in one frame
                if length != len(target):
                    raise FrameError(f"the result is {length} bytes, expected {len(target)}")
                await channel.recv_payload_into(target)
        await channel.send({"t": "done"})
        clean = True
    finally:
        await (channel.close() if clean else channel.abort())
    return await asyncio.to_thread(_checked_result, epoch, result, digest, named)


def _checked_result(epoch: int, result: torch.Tensor | ResultPieces, digest: str | None,
                    named: str | None = None) -> torch.Tensor | ResultPieces:
    """The result a donor handed over (its frames, or its bfloat16 copy), once its digest (given one:
    against ``named``, where its frames were hashed as they were checked) and, for a bfloat16 copy,
    its values are checked; in a thread: a pass over every byte."""
    if digest is not None and (named or result_digest(result)) != digest:
        raise StateTransferError(f"the result of round {epoch} it served is not the one it and others described")
    if not isinstance(result, torch.Tensor):
        return result
    values = result.to(torch.float32)
    if not bool(torch.isfinite(values).all()):
        raise StateTransferError(f"the result of round {epoch} has NaN or Inf; not using it")
    return values


async def _read_frames(channel: Channel, decoder: ResultFrames, first: int, count: int) -> list[tuple[dict, bytes]]:
    """Frames ``first`` to ``first + count - 1`` of a result, as they come, each header checked."""
    frames = []
    for index in range(first, first + count):
        frame_header, frame_length = await channel.recv_header(max_payload=decoder.max_payload)
        decoder.check_header(index, frame_header)
        payload = bytearray(frame_length)
        await channel.recv_payload_into(memoryview(payload))
        frames.append((frame_header, bytes(payload)))
    return frames


async def download_result_in_parts(transport: Transport, protocol: str, donors: list[str], epoch: int, numel: int,
                                   *, seconds: float, digest: str, decoder: ResultFrames) -> ResultPieces:
    """The result of round ``epoch`` in its frames, a share of them from each of ``donors`` at once
    (donors that named the same ``digest``: a group's members hold the very same frames), so that one
    result comes at the joiner's downlink rate, not at what one donor's uplink spares beside its own
    rounds (at 201M in the lab, int8: a replayed round took 38 s from one donor, the swarm's rounds 34).
    Checked as one: frame headers, finite values, and the digest; StateTransferError on any failure,
    naming no donor (the caller then takes it from one of them, which the digest checks alone)."""
    if not donors:
        raise StateTransferError("no peer to take the round's result from")
    count = decoder.frames
    bounds = [count * index // len(donors) for index in range(len(donors) + 1)]
    spans = [(first, last - first) for first, last in zip(bounds, bounds[1:]) if last > first]
    fetches = [asyncio.ensure_future(_fetch_frames(transport, protocol, donor, epoch, numel, decoder, *span))
               for donor, span in zip(donors, spans)]
    try:
        async with timeout(seconds):
            parts = await asyncio.gather(*fetches)
    except (FrameError, RemoteError, StateTransferError, EOFError, OSError, ConnectionError,
            asyncio.TimeoutError, TimeoutError) as error:
        raise StateTransferError(f"the result of round {epoch} in parts from {len(spans)} donors: "
                                 f"{str(error) or type(error).__name__}") from error
    finally:  # one part failed: the others stop too (their channels aborted), their errors retrieved
        for fetch in fetches:
            fetch.cancel()
        await asyncio.gather(*fetches, return_exceptions=True)
    try:  # off the event loop: each frame decoded once, checked (finite) and hashed
        framed, named = await asyncio.to_thread(framed_and_named, decoder, [frame for part in parts for frame in part])
    except FrameError as error:
        raise StateTransferError(f"the result of round {epoch} in parts: {error}") from error
    if framed.numel() != numel or named != digest:
        raise StateTransferError(f"the result of round {epoch} in parts is not the one its donors described")
    return framed


async def _fetch_frames(transport: Transport, protocol: str, donor: str, epoch: int, numel: int,
                        decoder: ResultFrames, first: int, count: int) -> list[tuple[dict, bytes]]:
    """Frames ``first`` to ``first + count - 1`` of the result of round ``epoch`` from ``donor``."""
    channel = await transport.open(donor, protocol)
    clean = False
    try:
        await channel.send({"t": "result", "epoch": epoch, "chunks": True, "frames": True, "first": first,
                            "count": count})
        header, length = await channel.recv_header(max_payload=0)
        if header.get("t") != "result" or header.get("epoch") != epoch or header.get("numel") != numel \
                or header.get("first") != first or header.get("count") != count or length:
            raise FrameError(f"expected frames {first} to {first + count - 1} of the result of round {epoch}, got "
                             f"{header.get('t')!r} of round {header.get('epoch')!r} from frame {header.get('first')!r}")
        frames = await _read_frames(channel, decoder, first, count)
        await channel.send({"t": "done"})
        clean = True
    finally:
        await (channel.close() if clean else channel.abort())
    return frames


async def _read_chunks(channel: Channel, epoch: int, count: int, target: memoryview) -> None:
    """The ``count`` chunks of a result, in order, each of at most ``RESULT_CHUNK_BYTES``, into
    ``target``, which they must fill exactly."""
    filled = 0
    for index in range(count):
        header, length = await channel.recv_header(max_payload=min(RESULT_CHUNK_BYTES, len(target) - filled))
        if header.get("t") != "result-chunk" or header.get("epoch") != epoch or header.get("index") != index \
                or not length:
            raise FrameError(f"expected chunk {index} of the result of round {epoch}, got {header.get('t')!r} "
                             f"{header.get('index')!r} of round {header.get('epoch')!r} ({length} bytes)")
        await channel.recv_payload_into(target[filled : filled + length])
        filled += length
    if filled != len(target):
        raise FrameError(f"the result's {count} chunk(s) hold {filled} bytes, expected {len(target)}")
