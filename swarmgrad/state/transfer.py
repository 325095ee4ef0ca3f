"""A joiner's download of a peer's whole state (state/snapshot.py) from donors (state/server.py).

A joiner takes a state only when a majority of the donors it asked agree on it (issue 15, item 4),
since any donor may lie:
1. Version by majority: it asks every candidate donor for its snapshot's description and takes the
   highest version a strict majority of those that answered reached (``majority_version``), never
   simply the highest claimed: one donor claiming version 10^6 does not win alone. A donor further
   on describes that version again if it still holds it (it keeps two); one that does not drops out.
2. Agreement by sketches: honest donors never hold identical bytes (each peer's optimizer moments
   are its own, and moshpit groups leave parameters a little apart), so donors are compared up to a
   tolerance, by sketches: a few random ±1 projections per part of each tolerance class's values,
   drawn from a nonce the joiner picks (``sketch``, ``TOLERANCES``), over a sample of at most
   ``SKETCH_PARTS`` parts drawn from it (what a sample proves and what it does not: state/sketch.py).
   The coordinate-wise median of the donors' sketches is the reference; a donor agrees when each of
   its sampled parts lies within the class's tolerance of it (``agreeing``). Fewer agreeing donors
   than a strict majority of those that answered: StateTransferError ("the donors disagree on the
   state"); with a majority, the others are blamed ("digest disagreement"). Parts are fetched only
   from agreeing donors, spread over them (architecture.md, invariant 'joining is cheap'): each
   serves a share, with ``PIPELINE_PARTS`` requests in flight so its link stays busy across a round
   trip, and one that fails mid-way has its parts, those it was asked for and had not delivered
   included, fetched from the others.
3. Verification with a second nonce, drawn once the bytes are in (so no donor could shape what it
   served to the projections it would be checked with, nor know which parts would be read): the
   agreeing donors sketch a new sample again, and each sampled part of the assembled state must lie
   within tolerance of their median. A part that does not is blamed ("bad state") on the donor that
   served it, which serves nothing more, and every part that donor served is fetched again from
   another agreeing donor, then the state is checked with a fresh nonce and sample (at most
   ``VERIFY_PASSES`` passes).
Nothing is used until a check's whole sample passed and every floating-point value is finite
(parts land in the tensors they belong to, the caller's own where it hands them over: state/landing.py;
a caller that does holds whatever landed when the download fails, and resets it). A joiner that
needs only some of the tensors (``keep``) fetches, compares and checks only the parts that hold
them. A donor that broke the protocol (a malformed description, part or sketch) is blamed "invalid
frame", one that served NaN or Inf "bad state", on the transport's admission (accountability.py):
enough of that bans it. A swarm of two (one donor) stays joinable: a single donor is its own
majority, and what it serves is checked for consistency with its own sketches only. A state larger
than this peer's ``max_bytes`` is this peer's limit, not a donor's fault: a strict majority offering
one is a StateTooLarge that blames nobody.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import Counter, deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, Sequence

import torch

from swarmgrad.eventloop import timeout
from swarmgrad.net.channel import Channel
from swarmgrad.net.transport import Transport
from swarmgrad.net.wire import FrameError, RemoteError, expect_kind, field
from swarmgrad.state import snapshot as state_snapshot
from swarmgrad.state.landing import StateLanding
from swarmgrad.state.served import ServedState
from swarmgrad.state.sketch import (
    CLASSES,
    SKETCH_PROJECTIONS,
    VERIFY_PASSES,
    agreeing,
    compared_values,
    majority_version,
    parts_within,
    reference_sketch,
    sample_parts,
    sketch,
)
from swarmgrad.state.snapshot import (
    MAX_DESCRIPTION_BYTES,
    MAX_STATE_BYTES,
    StateTooLarge,
    StateTransferError,
    layout,
    names_in,
    parse_description,
    part_count,
    parts_holding,
)
from swarmgrad.timing import DEFAULT_TIMING

logger = logging.getLogger(__name__)

# part requests a joiner keeps in flight per donor. One at a time, a donor served a part per round
# trip: 1 MiB / 50 ms = 21 MB/s whatever its link. With n in flight it keeps sending while requests
# travel, up to n parts per round trip: 8 MiB / 50 ms = 168 MB/s (1.3 Gbit/s; 670 Mbit/s at 100 ms).
# It costs the joiner no memory (parts land where they belong: state/landing.py); a donor that fails hands its n
# parts on, and the last donor to finish may hold n parts while the others idle.
PIPELINE_PARTS = 8


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
                         keep: Callable[[str], bool] | None = None,
                         into: Mapping[str, torch.Tensor] | None = None) -> ServedState:
    """The state a strict majority of ``donors`` agree on, fetched in parts spread over those donors
    and verified once it is in (the rules: the module docstring).

    ``keep``: which tensors (by name) to fetch; the state holds only those, and only the parts
    that hold them travel and are compared. ``into``: tensors of the caller's to write the parts of
    the same name in place (state/landing.py), where dtype and shape fit; they hold whatever landed
    when this raises, so only a caller with nothing to lose in them hands them over. Raises StateTransferError, using nothing, when no donor
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
    too_large: list[StateTooLarge] = []
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
                elif isinstance(outcome, StateTooLarge):  # this peer's limit: no donor's fault
                    too_large.append(outcome)
                else:
                    logger.info("donor %s cannot share its state: %s", donor, outcome)
                    if isinstance(outcome, FrameError):
                        blame(donor, "invalid frame", str(outcome))
            if len(too_large) * 2 > len(too_large) + len(offers):
                raise StateTooLarge(min(error.nbytes for error in too_large), max_bytes)
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

            async def sketch_of(offer: _Offer, seed: int, parts: list[int]) -> torch.Tensor:
                return await _verification_sketch(transport, protocol, offer, seed, parts, part_seconds)

            return await _fetch(sources, part_seconds=part_seconds, keep=keep, blame=blame, sketch_of=sketch_of,
                                moving=moving, into=into)
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
    nbytes = field(reply.header, "nbytes", int)
    if nbytes < 0:
        raise FrameError(f"a state of {nbytes} bytes")
    if nbytes > max_bytes:
        raise StateTooLarge(nbytes, max_bytes)
    specs, meta = parse_description(bytes(reply.payload), nbytes)
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


async def _ask_sketch(channel: Channel, version: int, seed: int, nbytes: int, parts: list[int]) -> torch.Tensor:
    """The donor's sketch of ``parts`` of ``version`` for ``seed``: [len(parts), classes, k] float32,
    of the right size (an older donor sketches every part: its rows for ``parts`` are taken)."""
    total, row = part_count(nbytes), len(CLASSES) * SKETCH_PROJECTIONS * 4
    await channel.send({"t": "sketch", "version": version, "seed": seed, "parts": parts})
    reply = expect_kind(await channel.recv(max_payload=max(len(parts), total) * row), "sketch")
    said = tuple(reply.header.get(key) for key in ("version", "seed", "parts", "classes", "k"))
    rows = total if said[2] == total else len(parts)
    shape = (rows, len(CLASSES), SKETCH_PROJECTIONS)
    if said != (version, seed, *shape) or len(reply.payload) != rows * row:
        raise FrameError(f"expected a sketch of version {version} (seed {seed}) of shape {shape} in {rows * row} "
                         f"bytes, got {said} in {len(reply.payload)} bytes")
    if not rows:
        return torch.zeros(shape)
    drawn = torch.frombuffer(bytearray(reply.payload), dtype=torch.float32).reshape(shape)
    return drawn if rows == len(parts) else drawn[parts]


async def _sketch_on(offer: _Offer, seed: int, parts: list[int], seconds: float) -> torch.Tensor:
    try:
        async with timeout(seconds):
            return await _ask_sketch(offer.channel, offer.version, seed, offer.nbytes, parts)
    except BaseException:
        offer.broken = True  # a half-read reply may be left on it
        await offer.channel.abort()
        raise


async def _verification_sketch(transport: Transport, protocol: str, offer: _Offer, seed: int, parts: list[int],
                               seconds: float) -> torch.Tensor:
    """``offer``'s donor's sketch for ``seed``, on its channel, or on a new one where that failed
    (a donor whose part timed out may still answer a sketch) or was closed after its last part
    (the other donors fetched the rest before this one's next request could find it closed)."""
    if not offer.broken:
        try:
            return await _sketch_on(offer, seed, parts, seconds)
        except (EOFError, ConnectionError, OSError) as error:
            logger.info("donor %s closed its stream (%s); asking for the sketch on a new one", offer.donor, error)
    async with timeout(seconds):
        channel = await transport.open(offer.donor, protocol)
        clean = False
        try:
            drawn = await _ask_sketch(channel, offer.version, seed, offer.nbytes, parts)
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
    seed = random.getrandbits(63)
    sample = sample_parts(same[0].specs, parts_holding(same[0].specs, keep), seed)
    drawn = await asyncio.gather(*(_sketch_on(offer, seed, sample, seconds) for offer in same),
                                 return_exceptions=True)
    sketches: dict[str, torch.Tensor] = {}
    not_finite = []
    for offer, outcome in zip(same, drawn):
        if not isinstance(outcome, torch.Tensor):
            logger.info("donor %s did not sketch version %d: %s", offer.donor, version, outcome)
            if isinstance(outcome, FrameError):
                blame(offer.donor, "invalid frame", str(outcome))
            continue
        answered.append(offer)
        if bool(torch.isfinite(outcome).all()):
            sketches[offer.donor] = outcome
        else:
            names = names_in(offer.specs, [sample[row] for row in
                                            (~torch.isfinite(outcome)).flatten(1).any(1).nonzero().flatten().tolist()])
            not_finite.append(f"{offer.donor} holds NaN or Inf in {', '.join(map(repr, names[:3]))}")
            blame(offer.donor, "bad state", f"NaN or Inf in {', '.join(names[:3])}")
    agree = set(agreeing(sketches, compared_values(same[0].specs, sample)))
    sources = [offer for offer in same if offer.donor in agree]
    if len(sources) * 2 <= len(answered):
        raise StateTransferError(f"the donors disagree on the state at version {version}: {len(sources)} of "
                                 f"{len(answered)} agree" + "".join(f"; {line}" for line in not_finite[:2]))
    for offer in answered:
        if offer.digest != digest or (offer.donor in sketches and offer.donor not in agree):
            logger.info("donor %s disagrees with the majority on the state at version %d", offer.donor, version)
            blame(offer.donor, "digest disagreement", f"version {version}")
    return sources


def _blame(transport: Transport, donor: str, kind: str, detail: str) -> None:
    if transport.admission is not None:
        transport.admission.blame(donor, kind, detail)


async def _fetch(sources: list[_Offer], part_seconds: float, keep: Callable[[str], bool] | None,
                 blame: Blame = lambda donor, kind, detail: None,
                 sketch_of: Callable[[_Offer, int, list[int]], Awaitable[torch.Tensor]] | None = None,
                 moving: Callable[[], None] = lambda: None,
                 into: Mapping[str, torch.Tensor] | None = None) -> ServedState:
    """Every needed part from some donor; a donor that errs or stalls for ``part_seconds`` hands its part on.
    ``sketch_of(donor, seed, parts)``: a donor's sketch, to verify what arrived with (``_verify``).
    ``blame(donor, kind, detail)``: told of a donor that sent an invalid part, a part that failed
    verification, or parts holding NaN or Inf. ``moving()``: called as each part lands."""
    first = sources[0]
    landing = StateLanding(first.specs, keep, into)
    parts = parts_holding(first.specs, keep)
    random.shuffle(sources)  # joiners arriving together start on different donors
    done: dict[int, str] = {}  # part -> the donor it came from
    healthy = list(sources)
    await _fetch_parts(healthy, parts, landing, done, part_seconds, blame, moving)
    if sketch_of is not None:
        await _verify(sources, healthy, parts, landing, done, part_seconds, blame, sketch_of)
    _check_finite(landing, done, blame)
    return landing.landed(first.version, first.meta)


async def _fetch_parts(healthy: list[_Offer], parts: Sequence[int], landing: StateLanding, done: dict[int, str],
                       part_seconds: float, blame: Blame, moving: Callable[[], None] = lambda: None) -> None:
    """Fetch ``parts`` into ``landing`` from the donors of ``healthy`` (a donor that fails leaves it),
    noting in ``done`` where each came from. StateTransferError when they all failed."""
    size = state_snapshot.PART_BYTES
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in parts:
        queue.put_nowait(index)

    async def worker(offer: _Offer) -> None:
        asked: deque[int] = deque()  # requested of this donor and not landed yet: it answers in order
        try:
            while True:
                async with timeout(part_seconds):
                    while len(asked) < PIPELINE_PARTS and not queue.empty():
                        index = queue.get_nowait()
                        asked.append(index)
                        await offer.channel.send({"t": "part", "version": offer.version, "index": index})
                        await asyncio.sleep(0)  # the donors take parts in turn: a small state is spread too
                    if not asked:
                        return
                    index = asked[0]
                    header, length = await offer.channel.recv_header(max_payload=size)
                    expect_kind_header(header, "part", offer.version, index)
                    expected = min(size, offer.nbytes - index * size)
                    if length != expected:
                        raise FrameError(f"part {index} is {length} bytes, expected {expected}")
                    direct = landing.direct(index)
                    if direct is not None:  # most parts: straight into the tensor that holds them
                        await offer.channel.recv_payload_into(direct)
                    else:
                        payload = torch.empty(length, dtype=torch.uint8)
                        await offer.channel.recv_payload_into(memoryview(payload.numpy()))
                        landing.write(index, payload)
                asked.popleft()
                done[index] = offer.donor
                moving()
        except (FrameError, RemoteError, EOFError, OSError, ConnectionError, asyncio.TimeoutError,
                TimeoutError) as error:
            logger.info("donor %s failed on part %s (%d asked of it): %s; the others take over", offer.donor,
                        asked[0] if asked else "-", len(asked), error)
            if isinstance(error, FrameError):
                blame(offer.donor, "invalid frame", str(error))
            for index in asked:  # other donors fetch them
                queue.put_nowait(index)
            healthy.remove(offer)
            offer.broken = True
            await offer.channel.abort()  # nothing more may land in the buffer from this donor

    while not queue.empty() and healthy:  # a donor that failed late leaves parts for another pass
        await asyncio.gather(*(worker(offer) for offer in list(healthy)))
    missing = sum(index not in done for index in parts)
    if missing:
        raise StateTransferError(f"every donor failed: {missing} of {len(parts)} parts missing")


async def _verify(sources: list[_Offer], healthy: list[_Offer], parts: list[int], landing: StateLanding,
                  done: dict[int, str], part_seconds: float, blame: Blame,
                  sketch_of: Callable[[_Offer, int, list[int]], Awaitable[torch.Tensor]]) -> None:
    """Check a sample of the fetched parts (``sample_parts``) against the median of the agreeing
    donors' sketches for a nonce drawn now, once the bytes are in. A part off by more than the
    tolerance is blamed on the donor that served it, which is trusted no more, and every part it
    served (the sample only found some) is fetched again from the others, then the state is checked
    with a fresh nonce and sample; at most ``VERIFY_PASSES`` passes. A strict majority of the donors
    still trusted must answer each pass (a lone liar cannot vouch for itself). StateTransferError
    when a pass cannot be made or sampled parts still fail after the last."""
    first = sources[0]
    trusted = list(sources)
    for attempt in range(VERIFY_PASSES):
        seed = random.getrandbits(63)
        sample = sample_parts(first.specs, parts, seed)
        drawn = await asyncio.gather(*(sketch_of(offer, seed, sample) for offer in trusted),
                                     return_exceptions=True)
        sketches = []
        for offer, outcome in zip(trusted, drawn):
            if isinstance(outcome, torch.Tensor) and bool(torch.isfinite(outcome).all()):
                sketches.append(outcome)
            else:
                logger.info("donor %s did not sketch the state to verify it: %s", offer.donor, outcome)
                if isinstance(outcome, FrameError):
                    blame(offer.donor, "invalid frame", str(outcome))
        if len(sketches) * 2 <= len(trusted):
            raise StateTransferError(f"too few donors sketched the state to verify it: {len(sketches)} of {len(trusted)}")
        reference = reference_sketch(torch.stack(sketches))
        local = await asyncio.to_thread(sketch, landing.read_part, first.specs, seed, sample)
        fine = parts_within(local, reference, compared_values(first.specs, sample)).tolist()
        failed = [index for index, good in zip(sample, fine) if not good]
        if not failed:
            return
        culprits = Counter(done[index] for index in failed)
        for donor, count in culprits.items():
            logger.info("donor %s served %d sampled part(s) that do not match the donors' sketches; fetching "
                        "all it served again", donor, count)
            blame(donor, "bad state", f"{count} part(s) of version {first.version} off the donors' sketches")
        trusted = [offer for offer in trusted if offer.donor not in culprits]
        healthy[:] = [offer for offer in healthy if offer.donor not in culprits]
        if attempt + 1 == VERIFY_PASSES or not healthy:
            break
        suspect = [index for index in parts if done[index] in culprits]
        for index in suspect:
            done.pop(index)
        await _fetch_parts(healthy, suspect, landing, done, part_seconds, blame)
    raise StateTransferError(f"{len(failed)} sampled part(s) of the state failed verification; not using it")


def _check_finite(landing: StateLanding, sources: dict[int, str], blame: Callable[[str, str, str], None]) -> None:
    """StateTransferError when a taken floating-point tensor holds NaN or Inf; the donors of the parts
    that hold it are blamed first."""
    offsets, _ = layout(landing.specs)
    for (name, _, _), (start, length) in zip(landing.specs, offsets):
        tensor = landing.tensors.get(name)
        if tensor is None or not tensor.is_floating_point() or not tensor.numel():
            continue
        low, high = torch.aminmax(tensor.reshape(-1))  # NaN or Inf shows in one of them; no temporary
        if not (math.isfinite(float(low)) and math.isfinite(float(high))):
            size = state_snapshot.PART_BYTES
            parts = range(start // size, (start + length - 1) // size + 1)
            for donor in sorted({sources[index] for index in parts if index in sources}):
                blame(donor, "bad state", f"NaN or Inf in {name!r}")
            raise StateTransferError(f"donor state has NaN or Inf in {name!r}; not using it")


def expect_kind_header(header: dict, kind: str, version: int, index: int) -> None:
    if header.get("t") != kind or header.get("version") != version or header.get("index") != index:
        raise FrameError(f"expected {kind} {index} of version {version}, got {header.get('t')!r} "
                         f"{header.get('index')!r} of version {header.get('version')!r}")
