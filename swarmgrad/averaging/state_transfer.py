"""Handing a peer's whole state (named tensors plus small metadata) to a peer that joins late.

A donor keeps its latest ``StateSnapshot`` (and the one before, so a download that started just
before the donor moved on can finish). A joiner asks every candidate donor for its snapshot's
description, takes the version a majority of them hold (below), and fetches the bytes in parts
spread over those donors (DESIGN invariant 8): each donor serves a share, a donor that fails mid-way
has its parts fetched from the others, and nothing is used until every byte arrived and every
floating-point value is finite.

State a joiner can trust: a description carries a hash of every part. The joiner takes a version and
layout only when strictly more than half of the donors that answered describe it (a lone donor is
its own majority: a fresh swarm of two must take in a joiner, and with one donor there is nobody to
outvote it; a donor describes every version it holds, so one that just moved on still agrees on the
version before), fetches parts only from those donors, each part only from donors that describe the
majority's hash for it, and checks every part against that hash on arrival: a donor whose part
fails is dropped and its parts fetched from the others. Donors that disagreed or served bad bytes
are named in ``suspicions`` (and logged). On a part where honest donors legitimately differ (a
local inner optimizer's moments) no hash has a majority: the most common one is taken. A joiner that needs only some of the tensors (``keep``) fetches only
the parts that hold them.

Protocol (one channel per donor, any number of requests on it, then ``done``: on the direct data
plane the connection is pooled, so the end of an exchange is said, not inferred from a close):
    -> {"t": "describe"}                      <- {"t": "state", "version", "digest", "nbytes"} (of the latest)
                                                 + msgpack({"held": [[version, digest, nbytes, msgpack(specs, meta, parts)], ...]})
    -> {"t": "part", "version", "index"}      <- {"t": "part", "version", "index"} + raw bytes
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

PART_BYTES = 4 * 1024 * 1024
PART_HASH_BYTES = 16  # sha256, cut: a donor would have to find a second preimage
ALIGNMENT = 8  # bytes; the largest element size we carry
MAX_DESCRIPTION_BYTES = 16 * 1024 * 1024
MAX_HELD = 4  # versions one donor may describe
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

    def part_hashes(self) -> list[bytes]:
        """The hash of every ``PART_BYTES`` part of ``data``, as the description carries them."""
        view = memoryview(self.data.numpy())
        return [hashlib.sha256(view[start : start + PART_BYTES]).digest()[:PART_HASH_BYTES]
                for start in range(0, self.nbytes, PART_BYTES)]

    def describe(self, parts: list[bytes] | None = None) -> bytes:
        return msgpack.packb({"specs": [[n, d, list(s)] for n, d, s in self.specs], "meta": self.meta,
                              "parts": self.part_hashes() if parts is None else parts}, use_bin_type=True)


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
    """The specs and metadata of one state's description, checked against ``nbytes``."""
    return _parse_state(payload, nbytes)[:2]


def _parse_state(payload: bytes, nbytes: int) -> tuple[tuple, dict, tuple[bytes, ...]]:
    """Specs, metadata and part hashes of one state's description, checked against ``nbytes``."""
    try:
        described = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        specs = tuple(
            (str(name), str(dtype), tuple(int(d) for d in shape)) for name, dtype, shape in described["specs"]
        )
        meta, parts = described["meta"], tuple(described["parts"])
    except Exception as error:
        raise FrameError(f"state description is malformed: {error}") from None
    if not isinstance(meta, dict):
        raise FrameError("state metadata must be a map")
    if len(parts) != math.ceil(nbytes / PART_BYTES) or not all(isinstance(h, bytes) and len(h) == PART_HASH_BYTES
                                                               for h in parts):
        raise FrameError(f"state description must hash each of its {math.ceil(nbytes / PART_BYTES)} part(s)")
    for name, dtype, shape in specs:
        if dtype not in DTYPES or any(d < 0 for d in shape):
            raise FrameError(f"state tensor {name!r}: bad dtype {dtype!r} or shape {shape}")
    if layout(specs)[1] != nbytes:
        raise FrameError(f"state description adds up to {layout(specs)[1]} bytes, the donor claims {nbytes}")
    return specs, meta, parts


class StateServer:
    """Serves this peer's latest snapshots to joiners over ``protocol``."""

    def __init__(self, transport: Transport, protocol: str, keep: int = 2,
                 idle_seconds: float = DEFAULT_TIMING.join_timeout):
        self.transport, self.protocol, self.keep, self.idle_seconds = transport, protocol, keep, idle_seconds
        self._snapshots: dict[int, StateSnapshot] = {}
        self._described: dict[int, bytes] = {}

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
        self._described.pop(snapshot.version, None)  # described (parts hashed) when first asked for
        for version in sorted(self._snapshots)[: -self.keep]:
            self._snapshots.pop(version)
            self._described.pop(version, None)

    async def _description(self, snapshot: StateSnapshot) -> bytes:
        described = self._described.get(snapshot.version)
        if described is None:  # hashing a large state takes a while: off the event loop
            described = snapshot.describe(await asyncio.to_thread(snapshot.part_hashes))
            if self._snapshots.get(snapshot.version) is snapshot:
                self._described[snapshot.version] = described
        return described

    async def _held(self) -> bytes:
        """Every snapshot held, newest first: a joiner counts this donor for each of their versions."""
        held = [[version, snapshot.digest, snapshot.nbytes, await self._description(snapshot)]
                for version, snapshot in sorted(self._snapshots.items(), reverse=True)[:MAX_HELD]]
        return msgpack.packb({"held": held}, use_bin_type=True)

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
                                    "nbytes": latest.nbytes}, await self._held())
            elif request.kind == "part":
                version = field(request.header, "version", int)
                snapshot = self._snapshots.get(version)
                if snapshot is None:
                    await channel.send_error(f"version {version} is no longer held here")
                    return
                index = int_field(request.header, "index", 0, max(0, math.ceil(snapshot.nbytes / PART_BYTES) - 1))
                part = snapshot.data[index * PART_BYTES : (index + 1) * PART_BYTES]
                await channel.send({"t": "part", "version": version, "index": index}, memoryview(part.numpy()))
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
    parts: tuple[bytes, ...] = ()  # the hash of each part, as this donor describes it


async def download_state(transport: Transport, protocol: str, donors: list[str], *,
                         seconds: float = DEFAULT_TIMING.join_timeout,
                         min_version: int = 0, max_bytes: int = MAX_STATE_BYTES,
                         keep: Callable[[str], bool] | None = None,
                         suspicions: dict[str, list[str]] | None = None) -> StateSnapshot:
    """The state a majority of ``donors`` agree on, fetched in parts spread over the donors that agree.

    ``keep``: which tensors (by name) to fetch; the snapshot holds only those, and only the parts
    that hold them travel. ``suspicions``: filled with the reasons (per donor id) why donors were
    not trusted: they described another state than the majority's, or served a part that fails its
    hash. Raises StateTransferError when no state at a version >= ``min_version`` is described by
    strictly more than half of the donors that answered, or the transfer cannot be completed within
    ``seconds``.
    """
    if not donors:
        raise StateTransferError("no peer to download the state from")
    suspicions = {} if suspicions is None else suspicions
    offers: list[_Offer] = []  # one per version each donor holds
    try:
        async with timeout(seconds):
            described = await asyncio.gather(*(_describe(transport, protocol, d, max_bytes) for d in donors),
                                             return_exceptions=True)
            for donor, outcome in zip(donors, described):
                if isinstance(outcome, list):
                    offers.extend(outcome)
                else:
                    logger.info("donor %s cannot share its state: %s", donor, outcome)
            sources = _majority(offers, min_version, len(donors), suspicions)
            # one part may take a quarter of the budget (a slow donor's parts move to the others),
            # and never less than 2 s: 4 MiB at 20 Mbit/s
            return await _fetch(sources, part_seconds=max(2.0, seconds / 4), keep=keep, suspicions=suspicions)
    except (asyncio.TimeoutError, TimeoutError):
        raise StateTransferError(f"state download did not finish within {seconds:.0f} s") from None
    finally:
        channels = {id(offer.channel): offer.channel for offer in offers}.values()
        await asyncio.gather(*(_finish(channel) for channel in channels), return_exceptions=True)


def _suspect(suspicions: dict[str, list[str]], donor: str, reason: str) -> None:
    logger.warning("state donor %s: %s", donor, reason)
    suspicions.setdefault(donor, []).append(reason)


def _majority(offers: list[_Offer], min_version: int, asked: int, suspicions: dict[str, list[str]]) -> list[_Offer]:
    """The offers of the newest state (version and layout) that strictly more than half of the donors
    that answered hold, one per donor; donors that claim a newer version or another layout are suspects
    (those that are only behind are not)."""
    if not any(offer.version >= min_version for offer in offers):
        raise StateTransferError(f"none of {asked} peer(s) offered a state at version >= {min_version}")
    answered = {offer.donor for offer in offers}
    holders: dict[tuple[int, str], list[_Offer]] = {}
    for offer in offers:
        holders.setdefault((offer.version, offer.digest), []).append(offer)
    agreed = [key for key, held in holders.items() if 2 * len({o.donor for o in held}) > len(answered)
              and key[0] >= min_version]
    if not agreed:
        held = ", ".join(f"{v}:{d[:8]} x{len(o)}" for (v, d), o in sorted(holders.items(), reverse=True))
        raise StateTransferError(f"no state at version >= {min_version} is held by a majority of the "
                                 f"{len(answered)} donor(s) that answered ({held})")
    version, digest = max(agreed)
    sources = list({offer.donor: offer for offer in holders[(version, digest)]}.values())
    for donor in sorted(answered - {offer.donor for offer in sources}):
        described = max((o.version, o.digest) for o in offers if o.donor == donor)
        if described[0] < version:  # behind the swarm: no liar
            logger.info("donor %s holds only versions up to %d", donor, described[0])
            continue
        _suspect(suspicions, donor, f"described version {described[0]} layout {described[1][:8]}, "
                                    f"the majority holds version {version} layout {digest[:8]}")
    return sources


async def _finish(channel: Channel) -> None:
    try:
        await channel.send({"t": "done"})
    finally:
        await channel.close()


async def _describe(transport: Transport, protocol: str, donor: str, max_bytes: int) -> list[_Offer]:
    """One offer per version ``donor`` holds (newest first), all on one channel."""
    channel = await transport.open(donor, protocol)
    try:
        await channel.send({"t": "describe"})
        reply = expect_kind(await channel.recv(max_payload=MAX_DESCRIPTION_BYTES), "state")
        try:
            held = msgpack.unpackb(bytes(reply.payload), raw=False)["held"]
            entries = [(int(version), str(digest), int(nbytes), bytes(described))
                       for version, digest, nbytes, described in held[:MAX_HELD]]
        except Exception as error:
            raise FrameError(f"state description is malformed: {error}") from None
        latest = (field(reply.header, "version", int), field(reply.header, "digest", str),
                  int_field(reply.header, "nbytes", 0, max_bytes))
        if not entries or entries[0][:3] != latest:
            raise FrameError(f"the donor's header says {latest}, its description {entries[0][:3] if entries else 'nothing'}")
        offers = []
        for version, digest, nbytes, described in entries:
            if not 0 <= nbytes <= max_bytes:
                raise FrameError(f"state of {nbytes} bytes is out of range 0..{max_bytes}")
            specs, meta, parts = _parse_state(described, nbytes)
            offers.append(_Offer(donor, channel, version, digest, nbytes, specs, meta, parts))
        return offers
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


def _agreed_parts(sources: list[_Offer], parts: list[int],
                  suspicions: dict[str, list[str]]) -> dict[int, tuple[bytes, set[str]]]:
    """For each part, the hash most ``sources`` describe and the donors that describe it; a donor
    outvoted by a strict majority on a part is a suspect (it serves no part then)."""
    agreed: dict[int, tuple[bytes, set[str]]] = {}
    outvoted: dict[str, list[int]] = {}
    for index in parts:
        digest, count = Counter(offer.parts[index] for offer in sources).most_common(1)[0]
        agreed[index] = (digest, {offer.donor for offer in sources if offer.parts[index] == digest})
        if 2 * count > len(sources):
            for offer in sources:
                if offer.parts[index] != digest:
                    outvoted.setdefault(offer.donor, []).append(index)
        elif len(sources) > 1:
            logger.info("state part %d: no hash has a majority of %d donors; taking the most common",
                        index, len(sources))
    for donor, indices in outvoted.items():
        _suspect(suspicions, donor, f"described other bytes than the majority for part(s) {indices[:8]}")
        for index in parts:
            agreed[index][1].discard(donor)
    return agreed


async def _fetch(sources: list[_Offer], part_seconds: float, keep: Callable[[str], bool] | None,
                 suspicions: dict[str, list[str]]) -> StateSnapshot:
    """Every needed part from a donor that describes the agreed hash for it, checked against that hash;
    a donor that errs, stalls for ``part_seconds`` or serves bad bytes hands its parts on."""
    first = sources[0]
    data = torch.empty(first.nbytes, dtype=torch.uint8)
    target = memoryview(data.numpy())
    parts = parts_holding(first.specs, keep)
    agreed = _agreed_parts(sources, parts, suspicions)
    random.shuffle(sources)  # joiners arriving together start on different donors
    pending: list[int] = list(parts)
    healthy = [offer for offer in sources if any(offer.donor in agreed[i][1] for i in parts)]

    async def worker(offer: _Offer) -> None:
        while True:
            index = next((i for i in pending if offer.donor in agreed[i][1]), None)
            if index is None:
                return
            pending.remove(index)
            try:
                async with timeout(part_seconds):
                    await offer.channel.send({"t": "part", "version": offer.version, "index": index})
                    header, length = await offer.channel.recv_header(max_payload=PART_BYTES)
                    expect_kind_header(header, "part", offer.version, index)
                    expected = min(PART_BYTES, offer.nbytes - index * PART_BYTES)
                    if length != expected:
                        raise FrameError(f"part {index} is {length} bytes, expected {expected}")
                    landed = target[index * PART_BYTES : index * PART_BYTES + length]
                    await offer.channel.recv_payload_into(landed)
                if hashlib.sha256(landed).digest()[:PART_HASH_BYTES] != agreed[index][0]:
                    _suspect(suspicions, offer.donor, f"served bytes for part {index} that fail its agreed hash")
                    raise FrameError(f"part {index} fails its hash")
            except (FrameError, RemoteError, EOFError, OSError, ConnectionError, asyncio.TimeoutError,
                    TimeoutError) as error:
                logger.info("donor %s failed on part %d: %s; the others take over", offer.donor, index, error)
                pending.append(index)  # another donor fetches it
                healthy.remove(offer)
                await offer.channel.abort()  # nothing more may land in the buffer from this donor
                return

    # a donor that failed late leaves parts for another pass, to the donors that agree on them
    while pending and any(offer.donor in agreed[i][1] for offer in healthy for i in pending):
        await asyncio.gather(*(worker(offer) for offer in list(healthy)))
    if pending:
        raise StateTransferError(f"every donor failed: {len(pending)} of {len(parts)} parts missing")
    snapshot = StateSnapshot(first.version, first.specs, first.meta, data)
    if keep is not None:  # repack the kept tensors: every byte of theirs was fetched, the rest is unset
        kept = {name: tensor for name, tensor in snapshot.tensors().items() if keep(name)}
        snapshot = StateSnapshot.capture(first.version, kept, first.meta)
    for name, tensor in snapshot.tensors().items():
        if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
            raise StateTransferError(f"donor state has NaN or Inf in {name!r}; not using it")
    return snapshot


def expect_kind_header(header: dict, kind: str, version: int, index: int) -> None:
    if header.get("t") != kind or header.get("version") != version or header.get("index") != index:
        raise FrameError(f"expected {kind} {index} of version {version}, got {header.get('t')!r} "
                         f"{header.get('index')!r} of version {header.get('version')!r}")
