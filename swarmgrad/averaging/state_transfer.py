"""Handing a peer's whole state (named tensors plus small metadata) to a peer that joins late.

A donor keeps its latest ``StateSnapshot`` (and the one before, so a download that started just
before the donor moved on can finish), and the results of its last rounds: a peer that missed a
round (or whose download ended with the swarm a round further) replays that round's result on its
own state instead of downloading the whole state again, for a fraction of the bytes. A joiner asks every candidate donor for its snapshot's
description, picks the freshest version held by the most donors, and fetches the bytes in parts
spread over those donors (DESIGN invariant 8): each donor serves a share, a donor that fails mid-way
has its parts fetched from the others, and nothing is used until every byte arrived and every
floating-point value is finite. A joiner that needs only some of the tensors (``keep``) fetches only
the parts that hold them. A donor that broke the protocol (a malformed description or part) or served
NaN or Inf is blamed on the transport's admission (accountability.py): enough of that bans it.

Protocol (one channel per donor, any number of requests on it, then ``done``: on the direct data
plane the connection is pooled, so the end of an exchange is said, not inferred from a close):
    -> {"t": "describe"}                      <- {"t": "state", "version", "digest", "nbytes"} + msgpack(specs, meta)
    -> {"t": "part", "version", "index"}      <- {"t": "part", "version", "index"} + raw bytes
    -> {"t": "result", "epoch"}               <- {"t": "result", "epoch", "numel"} + bfloat16 bytes
    -> {"t": "done"}
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import msgpack
import torch

from swarmgrad.averaging.transport import Channel, Transport
from swarmgrad.averaging.wire import FrameError, RemoteError, expect_kind, field, int_field
from swarmgrad.errors import SwarmgradError
from swarmgrad.runtime import timeout
from swarmgrad.timing import DEFAULT_TIMING

logger = logging.getLogger(__name__)

# small enough that a peer keeping its optimizer state skips the parts holding it even in a state
# of a few MB, large enough that a part's round trip is a small share of its transfer
PART_BYTES = 1024 * 1024
# a round's result travels as bfloat16: half the bytes, and its rounding (2^-8 relative) is below
# what the round's own codec already changed
RESULT_DTYPE = torch.bfloat16
KEPT_RESULTS = 2  # rounds whose results a donor keeps: enough for a peer one or two rounds behind
ALIGNMENT = 8  # bytes; the largest element size we carry
MAX_DESCRIPTION_BYTES = 16 * 1024 * 1024
MAX_STATE_BYTES = 64 * 1024 * 1024 * 1024
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}


class StateTransferError(SwarmgradError):
    """No donor could hand over a complete, valid state."""


@dataclass(frozen=True)
class StateSnapshot:
    """Named CPU tensors packed in one byte buffer, a version (higher is fresher) and JSON-like metadata."""

    version: int
    specs: tuple[tuple[str, str, tuple[int, ...]], ...]  # name, dtype, shape
    meta: dict[str, Any]
    data: torch.Tensor  # uint8, all tensors' bytes in spec order

    @classmethod
    def capture(cls, version: int, tensors: Mapping[str, torch.Tensor], meta: dict[str, Any] | None = None) -> StateSnapshot:
        """A copy of ``tensors`` (any device), safe to serve while training goes on."""
        specs = []
        for name, tensor in tensors.items():
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in DTYPES:
                raise ValueError(f"state tensor {name!r} has unsupported dtype {dtype}")
            specs.append((name, dtype, tuple(tensor.shape)))
        offsets, total = layout(specs)
        data = torch.zeros(total, dtype=torch.uint8)
        for (start, length), tensor in zip(offsets, tensors.values()):
            flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            data[start : start + length].copy_(flat)
        return cls(version, tuple(specs), dict(meta or {}), data)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    @property
    def digest(self) -> str:
        """Identifies the layout: donors with equal digests (and versions) hold interchangeable bytes."""
        described = msgpack.packb([[n, d, list(s)] for n, d, s in self.specs], use_bin_type=True)
        return hashlib.sha256(described).hexdigest()[:32]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Views into ``data`` with their names, dtypes and shapes."""
        offsets, _ = layout(self.specs)
        return {name: self.data[start : start + length].view(DTYPES[dtype]).reshape(shape)
                for (name, dtype, shape), (start, length) in zip(self.specs, offsets)}

    def describe(self) -> bytes:
        return msgpack.packb({"specs": [[n, d, list(s)] for n, d, s in self.specs], "meta": self.meta},
                             use_bin_type=True)


def layout(specs: Sequence[tuple[str, str, tuple[int, ...]]]) -> tuple[list[tuple[int, int]], int]:
    """(offset, length) of each tensor in the byte buffer, and its total size. Offsets are
    multiples of 8, so every tensor can be viewed in place as its own dtype."""
    offsets, position = [], 0
    for _, dtype, shape in specs:
        length = math.prod(shape) * torch.empty(0, dtype=DTYPES[dtype]).element_size()
        offsets.append((position, length))
        position += -(-length // ALIGNMENT) * ALIGNMENT
    return offsets, position


def _parse_description(payload: bytes, nbytes: int) -> tuple[tuple, dict]:
    try:
        described = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        specs = tuple(
            (str(name), str(dtype), tuple(int(d) for d in shape)) for name, dtype, shape in described["specs"]
        )
        meta = described["meta"]
    except Exception as error:
        raise FrameError(f"state description is malformed: {error}") from None
    if not isinstance(meta, dict):
        raise FrameError("state metadata must be a map")
    for name, dtype, shape in specs:
        if dtype not in DTYPES or any(d < 0 for d in shape):
            raise FrameError(f"state tensor {name!r}: bad dtype {dtype!r} or shape {shape}")
    if layout(specs)[1] != nbytes:
        raise FrameError(f"state description adds up to {layout(specs)[1]} bytes, the donor claims {nbytes}")
    return specs, meta


class StateServer:
    """Serves this peer's latest snapshots to joiners over ``protocol``."""

    def __init__(self, transport: Transport, protocol: str, keep: int = 2,
                 idle_seconds: float = DEFAULT_TIMING.join_timeout, keep_results: int = KEPT_RESULTS):
        self.transport, self.protocol, self.keep, self.idle_seconds = transport, protocol, keep, idle_seconds
        self.keep_results = keep_results
        self._snapshots: dict[int, StateSnapshot] = {}
        self._described: dict[int, bytes] = {}
        self._results: dict[int, torch.Tensor] = {}

    async def __aenter__(self) -> StateServer:
        await self.transport.serve(self.protocol, self._serve)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.transport.stop_serving(self.protocol)

    @property
    def latest(self) -> StateSnapshot | None:
        return self._snapshots[max(self._snapshots)] if self._snapshots else None

    def publish(self, snapshot: StateSnapshot) -> None:
        self._snapshots[snapshot.version] = snapshot
        self._described[snapshot.version] = snapshot.describe()
        for version in sorted(self._snapshots)[: -self.keep]:
            self._snapshots.pop(version)
            self._described.pop(version)

    def publish_result(self, epoch: int, result: torch.Tensor) -> None:
        """Keep what round ``epoch`` applied here (a flat float tensor: the swarm's average, or this
        peer's own values when it stepped alone), for a peer that missed the round to replay."""
        if self.keep_results < 1:
            return
        self._results[epoch] = result.detach().to("cpu").reshape(-1).to(RESULT_DTYPE, copy=True)
        for old in sorted(self._results)[: -self.keep_results]:
            self._results.pop(old)

    async def _serve(self, channel: Channel) -> None:
        while True:
            try:
                async with timeout(self.idle_seconds):  # an idle joiner does not hold the stream forever
                    request = await channel.recv(max_payload=0)
            except EOFError:
                return
            if request.kind == "done":
                return
            if request.kind == "describe":
                latest = self.latest
                if latest is None:
                    await channel.send_error("this peer has no state to share yet")
                    return
                await channel.send({"t": "state", "version": latest.version, "digest": latest.digest,
                                    "nbytes": latest.nbytes}, self._described[latest.version])
            elif request.kind == "part":
                version = field(request.header, "version", int)
                snapshot = self._snapshots.get(version)
                if snapshot is None:
                    await channel.send_error(f"version {version} is no longer held here")
                    return
                index = int_field(request.header, "index", 0, max(0, math.ceil(snapshot.nbytes / PART_BYTES) - 1))
                part = snapshot.data[index * PART_BYTES : (index + 1) * PART_BYTES]
                await channel.send({"t": "part", "version": version, "index": index}, memoryview(part.numpy()))
            elif request.kind == "result":
                epoch = field(request.header, "epoch", int)
                result = self._results.get(epoch)
                if result is None:
                    await channel.send_error(f"the result of round {epoch} is not kept here")
                    return
                await channel.send({"t": "result", "epoch": epoch, "numel": result.numel()},
                                   memoryview(result.view(torch.uint8).numpy()))
            else:
                raise FrameError(f"unexpected request {request.kind!r}")


@dataclass
class _Offer:
    donor: str
    channel: Channel
    version: int
    digest: str
    nbytes: int
    specs: tuple
    meta: dict


async def download_state(transport: Transport, protocol: str, donors: list[str], *,
                         seconds: float = DEFAULT_TIMING.join_timeout,
                         min_version: int = 0, max_bytes: int = MAX_STATE_BYTES,
                         keep: Callable[[str], bool] | None = None) -> StateSnapshot:
    """The freshest state among ``donors``, fetched in parts spread over every donor that holds it.

    ``keep``: which tensors (by name) to fetch; the snapshot holds only those, and only the parts
    that hold them travel. Raises StateTransferError when no donor offers a version >=
    ``min_version`` or the transfer cannot be completed within ``seconds``.
    """
    if not donors:
        raise StateTransferError("no peer to download the state from")
    offers: list[_Offer] = []
    try:
        async with timeout(seconds):
            described = await asyncio.gather(*(_describe(transport, protocol, d, max_bytes) for d in donors),
                                             return_exceptions=True)
            for donor, outcome in zip(donors, described):
                if isinstance(outcome, _Offer):
                    offers.append(outcome)
                else:
                    logger.info("donor %s cannot share its state: %s", donor, outcome)
                    if isinstance(outcome, FrameError):
                        _blame(transport, donor, "invalid frame", str(outcome))
            fresh = [offer for offer in offers if offer.version >= min_version]
            if not fresh:
                raise StateTransferError(f"none of {len(donors)} peer(s) offered a state at version >= {min_version}")
            newest = max(offer.version for offer in fresh)
            layout = Counter(offer.digest for offer in fresh if offer.version == newest).most_common(1)[0][0]
            sources = [offer for offer in fresh if offer.version == newest and offer.digest == layout]
            # one part may take a quarter of the budget (a slow donor's parts move to the others),
            # and never less than 2 s: 4 MiB at 20 Mbit/s
            return await _fetch(sources, part_seconds=max(2.0, seconds / 4), keep=keep,
                                blame=lambda donor, kind, detail: _blame(transport, donor, kind, detail))
    except (asyncio.TimeoutError, TimeoutError):
        raise StateTransferError(f"state download did not finish within {seconds:.0f} s") from None
    finally:
        await asyncio.gather(*(_finish(offer.channel) for offer in offers), return_exceptions=True)


async def _finish(channel: Channel) -> None:
    try:
        await channel.send({"t": "done"})
    finally:
        await channel.close()


async def _describe(transport: Transport, protocol: str, donor: str, max_bytes: int) -> _Offer:
    channel = await transport.open(donor, protocol)
    try:
        await channel.send({"t": "describe"})
        reply = expect_kind(await channel.recv(max_payload=MAX_DESCRIPTION_BYTES), "state")
        nbytes = int_field(reply.header, "nbytes", 0, max_bytes)
        specs, meta = _parse_description(bytes(reply.payload), nbytes)
        return _Offer(donor, channel, field(reply.header, "version", int), field(reply.header, "digest", str),
                      nbytes, specs, meta)
    except BaseException:
        await channel.close()
        raise


def parts_holding(specs: Sequence[tuple[str, str, tuple[int, ...]]], keep: Callable[[str], bool] | None) -> list[int]:
    """Indices of the ``PART_BYTES`` parts that hold the tensors ``keep`` accepts (all, without it)."""
    offsets, total = layout(specs)
    if keep is None:
        return list(range(math.ceil(total / PART_BYTES)))
    parts: set[int] = set()
    for (name, _, _), (start, length) in zip(specs, offsets):
        if length and keep(name):
            parts.update(range(start // PART_BYTES, (start + length - 1) // PART_BYTES + 1))
    return sorted(parts)


def _blame(transport: Transport, donor: str, kind: str, detail: str) -> None:
    if transport.admission is not None:
        transport.admission.blame(donor, kind, detail)


async def _fetch(sources: list[_Offer], part_seconds: float, keep: Callable[[str], bool] | None,
                 blame: Callable[[str, str, str], None] = lambda donor, kind, detail: None) -> StateSnapshot:
    """Every needed part from some donor; a donor that errs or stalls for ``part_seconds`` hands its part on.
    ``blame(donor, kind, detail)``: told of a donor that sent an invalid part, or parts holding NaN or Inf."""
    first = sources[0]
    data = torch.empty(first.nbytes, dtype=torch.uint8)
    target = memoryview(data.numpy())
    parts = parts_holding(first.specs, keep)
    random.shuffle(sources)  # joiners arriving together start on different donors
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in parts:
        queue.put_nowait(index)
    done: dict[int, str] = {}  # part -> the donor it came from
    healthy = list(sources)

    async def worker(offer: _Offer) -> None:
        while not queue.empty():
            index = queue.get_nowait()
            try:
                async with timeout(part_seconds):
                    await offer.channel.send({"t": "part", "version": offer.version, "index": index})
                    header, length = await offer.channel.recv_header(max_payload=PART_BYTES)
                    expect_kind_header(header, "part", offer.version, index)
                    expected = min(PART_BYTES, offer.nbytes - index * PART_BYTES)
                    if length != expected:
                        raise FrameError(f"part {index} is {length} bytes, expected {expected}")
                    await offer.channel.recv_payload_into(target[index * PART_BYTES : index * PART_BYTES + length])
                done[index] = offer.donor
            except (FrameError, RemoteError, EOFError, OSError, ConnectionError, asyncio.TimeoutError,
                    TimeoutError) as error:
                logger.info("donor %s failed on part %d: %s; the others take over", offer.donor, index, error)
                if isinstance(error, FrameError):
                    blame(offer.donor, "invalid frame", str(error))
                queue.put_nowait(index)  # another donor fetches it
                healthy.remove(offer)
                await offer.channel.abort()  # nothing more may land in the buffer from this donor
                return

    while not queue.empty() and healthy:  # a donor that failed late leaves parts for another pass
        await asyncio.gather(*(worker(offer) for offer in list(healthy)))
    if len(done) != len(parts):
        raise StateTransferError(f"every donor failed: {len(parts) - len(done)} of {len(parts)} parts missing")
    snapshot = StateSnapshot(first.version, first.specs, first.meta, data)
    _check_finite(snapshot, keep, done, blame)
    if keep is not None:  # repack the kept tensors: every byte of theirs was fetched, the rest is unset
        kept = {name: tensor for name, tensor in snapshot.tensors().items() if keep(name)}
        snapshot = StateSnapshot.capture(first.version, kept, first.meta)
    return snapshot


def _check_finite(snapshot: StateSnapshot, keep: Callable[[str], bool] | None, sources: dict[int, str],
                  blame: Callable[[str, str, str], None]) -> None:
    """StateTransferError when a kept floating-point tensor holds NaN or Inf; the donors of the parts
    that hold it are blamed first."""
    offsets, _ = layout(snapshot.specs)
    for (name, dtype, shape), (start, length) in zip(snapshot.specs, offsets):
        if keep is not None and not keep(name):
            continue  # its bytes were not fetched
        tensor = snapshot.data[start : start + length].view(DTYPES[dtype])
        if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
            parts = range(start // PART_BYTES, (start + length - 1) // PART_BYTES + 1)
            for donor in sorted({sources[index] for index in parts if index in sources}):
                blame(donor, "bad state", f"NaN or Inf in {name!r}")
            raise StateTransferError(f"donor state has NaN or Inf in {name!r}; not using it")


async def download_result(transport: Transport, protocol: str, donors: list[str], epoch: int, numel: int, *,
                          seconds: float = DEFAULT_TIMING.control_timeout) -> torch.Tensor:
    """The result of round ``epoch`` (``numel`` floats, as float32) from the first of ``donors``, in
    order, that kept it; all within ``seconds``. StateTransferError when none did."""
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
                return await _fetch_result(transport, protocol, donor, epoch, numel)
        except (FrameError, RemoteError, StateTransferError, EOFError, OSError, ConnectionError,
                asyncio.TimeoutError, TimeoutError) as error:
            failures.append(f"{donor}: {error or type(error).__name__}")
    raise StateTransferError(f"no donor handed over the result of round {epoch} "
                             f"({len(failures)} of {len(donors)} asked: {'; '.join(failures[:2])})")


async def _fetch_result(transport: Transport, protocol: str, donor: str, epoch: int, numel: int) -> torch.Tensor:
    element = torch.empty(0, dtype=RESULT_DTYPE).element_size()
    channel = await transport.open(donor, protocol)
    clean = False
    try:
        await channel.send({"t": "result", "epoch": epoch})
        header, length = await channel.recv_header(max_payload=numel * element)
        if header.get("t") != "result" or header.get("epoch") != epoch or header.get("numel") != numel:
            raise FrameError(f"expected the result of round {epoch} ({numel} values), got {header.get('t')!r} "
                             f"of round {header.get('epoch')!r} ({header.get('numel')!r} values)")
        if length != numel * element:
            raise FrameError(f"the result is {length} bytes, expected {numel * element}")
        received = torch.empty(numel, dtype=RESULT_DTYPE)
        await channel.recv_payload_into(memoryview(received.view(torch.uint8).numpy()))
        await channel.send({"t": "done"})
        clean = True
    finally:
        await (channel.close() if clean else channel.abort())
    result = received.to(torch.float32)
    if not bool(torch.isfinite(result).all()):
        raise StateTransferError(f"the result of round {epoch} has NaN or Inf; not using it")
    return result


def expect_kind_header(header: dict, kind: str, version: int, index: int) -> None:
    if header.get("t") != kind or header.get("version") != version or header.get("index") != index:
        raise FrameError(f"expected {kind} {index} of version {version}, got {header.get('t')!r} "
                         f"{header.get('index')!r} of version {header.get('version')!r}")
