"""Handing a peer's whole state (named tensors plus small metadata) to a peer that joins late.

A donor keeps its latest ``StateSnapshot`` (and the one before, so a download that started just
before the donor moved on can finish), and the results of its last rounds: a peer that missed a
round (or whose download ended with the swarm a round further) replays that round's result on its
own state instead of downloading the whole state again, for a fraction of the bytes.

A joiner takes a state only when a majority of the donors it asked agree on it (issue 15, item 4),
since any donor may lie:
1. Version by majority: it asks every candidate donor for its snapshot's description and takes the
   highest version a strict majority of those that answered reached (``majority_version``), never
   simply the highest claimed: one donor claiming version 10^6 does not win alone. A donor further
   on describes that version again if it still holds it (it keeps two); one that does not drops out.
2. Agreement by sketches: honest donors never hold identical bytes (each peer's optimizer moments
   are its own, and moshpit groups leave parameters a little apart), so donors are compared up to a
   tolerance, by sketches: a few random ±1 projections per part of each tolerance class's values,
   drawn from a nonce the joiner picks (``sketch``, ``TOLERANCES``). The coordinate-wise median of
   the donors' sketches is the reference; a donor agrees when each of its parts lies within the
   class's tolerance of it (``agreeing``). Fewer agreeing donors than a strict majority of those that
   answered: StateTransferError ("the donors disagree on the state"); with a majority, the others are
   blamed ("digest disagreement"). Parts are fetched only from agreeing donors, spread over them
   (DESIGN invariant 8): each serves a share, and one that fails mid-way has its parts fetched from
   the others.
3. Verification with a second nonce, drawn once the bytes are in (so no donor could shape what it
   served to the projections it would be checked with): the agreeing donors sketch again, and each
   part of the assembled state must lie within tolerance of their median. A part that does not is
   blamed ("bad state") on the donor that served it, which serves nothing more, and fetched again
   from another agreeing donor, then checked with a fresh nonce (at most ``VERIFY_PASSES`` passes).
Nothing is used until every part passed and every floating-point value is finite. A joiner that
needs only some of the tensors (``keep``) fetches, compares and checks only the parts that hold
them. A donor that broke the protocol (a malformed description, part or sketch) is blamed "invalid
frame", one that served NaN or Inf "bad state", on the transport's admission (accountability.py):
enough of that bans it. A swarm of two (one donor) stays joinable: a single donor is its own
majority, and what it serves is checked for consistency with its own sketches only.

Protocol (one channel per donor, any number of requests on it, then ``done``: on the direct data
plane the connection is pooled, so the end of an exchange is said, not inferred from a close):
    -> {"t": "describe"[, "version"]}         <- {"t": "state", "version", "digest", "nbytes"} + msgpack(specs, meta)
    -> {"t": "sketch", "version", "seed"}     <- {"t": "sketch", "version", "seed", "parts", "classes", "k"}
                                                 + float32[parts][classes][k]
    -> {"t": "part", "version", "index"}      <- {"t": "part", "version", "index"} + raw bytes
    -> {"t": "result", "epoch"[, "frames"]}   <- {"t": "result", "epoch", "numel"} + bfloat16 bytes, or, when
                                                 asked for frames and kept: {"t": "result", "epoch", "numel",
                                                 "frames": n} then the n chunk frames it travelled in
    -> {"t": "digest", "epoch"}               <- {"t": "digest", "epoch", "sha256"} (of those bytes)
    -> {"t": "done"}
``describe`` without a version describes the latest snapshot. A sketch costs the donor about one
pass over its state (measured: 24 ms per MiB of compared values, on a loaded 2-core machine), off the
event loop: donors compute one at a time, keep the last
``SKETCH_CACHE`` by (version, seed), and answer at most ``SKETCHES_PER_CHANNEL`` per channel (one to
compare, one per verification pass); past that the request is an invalid frame.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence

import msgpack
import numpy as np
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
# older snapshots a donor keeps while downloads under way still read them (past its latest ``keep``):
# on a slow link a state takes longer than an epoch (40 MB at 10 Mbit/s: 32 s, against epochs of
# 8 s), and a download whose version the donor dropped failed on every retry; bounded, since each
# held snapshot is a copy of the whole state and any peer may open a channel
PINNED_SNAPSHOTS = 2
ALIGNMENT = 8  # bytes; the largest element size we carry
MAX_DESCRIPTION_BYTES = 16 * 1024 * 1024
MAX_STATE_BYTES = 64 * 1024 * 1024 * 1024
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}

# How far a donor's tensors may lie from the donors' median and still agree, relative to the
# median's norm, per part; the first prefix a tensor's name starts with decides (peer/state.py names
# them). Measured (3 digits peers, DiLoCo, 42 epochs, group size 2, so one averaged alone each round):
# parameters 2.1% apart at most (0.08% between two that shared groups), outer momentum 76%; in the
# sketches, over 50 nonces, the loner lay at most 3.8% (parameters) and 2.48x (momentum) from the median.
TOLERANCES: tuple[tuple[str, float | None], ...] = (
    ("optimizer/", None),  # each peer's own inner-optimizer moments: never compared, taken from agreeing donors
    # outer momentum, each peer's sum of its own groups' averages: blocks one rescaled 4x or more (or
    # -10x); a momentum merely negated (2x its norm away) stays within
    ("strategy/", 3.0),
    ("", 0.1),  # the model and anything else: a donor can shift a joiner's parameters by 10% at most
)
# an absolute floor on the tolerance, per value (RMS): parts that are (nearly) zero, like a fresh momentum
SKETCH_FLOOR = 1e-6
# ±1 projections per part and class: with 8, a sketch's distance is 0.45..1.8x the true one at 99.9%
# (chi with 8 degrees of freedom), inside the margins between measured spreads and the tolerances
SKETCH_PROJECTIONS = 8
VERIFY_PASSES = 3  # nonce-2 checks of what arrived: the first, and two after refetching failed parts
SKETCHES_PER_CHANNEL = 1 + VERIFY_PASSES  # what a joiner asks of one donor: one to compare, one per pass
SKETCH_CACHE = 4  # sketches a donor keeps, by (version, seed)
MAX_SEED = 2**63 - 1


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
        """Identifies the layout (names, dtypes, shapes), not the values: donors with equal digests lay
        their bytes out alike, so their parts and sketches compare part by part (values agree only up
        to a tolerance: ``agreeing``)."""
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


def _element_size(dtype: str) -> int:
    return torch.empty(0, dtype=DTYPES[dtype]).element_size()


def layout(specs: Sequence[tuple[str, str, tuple[int, ...]]]) -> tuple[list[tuple[int, int]], int]:
    """(offset, length) of each tensor in the byte buffer, and its total size. Offsets are
    multiples of 8, so every tensor can be viewed in place as its own dtype."""
    offsets, position = [], 0
    for _, dtype, shape in specs:
        length = math.prod(shape) * _element_size(dtype)
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


def tolerance_of(name: str) -> float | None:
    """The tolerance ``TOLERANCES`` gives tensor ``name``: None when it is never compared."""
    for prefix, tolerance in TOLERANCES:
        if name.startswith(prefix):
            return tolerance
    return None


# the compared classes, in table order: a sketch holds one row of projections per part and class
CLASSES: tuple[float, ...] = tuple(tolerance for _, tolerance in TOLERANCES if tolerance is not None)


def _segments(specs: Sequence[tuple[str, str, tuple[int, ...]]]) -> dict[int, list[list[tuple[int, int, str]]]]:
    """Part -> per class, the (start, end, dtype) byte ranges of the compared tensors' values in it:
    floating-point tensors only (integer and bool ones are counters and flags each peer keeps, such
    as BatchNorm's num_batches_tracked: rounds average only parameters). Offsets are multiples of 8
    and so is a part's size: no value straddles two parts."""
    offsets, _ = layout(specs)
    segments: dict[int, list[list[tuple[int, int, str]]]] = {}
    for (name, dtype, _), (start, length) in zip(specs, offsets):
        tolerance = tolerance_of(name)
        if tolerance is None or not length or not DTYPES[dtype].is_floating_point:
            continue
        position, end = start, start + length
        while position < end:
            part = position // PART_BYTES
            stop = min(end, (part + 1) * PART_BYTES)
            segments.setdefault(part, [[] for _ in CLASSES])[CLASSES.index(tolerance)].append((position, stop, dtype))
            position = stop
    return segments


def compared_values(specs: Sequence[tuple[str, str, tuple[int, ...]]], parts: Sequence[int]) -> torch.Tensor:
    """How many compared values each of ``parts`` holds, per class: [len(parts), classes]."""
    segments = _segments(specs)
    counts = torch.zeros(len(parts), len(CLASSES), dtype=torch.float64)
    for row, part in enumerate(parts):
        for column, ranges in enumerate(segments.get(part, ())):
            counts[row, column] = sum((end - start) // _element_size(dtype) for start, end, dtype in ranges)
    return counts


def sketch(data: torch.Tensor, specs: Sequence[tuple[str, str, tuple[int, ...]]], seed: int,
           parts: Sequence[int]) -> torch.Tensor:
    """float32 [len(parts), classes, SKETCH_PROJECTIONS]: for each part of ``data`` (a snapshot's
    bytes, laid out by ``specs``) and each tolerance class, the projections of the class's values in
    it on ±1 vectors drawn from (seed, part, class). The signs come from SHAKE-256, so every machine
    and torch version draws the same; a class with no values in a part projects to zeros."""
    segments = _segments(specs)
    result = torch.zeros(len(parts), len(CLASSES), SKETCH_PROJECTIONS, dtype=torch.float64)
    for row, part in enumerate(parts):
        for column, ranges in enumerate(segments.get(part, ())):
            if ranges:
                pieces = [data[start:end].view(DTYPES[dtype]).to(torch.float32) for start, end, dtype in ranges]
                values = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
                result[row, column] = _project(values, seed, part, column)
    return result.to(torch.float32)


def _project(values: torch.Tensor, seed: int, part: int, column: int) -> torch.Tensor:
    width = -(-values.numel() // 8)  # bytes of signs per projection
    stream = hashlib.shake_256(b"swarmgrad/state-sketch" + struct.pack("<QQQ", seed, part, column))
    bits = np.unpackbits(np.frombuffer(stream.digest(SKETCH_PROJECTIONS * width), dtype=np.uint8))
    ones = torch.from_numpy(bits.reshape(SKETCH_PROJECTIONS, width * 8)[:, : values.numel()]).to(torch.float32)
    # a bit 1 is +1, a bit 0 is -1: the sum over the ones, twice, less the sum over all
    return 2 * (ones @ values).to(torch.float64) - values.sum(dtype=torch.float64)


def reference_sketch(sketches: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median of donors' sketches ([donors, ...]; for an even count the mean of
    the middle two): a minority of donors, however far off, cannot move it past the majority's values."""
    ordered = sketches.sort(dim=0).values
    count = ordered.shape[0]
    return (ordered[(count - 1) // 2] + ordered[count // 2]) / 2


def parts_within(candidate: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bool [parts]: whether each part of sketch ``candidate`` lies within tolerance of ``reference``
    (both [parts, classes, k]; ``counts``: ``compared_values``). The rule, for every class c of the
    part: |candidate - reference| <= CLASSES[c] * |reference| + SKETCH_FLOOR * sqrt(k * values). A
    ±1 projection keeps a vector's norm in expectation, so this is about |x - x_ref| <= tolerance *
    |x_ref| on the values themselves. NaN or Inf is never within."""
    distance = (candidate.double() - reference.double()).norm(dim=-1)
    tolerance = torch.tensor(CLASSES, dtype=torch.float64) * reference.double().norm(dim=-1)
    allowed = tolerance + SKETCH_FLOOR * (SKETCH_PROJECTIONS * counts).sqrt()
    return (distance <= allowed).all(dim=-1)


def agreeing(sketches: Mapping[str, torch.Tensor], counts: torch.Tensor) -> list[str]:
    """The donors (of ``sketches``: donor -> [parts, classes, k]) whose every part lies within
    tolerance of the donors' median (``reference_sketch``, ``parts_within``)."""
    if not sketches:
        return []
    reference = reference_sketch(torch.stack(list(sketches.values())))
    return [donor for donor, drawn in sketches.items() if bool(parts_within(drawn, reference, counts).all())]


def majority_version(versions: Sequence[int]) -> int:
    """The highest version a strict majority of ``versions`` (one per donor that answered) reached:
    sorted from the highest, the one at index n // 2. One donor's claim wins only where it is the
    only donor, so that a swarm of two (one donor) stays joinable; of two, the lower (both reached it)."""
    if not versions:
        raise ValueError("no versions to choose from")
    return sorted(versions, reverse=True)[len(versions) // 2]


class StateServer:
    """Serves this peer's latest snapshots to joiners over ``protocol``."""

    def __init__(self, transport: Transport, protocol: str, keep: int = 2,
                 idle_seconds: float = DEFAULT_TIMING.join_timeout, keep_results: int = KEPT_RESULTS):
        self.transport, self.protocol, self.keep, self.idle_seconds = transport, protocol, keep, idle_seconds
        self.keep_results = keep_results
        self._snapshots: dict[int, StateSnapshot] = {}
        self._described: dict[int, bytes] = {}
        self._readers: Counter[int] = Counter()  # version -> channels whose download reads it
        self._results: dict[int, torch.Tensor] = {}
        self._result_digests: dict[int, str] = {}
        self._result_frames: dict[int, list[tuple[dict, bytes]]] = {}
        self._sketches: dict[tuple[int, int], bytes] = {}  # (version, seed) -> a sketch, oldest first
        self._sketching = asyncio.Lock()  # one sketch at a time: joiners cannot make this peer compute more

    async def __aenter__(self) -> StateServer:
        await self.transport.serve(self.protocol, self._serve)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.transport.stop_serving(self.protocol)

    @property
    def latest(self) -> StateSnapshot | None:
        return self._snapshots[max(self._snapshots)] if self._snapshots else None

    def publish(self, snapshot: StateSnapshot) -> None:
        for version in [version for version in self._snapshots if version > snapshot.version]:
            self._snapshots.pop(version)  # this peer went back to the swarm's epoch: what it held past it goes
            self._described.pop(version)
        self._snapshots[snapshot.version] = snapshot
        self._described[snapshot.version] = snapshot.describe()
        self._drop_old()

    def _drop_old(self) -> None:
        """Keep the latest ``keep`` snapshots, and the newest ``PINNED_SNAPSHOTS`` older ones that a
        download under way reads."""
        older = sorted(self._snapshots)[: -self.keep]
        read = [version for version in older if self._readers[version] > 0]
        read = read[max(0, len(read) - PINNED_SNAPSHOTS):]
        for version in older:
            if version not in read:
                self._snapshots.pop(version)
                self._described.pop(version)

    def _reading(self, channel_version: int | None, version: int | None) -> int | None:
        """A channel's download moves from ``channel_version`` to ``version`` (None: it ended)."""
        if channel_version == version:
            return version
        if version is not None:
            self._readers[version] += 1
        if channel_version is not None:
            self._readers[channel_version] -= 1
            if self._readers[channel_version] <= 0:
                del self._readers[channel_version]
            self._drop_old()
        return version

    def publish_result(self, epoch: int, result: torch.Tensor, frames: list[tuple[dict, bytes]] | None = None) -> None:
        """Keep what round ``epoch`` applied here (a flat float tensor: the swarm's average, or this
        peer's own values when it stepped alone), for a peer that missed the round to replay; with
        the ``frames`` it travelled in (averaging/result_frames.py), which decode to exactly it."""
        if self.keep_results < 1:
            return
        for later in [later for later in self._results if later > epoch]:
            self._drop_result(later)  # rounds of a lead this peer gave up (it rejoined the swarm's epoch)
        kept = result.detach().to("cpu").reshape(-1).to(RESULT_DTYPE, copy=True)
        self._results[epoch], self._result_digests[epoch] = kept, result_digest(kept)
        self._result_frames.pop(epoch, None)
        if frames is not None:
            self._result_frames[epoch] = frames
        for old in sorted(self._results)[: -self.keep_results]:
            self._drop_result(old)

    def _drop_result(self, epoch: int) -> None:
        self._results.pop(epoch)
        self._result_digests.pop(epoch)
        self._result_frames.pop(epoch, None)

    async def _serve(self, channel: Channel) -> None:
        sketches = 0  # asked on this channel
        reading: int | None = None  # the version this channel's joiner described last: held while it reads
        try:
            while True:
                try:
                    async with timeout(self.idle_seconds):  # an idle joiner does not hold the stream forever
                        request = await channel.recv(max_payload=0)
                except EOFError:
                    return
                if request.kind == "done":
                    return
                if request.kind == "describe":
                    if "version" in request.header:  # a joiner that chose a version by majority
                        snapshot = self._snapshots.get(field(request.header, "version", int))
                        if snapshot is None:
                            await channel.send_error(f"version {request.header['version']} is no longer held here")
                            return
                    else:
                        snapshot = self.latest
                        if snapshot is None:
                            await channel.send_error("this peer has no state to share yet")
                            return
                    reading = self._reading(reading, snapshot.version)
                    await channel.send({"t": "state", "version": snapshot.version, "digest": snapshot.digest,
                                        "nbytes": snapshot.nbytes}, self._described[snapshot.version])
                elif request.kind == "sketch":
                    version = field(request.header, "version", int)
                    seed = int_field(request.header, "seed", 0, MAX_SEED)
                    sketches += 1
                    if sketches > SKETCHES_PER_CHANNEL:
                        raise FrameError(f"more than {SKETCHES_PER_CHANNEL} sketch requests on one channel")
                    snapshot = self._snapshots.get(version)
                    if snapshot is None:
                        await channel.send_error(f"version {version} is no longer held here")
                        return
                    parts = math.ceil(snapshot.nbytes / PART_BYTES)
                    await channel.send({"t": "sketch", "version": version, "seed": seed, "parts": parts,
                                        "classes": len(CLASSES), "k": SKETCH_PROJECTIONS},
                                       await self._sketch(snapshot, seed))
                elif request.kind == "part":
                    version = field(request.header, "version", int)
                    snapshot = self._snapshots.get(version)
                    if snapshot is None:
                        await channel.send_error(f"version {version} is no longer held here")
                        return
                    index = int_field(request.header, "index", 0, max(0, math.ceil(snapshot.nbytes / PART_BYTES) - 1))
                    part = snapshot.data[index * PART_BYTES : (index + 1) * PART_BYTES]
                    await channel.send({"t": "part", "version": version, "index": index}, memoryview(part.numpy()))
                elif request.kind in ("result", "digest"):
                    epoch = field(request.header, "epoch", int)
                    if epoch not in self._results:
                        await channel.send_error(f"the result of round {epoch} is not kept here")
                        return
                    if request.kind == "digest":
                        await channel.send({"t": "digest", "epoch": epoch, "sha256": self._result_digests[epoch]})
                    else:
                        await self._send_result(channel, epoch, request.header.get("frames") is True)
                else:
                    raise FrameError(f"unexpected request {request.kind!r}")
        finally:
            self._reading(reading, None)

    async def _send_result(self, channel: Channel, epoch: int, frames_asked: bool) -> None:
        """A kept result: in the frames it travelled in when asked for them and kept, else as bfloat16."""
        result, frames = self._results[epoch], self._result_frames.get(epoch) if frames_asked else None
        if frames is None:
            await channel.send({"t": "result", "epoch": epoch, "numel": result.numel()},
                               memoryview(result.view(torch.uint8).numpy()))
            return
        await channel.send({"t": "result", "epoch": epoch, "numel": result.numel(), "frames": len(frames)})
        for header, payload in frames:
            await channel.send(header, payload)

    async def _sketch(self, snapshot: StateSnapshot, seed: int) -> bytes:
        """The sketch of ``snapshot`` for ``seed``, computed off the event loop, one at a time, kept for reuse."""
        key = (snapshot.version, seed)
        async with self._sketching:
            if key not in self._sketches:
                parts = list(range(math.ceil(snapshot.nbytes / PART_BYTES)))
                drawn = await asyncio.to_thread(sketch, snapshot.data, snapshot.specs, seed, parts)
                self._sketches[key] = drawn.numpy().tobytes()
                while len(self._sketches) > SKETCH_CACHE:
                    self._sketches.pop(next(iter(self._sketches)))
            return self._sketches[key]


@dataclass
class _Offer:
    donor: str
    channel: Channel
    version: int
    digest: str
    nbytes: int
    specs: tuple
    meta: dict
    broken: bool = False  # its channel failed or was dropped: a later sketch takes a new one


Blame = Callable[[str, str, str], None]


async def download_state(transport: Transport, protocol: str, donors: list[str], *,
                         seconds: float = DEFAULT_TIMING.join_timeout,
                         min_version: int = 0, max_bytes: int = MAX_STATE_BYTES,
                         keep: Callable[[str], bool] | None = None) -> StateSnapshot:
    """The state a strict majority of ``donors`` agree on, fetched in parts spread over those donors
    and verified once it is in (the rules: the module docstring).

    ``keep``: which tensors (by name) to fetch; the snapshot holds only those, and only the parts
    that hold them travel and are compared. Raises StateTransferError, using nothing, when no donor
    answers, when the version a majority of them reached is below ``min_version``, when fewer than
    a strict majority of the donors that answered agree on the state, when a part fails every
    verification pass, or when ``seconds`` pass without a part landing. Each part that lands gives
    the transfer ``seconds`` more: a state that takes longer than that on a slow link (40 MB at
    5 Mbit/s is 64 s) still comes in while it keeps moving, and how long a donor can hold a joiner
    stays bounded by the parts (each lands once, within ``part_seconds``).
    """
    if not donors:
        raise StateTransferError("no peer to download the state from")
    offers: list[_Offer] = []
    blame: Blame = lambda donor, kind, detail: _blame(transport, donor, kind, detail)
    # one part (or sketch) may take a quarter of the budget (a slow donor's parts move to the
    # others), and never less than 2 s: 4 MiB at 20 Mbit/s
    part_seconds = max(2.0, seconds / 4)
    try:
        async with timeout(seconds) as budget:
            def moving() -> None:  # a part landed
                budget.reschedule(asyncio.get_running_loop().time() + seconds)

            described = await asyncio.gather(*(_describe(transport, protocol, d, max_bytes) for d in donors),
                                             return_exceptions=True)
            for donor, outcome in zip(donors, described):
                if isinstance(outcome, _Offer):
                    offers.append(outcome)
                else:
                    logger.info("donor %s cannot share its state: %s", donor, outcome)
                    if isinstance(outcome, FrameError):
                        blame(donor, "invalid frame", str(outcome))
            if not offers:
                raise StateTransferError(f"none of {len(donors)} peer(s) offered a state at version >= {min_version}")
            version = majority_version([offer.version for offer in offers])
            if version < min_version:
                raise StateTransferError(f"no majority of the {len(offers)} donor(s) offered a state at version >= "
                                         f"{min_version} (a majority reached {version})")
            held = await asyncio.gather(*(_hold(offer, version, max_bytes, part_seconds) for offer in offers),
                                        return_exceptions=True)
            holders = []
            for offer, outcome in zip(offers, held):
                if outcome is True:
                    holders.append(offer)
                elif outcome is not False:
                    logger.info("donor %s cannot describe version %d: %s", offer.donor, version, outcome)
                    if isinstance(outcome, FrameError):
                        blame(offer.donor, "invalid frame", str(outcome))
            sources = await _agreeing_sources(holders, version, keep, part_seconds, blame)

            async def sketch_of(offer: _Offer, seed: int) -> torch.Tensor:
                return await _verification_sketch(transport, protocol, offer, seed, part_seconds)

            return await _fetch(sources, part_seconds=part_seconds, keep=keep, blame=blame, sketch_of=sketch_of,
                                moving=moving)
    except (asyncio.TimeoutError, TimeoutError):
        raise StateTransferError(f"state download stalled: nothing landed for {seconds:.0f} s") from None
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
        return await _described(donor, channel, max_bytes)
    except BaseException:
        await channel.close()
        raise


async def _described(donor: str, channel: Channel, max_bytes: int) -> _Offer:
    reply = expect_kind(await channel.recv(max_payload=MAX_DESCRIPTION_BYTES), "state")
    nbytes = int_field(reply.header, "nbytes", 0, max_bytes)
    specs, meta = _parse_description(bytes(reply.payload), nbytes)
    return _Offer(donor, channel, field(reply.header, "version", int), field(reply.header, "digest", str),
                  nbytes, specs, meta)


async def _hold(offer: _Offer, version: int, max_bytes: int, seconds: float) -> bool:
    """Whether ``offer``'s donor holds ``version``; one further on describes it again (and ``offer``
    becomes that description), one behind does not hold it."""
    if offer.version <= version:
        return offer.version == version
    try:
        async with timeout(seconds):
            await offer.channel.send({"t": "describe", "version": version})
            again = await _described(offer.donor, offer.channel, max_bytes)
    except RemoteError:  # it moved on further: no longer held (and the donor ended the channel)
        offer.broken = True
        return False
    except BaseException:
        offer.broken = True
        await offer.channel.abort()
        raise
    if again.version != version:
        raise FrameError(f"asked to describe version {version}, the donor described {again.version}")
    offer.version, offer.digest, offer.nbytes, offer.specs, offer.meta = (
        again.version, again.digest, again.nbytes, again.specs, again.meta)
    return True


async def _ask_sketch(channel: Channel, version: int, seed: int, nbytes: int) -> torch.Tensor:
    """The donor's sketch of ``version`` for ``seed``: [parts, classes, k] float32, of the right size."""
    parts = math.ceil(nbytes / PART_BYTES)
    size = parts * len(CLASSES) * SKETCH_PROJECTIONS * 4
    await channel.send({"t": "sketch", "version": version, "seed": seed})
    reply = expect_kind(await channel.recv(max_payload=size), "sketch")
    shape = (parts, len(CLASSES), SKETCH_PROJECTIONS)
    said = tuple(reply.header.get(key) for key in ("version", "seed", "parts", "classes", "k"))
    if said != (version, seed, *shape) or len(reply.payload) != size:
        raise FrameError(f"expected a sketch of version {version} (seed {seed}) of shape {shape} in {size} bytes, "
                         f"got {said} in {len(reply.payload)} bytes")
    if not size:
        return torch.zeros(shape)
    return torch.frombuffer(bytearray(reply.payload), dtype=torch.float32).reshape(shape)


async def _sketch_on(offer: _Offer, seed: int, seconds: float) -> torch.Tensor:
    try:
        async with timeout(seconds):
            return await _ask_sketch(offer.channel, offer.version, seed, offer.nbytes)
    except BaseException:
        offer.broken = True  # a half-read reply may be left on it
        await offer.channel.abort()
        raise


async def _verification_sketch(transport: Transport, protocol: str, offer: _Offer, seed: int,
                               seconds: float) -> torch.Tensor:
    """``offer``'s donor's sketch for ``seed``, on its channel, or on a new one where that failed
    (a donor whose part timed out may still answer a sketch) or was closed after its last part
    (the other donors fetched the rest before this one's next request could find it closed)."""
    if not offer.broken:
        try:
            return await _sketch_on(offer, seed, seconds)
        except (EOFError, ConnectionError, OSError) as error:
            logger.info("donor %s closed its stream (%s); asking for the sketch on a new one", offer.donor, error)
    async with timeout(seconds):
        channel = await transport.open(offer.donor, protocol)
        clean = False
        try:
            drawn = await _ask_sketch(channel, offer.version, seed, offer.nbytes)
            await channel.send({"t": "done"})
            clean = True
            return drawn
        finally:
            await (channel.close() if clean else channel.abort())


async def _agreeing_sources(holders: list[_Offer], version: int, keep: Callable[[str], bool] | None,
                            seconds: float, blame: Blame) -> list[_Offer]:
    """The donors of ``holders`` that agree with a strict majority of those that answered: of one
    layout (the most common digest) and within tolerance of the donors' median sketch, for a nonce
    drawn here. StateTransferError when fewer agree; with a majority, the others are blamed."""
    if not holders:
        raise StateTransferError(f"no donor holds version {version} any more")
    digest = Counter(offer.digest for offer in holders).most_common(1)[0][0]
    same = [offer for offer in holders if offer.digest == digest]
    answered = [offer for offer in holders if offer.digest != digest]  # a layout of their own: disagree
    parts = parts_holding(same[0].specs, keep)
    seed = random.getrandbits(63)
    drawn = await asyncio.gather(*(_sketch_on(offer, seed, seconds) for offer in same), return_exceptions=True)
    sketches: dict[str, torch.Tensor] = {}
    not_finite = []
    for offer, outcome in zip(same, drawn):
        if not isinstance(outcome, torch.Tensor):
            logger.info("donor %s did not sketch version %d: %s", offer.donor, version, outcome)
            if isinstance(outcome, FrameError):
                blame(offer.donor, "invalid frame", str(outcome))
            continue
        answered.append(offer)
        outcome = outcome[parts]
        if bool(torch.isfinite(outcome).all()):
            sketches[offer.donor] = outcome
        else:
            names = _names_in(offer.specs, [parts[row] for row in
                                            (~torch.isfinite(outcome)).flatten(1).any(1).nonzero().flatten().tolist()])
            not_finite.append(f"{offer.donor} holds NaN or Inf in {', '.join(map(repr, names[:3]))}")
            blame(offer.donor, "bad state", f"NaN or Inf in {', '.join(names[:3])}")
    agree = set(agreeing(sketches, compared_values(same[0].specs, parts)))
    sources = [offer for offer in same if offer.donor in agree]
    if len(sources) * 2 <= len(answered):
        raise StateTransferError(f"the donors disagree on the state at version {version}: {len(sources)} of "
                                 f"{len(answered)} agree" + "".join(f"; {line}" for line in not_finite[:2]))
    for offer in answered:
        if offer.digest != digest or (offer.donor in sketches and offer.donor not in agree):
            logger.info("donor %s disagrees with the majority on the state at version %d", offer.donor, version)
            blame(offer.donor, "digest disagreement", f"version {version}")
    return sources


def _names_in(specs: Sequence[tuple[str, str, tuple[int, ...]]], parts: Sequence[int]) -> list[str]:
    """The tensors with bytes in ``parts``."""
    offsets, _ = layout(specs)
    wanted = set(parts)
    return [name for (name, _, _), (start, length) in zip(specs, offsets)
            if length and wanted & set(range(start // PART_BYTES, (start + length - 1) // PART_BYTES + 1))]


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
                 blame: Blame = lambda donor, kind, detail: None,
                 sketch_of: Callable[[_Offer, int], Awaitable[torch.Tensor]] | None = None,
                 moving: Callable[[], None] = lambda: None) -> StateSnapshot:
    """Every needed part from some donor; a donor that errs or stalls for ``part_seconds`` hands its part on.
    ``sketch_of(donor, seed)``: a donor's sketch, to verify what arrived with (``_verify``).
    ``blame(donor, kind, detail)``: told of a donor that sent an invalid part, a part that failed
    verification, or parts holding NaN or Inf. ``moving()``: called as each part lands."""
    first = sources[0]
    data = torch.empty(first.nbytes, dtype=torch.uint8)
    parts = parts_holding(first.specs, keep)
    random.shuffle(sources)  # joiners arriving together start on different donors
    done: dict[int, str] = {}  # part -> the donor it came from
    healthy = list(sources)
    await _fetch_parts(healthy, parts, data, done, part_seconds, blame, moving)
    if sketch_of is not None:
        await _verify(sources, healthy, parts, data, done, part_seconds, blame, sketch_of)
    snapshot = StateSnapshot(first.version, first.specs, first.meta, data)
    _check_finite(snapshot, keep, done, blame)
    if keep is not None:  # repack the kept tensors: every byte of theirs was fetched, the rest is unset
        kept = {name: tensor for name, tensor in snapshot.tensors().items() if keep(name)}
        snapshot = StateSnapshot.capture(first.version, kept, first.meta)
    return snapshot


async def _fetch_parts(healthy: list[_Offer], parts: Sequence[int], data: torch.Tensor, done: dict[int, str],
                       part_seconds: float, blame: Blame, moving: Callable[[], None] = lambda: None) -> None:
    """Fetch ``parts`` into ``data`` from the donors of ``healthy`` (a donor that fails leaves it),
    noting in ``done`` where each came from. StateTransferError when they all failed."""
    target = memoryview(data.numpy())
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in parts:
        queue.put_nowait(index)

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
                moving()
            except (FrameError, RemoteError, EOFError, OSError, ConnectionError, asyncio.TimeoutError,
                    TimeoutError) as error:
                logger.info("donor %s failed on part %d: %s; the others take over", offer.donor, index, error)
                if isinstance(error, FrameError):
                    blame(offer.donor, "invalid frame", str(error))
                queue.put_nowait(index)  # another donor fetches it
                healthy.remove(offer)
                offer.broken = True
                await offer.channel.abort()  # nothing more may land in the buffer from this donor
                return

    while not queue.empty() and healthy:  # a donor that failed late leaves parts for another pass
        await asyncio.gather(*(worker(offer) for offer in list(healthy)))
    missing = sum(index not in done for index in parts)
    if missing:
        raise StateTransferError(f"every donor failed: {missing} of {len(parts)} parts missing")


async def _verify(sources: list[_Offer], healthy: list[_Offer], parts: list[int], data: torch.Tensor,
                  done: dict[int, str], part_seconds: float, blame: Blame,
                  sketch_of: Callable[[_Offer, int], Awaitable[torch.Tensor]]) -> None:
    """Check every fetched part against the median of the agreeing donors' sketches for a nonce
    drawn now, once the bytes are in. A part off by more than the tolerance is blamed on the donor
    that served it, which is trusted no more, and fetched again from the others, then checked with
    a fresh nonce; at most ``VERIFY_PASSES`` passes. A strict majority of the donors still trusted
    must answer each pass (a lone liar cannot vouch for itself). StateTransferError when a pass
    cannot be made or parts still fail after the last."""
    first = sources[0]
    trusted = list(sources)
    checking = list(parts)
    for attempt in range(VERIFY_PASSES):
        seed = random.getrandbits(63)
        drawn = await asyncio.gather(*(sketch_of(offer, seed) for offer in trusted), return_exceptions=True)
        sketches = []
        for offer, outcome in zip(trusted, drawn):
            if isinstance(outcome, torch.Tensor) and bool(torch.isfinite(outcome[checking]).all()):
                sketches.append(outcome[checking])
            else:
                logger.info("donor %s did not sketch the state to verify it: %s", offer.donor, outcome)
                if isinstance(outcome, FrameError):
                    blame(offer.donor, "invalid frame", str(outcome))
        if len(sketches) * 2 <= len(trusted):
            raise StateTransferError(f"too few donors sketched the state to verify it: {len(sketches)} of {len(trusted)}")
        reference = reference_sketch(torch.stack(sketches))
        local = await asyncio.to_thread(sketch, data, first.specs, seed, checking)
        fine = parts_within(local, reference, compared_values(first.specs, checking)).tolist()
        failed = [index for index, good in zip(checking, fine) if not good]
        if not failed:
            return
        culprits = Counter(done[index] for index in failed)
        for donor, count in culprits.items():
            logger.info("donor %s served %d part(s) that do not match the donors' sketches; fetching them again",
                        donor, count)
            blame(donor, "bad state", f"{count} part(s) of version {first.version} off the donors' sketches")
        trusted = [offer for offer in trusted if offer.donor not in culprits]
        healthy[:] = [offer for offer in healthy if offer.donor not in culprits]
        if attempt + 1 == VERIFY_PASSES or not healthy:
            break
        for index in failed:
            done.pop(index)
        await _fetch_parts(healthy, failed, data, done, part_seconds, blame)
        checking = failed
    raise StateTransferError(f"{len(failed)} part(s) of the state failed verification; not using it")


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


def result_digest(kept: torch.Tensor) -> str:
    """The sha256 of a kept result's bytes (bfloat16, flat), in hex: what a donor says it holds."""
    return hashlib.sha256(memoryview(kept.view(torch.uint8).numpy())).hexdigest()


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

    def check_header(self, index: int, header: dict) -> None: ...

    def decode(self, frames: Sequence[tuple[dict, bytes]]) -> torch.Tensor: ...


async def download_result(transport: Transport, protocol: str, donors: list[str], epoch: int, numel: int, *,
                          seconds: float = DEFAULT_TIMING.control_timeout, digest: str | None = None,
                          decoder: ResultFrames | None = None) -> torch.Tensor:
    """The result of round ``epoch`` (``numel`` floats, as float32) from the first of ``donors``, in
    order, that kept it (and, given ``digest``, whose bytes have it); all within ``seconds``. With a
    ``decoder`` a donor that kept the frames the round travelled in sends those, which decode to
    the float32 values it applied (else its bfloat16 copy). StateTransferError when none did."""
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
            failures.append(f"{donor}: {error or type(error).__name__}")
    raise StateTransferError(f"no donor handed over the result of round {epoch} "
                             f"({len(failures)} of {len(donors)} asked: {'; '.join(failures[:2])})")


async def _fetch_result(transport: Transport, protocol: str, donor: str, epoch: int, numel: int,
                        digest: str | None, decoder: ResultFrames | None) -> torch.Tensor:
    element = torch.empty(0, dtype=RESULT_DTYPE).element_size()
    channel = await transport.open(donor, protocol)
    clean, result = False, None
    try:
        await channel.send({"t": "result", "epoch": epoch, **({"frames": True} if decoder is not None else {})})
        header, length = await channel.recv_header(max_payload=numel * element)
        if header.get("t") != "result" or header.get("epoch") != epoch or header.get("numel") != numel:
            raise FrameError(f"expected the result of round {epoch} ({numel} values), got {header.get('t')!r} "
                             f"of round {header.get('epoch')!r} ({header.get('numel')!r} values)")
        if "frames" in header:
            if decoder is None or length:
                raise FrameError("a result in frames that were not asked for, or with a payload")
            count = int_field(header, "frames", decoder.frames, decoder.frames)
            frames = []
            for index in range(count):
                frame_header, frame_length = await channel.recv_header(max_payload=decoder.max_payload)
                decoder.check_header(index, frame_header)
                payload = bytearray(frame_length)
                await channel.recv_payload_into(memoryview(payload))
                frames.append((frame_header, bytes(payload)))
            result = decoder.decode(frames)
            if result.numel() != numel:
                raise FrameError(f"the result's frames hold {result.numel()} values, expected {numel}")
            received = result.to(RESULT_DTYPE)  # what the donor keeps and names the digest of
        else:
            if length != numel * element:
                raise FrameError(f"the result is {length} bytes, expected {numel * element}")
            received = torch.empty(numel, dtype=RESULT_DTYPE)
            await channel.recv_payload_into(memoryview(received.view(torch.uint8).numpy()))
        await channel.send({"t": "done"})
        clean = True
    finally:
        await (channel.close() if clean else channel.abort())
    if digest is not None and result_digest(received) != digest:
        raise StateTransferError(f"the result of round {epoch} it served is not the one it and others described")
    if result is None:
        result = received.to(torch.float32)
    if not bool(torch.isfinite(result).all()):
        raise StateTransferError(f"the result of round {epoch} has NaN or Inf; not using it")
    return result


def expect_kind_header(header: dict, kind: str, version: int, index: int) -> None:
    if header.get("t") != kind or header.get("version") != version or header.get("index") != index:
        raise FrameError(f"expected {kind} {index} of version {version}, got {header.get('t')!r} "
                         f"{header.get('index')!r} of version {header.get('version')!r}")
