"""Butterfly all-reduce among one agreed group, streamed chunk by chunk.

Every member owns one *part* of the flat vector (a run of chunks sized by its bandwidth share).
Each member streams its contribution to every part's owner (reduce-scatter); an owner adds the
weighted contributions chunk by chunk as they arrive and, as soon as a chunk has everyone's
contribution, streams the average back on the same channel (all-gather). Both phases overlap.

That is the rule that streams (``mean``). With one that needs all rows (the plan's ``aggregator``
names the rule, averaging/rules/) the owner instead keeps each chunk's decoded contributions, one row
per member, until every member's is in, and sends back what the rule makes of them. Claimed weights
are bounded (rules/base.py ``bound_weights``): to ``weight_cap`` always, and to twice the group's
median claim under a rule that needs all rows. A clipped contribution, or a claim above the
cap (without one: ``SUSPECT_FACTOR`` x its bound), is logged once per peer and round and listed in
the report's ``suspicions``; a claim over twice the median but under the cap is only cut (honest
peers differ that much in speed, and blaming it banned a fast honest peer in 5 rounds).

A member's tensors are written only once every part has arrived and been checked, so a round
that fails (deadline, crash, bad frame) changes nothing (architecture.md, invariant 'a failed round changes nothing').
Peers that missed the group's deadline were already left out when the group was agreed (architecture.md, invariant
'stragglers are dropped'); a failure *inside* the agreed group aborts the round for everyone, because a missing owner's
part cannot be recovered.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Literal, Sequence

import torch

from swarmgrad.averaging.codecs import Codec, ErrorFeedback
from swarmgrad.averaging.codecs.base import all_finite
from swarmgrad.averaging.frames import (
    byte_view,
    check_chunk,
    check_raw_header,
    decode_chunk,
    encode_chunk,
    encoded_to_frame,
)
from swarmgrad.averaging.group_plan import GroupPlan
from swarmgrad.averaging.layout import Chunk, Schema, assign_parts
from swarmgrad.averaging.rules import get_rule
from swarmgrad.averaging.rules.base import Aggregate, bound_weights
from swarmgrad.eventloop import timeout
from swarmgrad.net.channel import Channel
from swarmgrad.net.transport import Transport
from swarmgrad.net.wire import Frame, FrameError, int_field
from swarmgrad.net.wire import field as frame_field

logger = logging.getLogger(__name__)

MAX_WEIGHT = 1e15
SUSPECT_FACTOR = 4.0  # without a run cap, a claim this far past its bound is held against its peer
# chunks of its part an owner reduces at once: its sums or rows take OPEN_CHUNKS x members x a chunk
# (1 MiB of fp32 each), not its whole part (a model-sized buffer per round under a rule with rows);
# a contributor further ahead waits, its chunks left in its socket, until the others catch up
OPEN_CHUNKS = 8


def gather_codec_for(codec: Codec) -> Codec:
    """Codec for the averages an owner sends back, named by the codec (`Codec.average_codec`): the
    codec itself for element-wise ones, fp16 for topk and powersgd, `nonzero` (the union of the
    supports, low-bit values) for sparse. No peer's error feedback owns what re-encoding loses."""
    return codec.average_codec()


class AllReduceFailed(RuntimeError):
    """The round did not complete; local tensors are untouched."""


@dataclass
class AllReduceReport:
    ok: bool
    round_id: str
    group: list[str]
    contributors: list[str]
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    transports: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False  # the round's deadline passed (the timer then grows the next one)
    # what this peer, as an owner, saw others do wrong this round: peer id -> reasons ("weight cut",
    # "clipped"), each once; for a later accountability feature to count
    suspicions: dict[str, list[str]] = field(default_factory=dict)
    # the peers whose contributions to this peer's part it aggregated (whom the suspicions could name;
    # empty when it owns no part): a clean round for those not suspected (accountability.py)
    observed: list[str] = field(default_factory=list)
    # the share of this peer's contribution (in elements) that owners' rules left out: the average
    # holds the rest of it (its owners say so in each chunk's average, ``"out"``)
    rejected_share: float = 0.0


class GroupAllReduce:
    """One all-reduce round of one member. ``run`` drives it; ``accept`` serves incoming streams."""

    def __init__(
        self,
        plan: GroupPlan,
        me: str,
        schema: Schema,
        contribution: torch.Tensor | Callable[[int, int], torch.Tensor],
        weight: float,
        codec: Codec,
        transport: Transport,
        protocol: str,
        feedback: ErrorFeedback | None = None,
        contribution_checked: bool = False,
        result: torch.Tensor | Literal["frames"] | None = None,
        weight_cap: float | None = None,
    ):
        if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
            raise ValueError(f"weight must be finite and in (0, {MAX_WEIGHT:g}], got {weight}")
        if weight_cap is not None and not (math.isfinite(weight_cap) and weight_cap > 0):
            raise ValueError(f"weight_cap must be finite and positive, got {weight_cap}")
        self.plan, self.me, self.schema = plan, me, schema
        # the rule the plan names: matchmaking admits only plans that name this peer's own
        self.rule, self.weight_cap = get_rule(plan.aggregator), weight_cap
        self.streams = self.rule.streams
        # the contribution: a flat tensor, or read(start, length), its chunks computed where they live
        # (each read once per round; the result is then its frames alone)
        self.read = contribution if callable(contribution) else None
        self.contribution = None if callable(contribution) else contribution
        self.weight, self.codec = weight, codec
        frames_only = isinstance(result, str) and result == "frames"
        if self.read is not None and not frames_only:
            raise ValueError("a contribution read a chunk at a time needs its result in frames only")
        self.gather_codec = gather_codec_for(codec)
        self.transport, self.protocol, self.feedback = transport, protocol, feedback
        self.contribution_checked = contribution_checked  # the caller verified it holds no NaN/Inf
        self.index = plan.members.index(me)
        self.parts = assign_parts(schema.chunks, plan.shares)
        self.my_chunks = [schema.chunks[c] for c in self.parts[self.index]]
        self.others = [peer for peer in plan.members if peer != me]
        # result="frames" (a lossy return codec): the result is ``result_frames`` alone, never a float32
        # buffer of the model's size (result_frames.py ``FramedAverage`` reads it); else a caller that
        # averages repeatedly passes the same buffer: fresh 100 MB means page faults
        if frames_only and not self.gather_codec.lossy:
            raise ValueError(f"a result in frames only needs a lossy return codec, not {self.gather_codec.name}")
        self.result: torch.Tensor | None = None if frames_only else (
            result if isinstance(result, torch.Tensor) else torch.empty(schema.total, dtype=torch.float32))
        self.max_payload = max(
            (max(codec.encoded_nbytes(c.view), self.gather_codec.encoded_nbytes(c.view)) for c in schema.chunks),
            default=0,
        )
        self._loop = asyncio.get_running_loop()
        self._failure: asyncio.Future[None] = self._loop.create_future()
        self._tasks: set[asyncio.Task] = set()
        self._channels: list[Channel] = []
        self._contributors: dict[str, float] = {}  # claimed weights of the peers that contribute to my part
        self.suspicions: dict[str, list[str]] = {}
        self.rejected_elements = 0  # of this peer's contribution, what the owners' rules left out
        # owner state for my part, for the chunks open now (at most OPEN_CHUNKS): weighted sums (a
        # streaming rule) or one row per member; contributions seen, averages ready to send
        self._sums: dict[int, torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor] = {}
        self._open: set[int] = set()
        self._open_changed = asyncio.Condition()
        self._weights: torch.Tensor | None = None  # rows kept: bounded weights in member order, once all claimed
        self._seen: dict[int, int] = {}
        self._averages: list[tuple[dict, bytes]] = []
        self._averages_changed = asyncio.Condition()
        # the result as it travelled (a lossy return codec): chunk index -> its frame; every member
        # holds the same, so a peer that missed the round can replay it from these few bytes
        self.result_frames: dict[int, tuple[dict, bytes]] = {}
        self._served = 0
        self._all_served: asyncio.Future[None] = self._loop.create_future()
        self._start_my_part()  # before any contributor's stream can arrive

    # ---- driving the round ------------------------------------------------------------------

    def planned_bytes(self) -> int:
        """Payload bytes this member moves in the round, in the busier direction (the two overlap, and
        each has its own cap): it sends its contribution to every other owner's part and, as an
        owner, the averages of its part to every other member; it receives the reverse."""
        def size(codec: Codec, chunks: list[Chunk]) -> int:
            return sum(codec.encoded_nbytes(chunk.view) for chunk in chunks)

        elsewhere = [self.schema.chunks[c] for i, part in enumerate(self.parts) if i != self.index for c in part]
        others = len(self.others)
        sent = size(self.codec, elsewhere) + others * size(self.gather_codec, self.my_chunks)
        received = size(self.gather_codec, elsewhere) + others * size(self.codec, self.my_chunks)
        return max(sent, received)

    async def run(self, seconds: float) -> AllReduceReport:
        """Exchange everything within ``seconds``; on success ``self.result`` holds the average. The
        result may be the contribution itself: a chunk's average lands only once this member's share
        of it was encoded (its owner averages it after receiving it; an owner opens its own chunk
        before finishing it), so nothing is read after it is overwritten. A failed round then leaves
        the contribution partly overwritten: the caller fills it again before a retry."""
        started, timed_out = time.monotonic(), False
        try:
            async with timeout(seconds):
                owners = [p for i, p in enumerate(self.plan.members) if p != self.me and len(self.parts[i])]
                exchanges = [self._spawn(self._exchange_with_owner(owner)) for owner in owners]
                finished = asyncio.gather(*exchanges, self._all_served)
                finished.add_done_callback(_retrieved)  # a failed round cancels it: nobody awaits it then
                await asyncio.wait([finished, self._failure], return_when=asyncio.FIRST_COMPLETED)
                if self._failure.done():
                    self._failure.result()  # raises the first failure
                await finished
        except (asyncio.TimeoutError, TimeoutError):
            timed_out = True
            self._fail(AllReduceFailed(f"deadline of {seconds:.1f} s passed"))
        except AllReduceFailed as error:
            self._fail(error)
        except Exception as error:
            self._fail(AllReduceFailed(f"{type(error).__name__}: {error}"))
        finally:
            await self._cleanup()
        report = AllReduceReport(
            ok=not self._failure.done() or self._failure.exception() is None,
            round_id=self.plan.round_id,
            group=list(self.plan.members),
            contributors=list(self.plan.members),  # on success every member reached every part
            bytes_sent=sum(channel.bytes_sent for channel in self._channels),
            bytes_received=sum(channel.bytes_received for channel in self._channels),
            seconds=time.monotonic() - started,
            transports={channel.peer_id: channel.transport_name for channel in self._channels},
            suspicions={peer: list(reasons) for peer, reasons in self.suspicions.items()},
            observed=[peer for peer in self._contributors if peer != self.me],
            rejected_share=self.rejected_elements / max(1, self.schema.total),
        )
        if not report.ok:
            report.error, report.timed_out = str(self._failure.exception()), timed_out
            report.contributors, report.observed = [], []
        return report

    def _spawn(self, coroutine: Awaitable[None], channel: Channel | None = None) -> asyncio.Task:
        task = asyncio.ensure_future(self._guarded(coroutine, channel))
        self._tasks.add(task)
        return task

    async def _guarded(self, coroutine: Awaitable[None], channel: Channel | None) -> None:
        """Run one side of an exchange; any failure fails the round, and a peer that sent us
        something invalid is told why before the channel closes."""
        try:
            await coroutine
        except asyncio.CancelledError:
            raise
        except FrameError as error:
            who = f" from {channel.peer_id}" if channel is not None else ""
            logger.info("round %s: invalid frame%s: %s", self.plan.round_id, who, error)
            if channel is not None:
                await channel.send_error(str(error))
            self._fail(AllReduceFailed(f"invalid frame{who}: {error}"))
        except Exception as error:
            self._fail(AllReduceFailed(f"{type(error).__name__}: {error}"))

    def _fail(self, error: BaseException) -> None:
        if not self._failure.done():
            self._failure.set_exception(error)
            self._failure.exception()  # mark retrieved: the report carries it
            for task in self._tasks:
                task.cancel()

    async def _cleanup(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        failed = self._failure.done()  # abort so the others notice now; else end cleanly (keeps pooled links)
        await asyncio.gather(*(channel.abort() if failed else channel.close() for channel in self._channels),
                             return_exceptions=True)

    # ---- encoding helpers ---------------------------------------------------------------------

    def _own(self, chunk: Chunk) -> torch.Tensor:
        """This member's contribution to ``chunk``, flat."""
        if self.read is not None:
            return self.read(chunk.start, chunk.length)
        assert self.contribution is not None
        return self.contribution[chunk.start : chunk.start + chunk.length]

    def _encode_contribution(self, chunk: Chunk) -> tuple[dict, bytes | memoryview]:
        values = self._own(chunk).view(chunk.view)
        if self.feedback is not None:
            # a contribution read where it lives is read again when the round commits (feedback.py):
            # no residual is staged beside the committed one meanwhile
            source = (lambda: self._own(chunk).view(chunk.view)) if self.read is not None else None
            return encoded_to_frame(self.feedback.encode(f"c{chunk.index}", values, source))
        return encode_chunk(self.codec, values, known_finite=self.contribution_checked)

    def _decode_chunk(self, header: dict, payload: bytes | memoryview, chunk: Chunk, codec: Codec) -> torch.Tensor:
        try:
            return decode_chunk(codec, header, payload, chunk.view)
        except FrameError as error:
            raise FrameError(f"chunk {chunk.index}: {error}") from None

    def _check_chunk(self, header: dict, payload: bytes | memoryview, chunk: Chunk, codec: Codec) -> None:
        try:
            check_chunk(codec, header, payload, chunk.view)
        except FrameError as error:
            raise FrameError(f"chunk {chunk.index}: {error}") from None

    def _chunk_of(self, header: dict, allowed: dict[int, Chunk], done: set[int]) -> Chunk:
        index = int_field(header, "c", 0, len(self.schema.chunks) - 1)
        if index not in allowed or index in done:
            raise FrameError(f"chunk {index} is not expected here (not in this part, or sent twice)")
        return allowed[index]

    # ---- contributor side: send my share of part j to its owner, receive its average ----------

    async def _exchange_with_owner(self, owner: str) -> None:
        owner_chunks = {c: self.schema.chunks[c] for c in self.parts[self.plan.members.index(owner)]}
        channel = await self.transport.open(owner, self.protocol)
        self._channels.append(channel)
        await channel.send({"t": "part", "round": self.plan.round_id, "weight": self.weight})

        async def send_all() -> None:
            for chunk in owner_chunks.values():
                header, payload = self._encode_contribution(chunk)
                await channel.send({"t": "chunk", "c": chunk.index, **header}, payload)

        async def receive_all() -> None:
            done: set[int] = set()
            while len(done) < len(owner_chunks):
                header, length = await channel.recv_header(self.max_payload)
                chunk = self._chunk_of(_expect(header, "avg"), owner_chunks, done)
                if self.index in _left_out(header, len(self.plan.members)):
                    self.rejected_elements += chunk.length
                if self.gather_codec.name == "none":  # straight from the socket into the result
                    assert self.result is not None
                    target = self.result[chunk.start : chunk.start + chunk.length]
                    check_raw_header(header, length, chunk.view)
                    await channel.recv_payload_into(byte_view(target))
                    if not all_finite(target):
                        raise FrameError(f"chunk {chunk.index} holds NaN or Inf")
                else:
                    payload = memoryview(bytearray(length))
                    await channel.recv_payload_into(payload)
                    if self.result is not None:
                        self.result[chunk.start : chunk.start + chunk.length] = self._decode_chunk(
                            header, payload, chunk, self.gather_codec)
                    else:  # kept as the frames, decoded where they are applied: checked, not decoded, here
                        self._check_chunk(header, payload, chunk, self.gather_codec)
                    self.result_frames[chunk.index] = (header, payload.tobytes())
                done.add(chunk.index)

        try:
            await asyncio.gather(send_all(), receive_all())
        except FrameError as error:
            await channel.send_error(str(error))
            raise

    # ---- owner side: reduce contributions to my part, stream averages back --------------------

    def _start_my_part(self) -> None:
        for chunk in self.my_chunks:
            self._seen[chunk.index] = 0
        if not self.my_chunks or not self.others:
            for chunk in self.my_chunks:
                self._open_chunk(chunk)
                self._finish_chunk(chunk)
            self._all_served.set_result(None)

    def _open_chunk(self, chunk: Chunk) -> None:
        """Start reducing one chunk of my part: my own share in its sum or its row."""
        if self.feedback is not None:  # my share goes through the codec like everyone's
            header, payload = self._encode_contribution(chunk)
            own = self._decode_chunk(header, payload, chunk, self.codec)
        else:
            own = self._own(chunk)
        if self.streams:
            self._sums[chunk.index] = own * self._capped(self.me, self.weight)
        else:
            self._rows[chunk.index] = torch.empty((len(self.plan.members), chunk.length), dtype=torch.float32)
            self._rows[chunk.index][self.index] = own
        self._open.add(chunk.index)

    async def _opened(self, chunk: Chunk) -> None:
        """``chunk`` is open, once fewer than OPEN_CHUNKS are (a contributor's next chunk after the
        others' is open already: those behind never wait, so this always ends)."""
        if chunk.index in self._open:
            return
        async with self._open_changed:
            await self._open_changed.wait_for(lambda: chunk.index in self._open or len(self._open) < OPEN_CHUNKS)
            if chunk.index not in self._open:
                self._open_chunk(chunk)

    async def _close_chunk(self, chunk: Chunk) -> None:
        self._open.discard(chunk.index)
        async with self._open_changed:
            self._open_changed.notify_all()

    async def accept(self, channel: Channel, first: Frame) -> None:
        """Serve one contributor's stream (called by the averager's stream handler)."""
        if channel.peer_id not in self.others or channel.peer_id in self._contributors:
            raise FrameError(f"{channel.peer_id} is not an expected contributor of round {self.plan.round_id}")
        if not self.my_chunks:
            raise FrameError(f"this peer owns no part in round {self.plan.round_id}")
        weight = frame_field(first.header, "weight", float)
        if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
            raise FrameError(f"weight {weight} is not finite and positive")
        self._contributors[channel.peer_id] = weight
        self._channels.append(channel)
        used = self._capped(channel.peer_id, weight) if self.streams else weight  # rows: bounded once all are in
        handed: asyncio.Future[None] = self._loop.create_future()  # its last average is being sent
        tasks = [self._spawn(self._reduce_from(channel, used, handed), channel),
                 self._spawn(self._send_averages(channel, handed))]
        await asyncio.wait(tasks)  # the round cancels them on failure; the handler then closes the stream

    async def _reduce_from(self, channel: Channel, weight: float, handed: asyncio.Future[None]) -> None:
        mine = {chunk.index: chunk for chunk in self.my_chunks}
        done: set[int] = set()
        scratch = memoryview(bytearray(self.max_payload))  # one receive buffer per contributor, reused
        row = self.plan.members.index(channel.peer_id)
        while len(done) < len(mine):
            header, length = await channel.recv_header(self.max_payload)
            chunk = self._chunk_of(_expect(header, "chunk"), mine, done)
            await self._opened(chunk)
            await channel.recv_payload_into(scratch[:length])
            values = self._decode_chunk(header, scratch[:length], chunk, self.codec)
            if self.streams:
                self._sums[chunk.index].add_(values, alpha=weight)
            else:
                self._rows[chunk.index][row] = values
            done.add(chunk.index)
            self._seen[chunk.index] += 1
            if self._seen[chunk.index] == len(self.others):
                if self.streams:
                    self._finish_chunk(chunk)
                else:  # CPU work (several passes over the rows): off the event loop
                    weights = self._bounded_weights()
                    rows = self._rows.pop(chunk.index)
                    outcome = await asyncio.to_thread(self.rule.aggregate, rows, weights)
                    self._finish_chunk(chunk, self._aggregated(outcome), outcome.rejected)
                await self._close_chunk(chunk)
                async with self._averages_changed:
                    self._averages_changed.notify_all()
        await self._until_averaged(channel, handed)

    async def _until_averaged(self, channel: Channel, handed: asyncio.Future[None]) -> None:
        """After its last chunk a contributor sends nothing until it has every average of this part.
        A frame or a closed channel before then means its round failed (a member it streams with
        died, a deadline): this one fails at once, and its own aborted channels tell the others, where
        it would wait out the round's deadline for a contribution that never comes (soak: a member
        killed mid-round held every other member 5 s)."""
        reading, error = asyncio.ensure_future(channel.recv_header(0)), None
        try:
            await asyncio.wait([reading, handed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not reading.done():
                reading.cancel()
            elif not reading.cancelled():
                # retrieved even when this wait is cancelled (the round failed meanwhile): asyncio would
                # log "Task exception was never retrieved" with a traceback for every closed channel
                error = reading.exception()
        if handed.done():
            return
        why = f"{type(error).__name__}: {error}" if error is not None else f"sent {reading.result()[0].get('t')!r}"
        raise AllReduceFailed(f"{channel.peer_id} left the round ({why})")

    def _finish_chunk(self, chunk: Chunk, average: torch.Tensor | None = None, rejected: Sequence[int] = ()) -> None:
        """The chunk's average to every contributor (``rejected``: the member rows the rule left out,
        named in the frame so each contributor knows how much of its contribution counted)."""
        if not self.streams and average is None:  # a group of one
            outcome = self.rule.aggregate(self._rows.pop(chunk.index), self._bounded_weights())
            average, rejected = self._aggregated(outcome), outcome.rejected
        elif average is None:
            total_weight = self._capped(self.me, self.weight) + sum(
                self._capped(peer, weight) for peer, weight in self._contributors.items())
            average = self._sums.pop(chunk.index).div_(total_weight)
        header, payload = encode_chunk(self.gather_codec, average.view(chunk.view))
        # every member, the owner included, keeps exactly what was sent: identical results everywhere
        if self.gather_codec.lossy:
            average = decode_chunk(self.gather_codec, header, payload, chunk.view)
        if self.result is not None:
            self.result[chunk.start : chunk.start + chunk.length] = average
        if self.index in rejected:
            self.rejected_elements += chunk.length
        frame = ({"t": "avg", "c": chunk.index, **header, **({"out": sorted(rejected)} if rejected else {})}, payload)
        self._averages.append(frame)
        if self.gather_codec.lossy:
            self.result_frames[chunk.index] = (frame[0], bytes(payload))

    def _aggregated(self, outcome: Aggregate) -> torch.Tensor:
        """A chunk's result under the rule; the members whose pull it clipped or rejected are suspected."""
        for reason, rows in (("rejected", outcome.rejected), ("clipped", outcome.clipped)):
            for row in rows:
                self._suspect(self.plan.members[row], reason, f" ({outcome.reach[row]:.1f} τ from the result)")
        return outcome.value

    def _bounded_weights(self) -> torch.Tensor:
        """Every member's claimed weight cut to min(cap, 2 x the group's median claim); computed once,
        when the first chunk has every member's row (so every claim is in)."""
        if self._weights is None:
            members = self.plan.members
            claims = torch.tensor([self.weight if peer == self.me else self._contributors[peer] for peer in members],
                                  dtype=torch.float64)
            self._weights = bound_weights(claims, self.weight_cap)
            for peer, claim, bounded in zip(members, claims.tolist(), self._weights.tolist()):
                if bounded >= claim:
                    continue
                # past the run's cap, a lie; past 2 x the median only, maybe a faster peer (4x is
                # common among volunteers): counted, but not against it unless far past
                limit = self.weight_cap if self.weight_cap is not None else SUSPECT_FACTOR * bounded
                if claim > limit:
                    self._note_cut(peer, claim, bounded)
                else:
                    logger.debug("round %s: %s claimed weight %g; %g counts", self.plan.round_id, peer, claim, bounded)
        return self._weights

    def _capped(self, peer: str, weight: float) -> float:
        """A streaming rule's bound: the run's cap only (it needs no other claim, so streaming stays)."""
        if self.weight_cap is None or weight <= self.weight_cap:
            return weight
        if peer not in self.suspicions or "weight cut" not in self.suspicions[peer]:
            self._note_cut(peer, weight, self.weight_cap)
        return self.weight_cap

    def _note_cut(self, peer: str, claim: float, bounded: float) -> None:
        if peer == self.me:  # our own weight follows the same rule, so every part uses the same weights
            return
        logger.info("round %s: %s claimed weight %g; cut to %g", self.plan.round_id, peer, claim, bounded)
        self._suspect(peer, "weight cut")

    def _suspect(self, peer: str, reason: str, detail: str = "") -> None:
        if peer == self.me:
            return
        reasons = self.suspicions.setdefault(peer, [])
        if reason not in reasons:
            if reason != "weight cut":
                logger.info("round %s: %s's contribution was %s%s", self.plan.round_id, peer, reason, detail)
            reasons.append(reason)

    async def _send_averages(self, channel: Channel, handed: asyncio.Future[None]) -> None:
        sent = 0
        while sent < len(self.my_chunks):
            async with self._averages_changed:
                await self._averages_changed.wait_for(lambda: len(self._averages) > sent)
            for header, payload in self._averages[sent:]:
                if sent + 1 == len(self.my_chunks) and not handed.done():
                    handed.set_result(None)  # the contributor may close as soon as this one arrives
                await channel.send(header, payload)
                sent += 1
        self._served += 1
        if self._served == len(self.others) and not self._all_served.done():
            self._all_served.set_result(None)


def _left_out(header: dict, members: int) -> set[int]:
    """The member rows an average's frame says its rule left out (absent: none)."""
    if "out" not in header:
        return set()
    rows = frame_field(header, "out", list)
    if len(rows) > members or not all(type(row) is int and 0 <= row < members for row in rows):
        raise FrameError(f"frame field 'out' must list at most {members} member indices")
    return set(rows)


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _expect(header: dict, kind: str) -> dict:
    if header["t"] != kind:
        raise FrameError(f"expected a {kind!r} frame, got {header['t']!r}")
    return header

