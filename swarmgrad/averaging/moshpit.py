"""Moshpit averaging: groups that all-reduce, regrouping every round (Moshpit SGD, arXiv 2103.03239).

Peers sit on a virtual d-dimensional grid, d = ceil(log_g N) for N members that average and g =
``group_size`` (grid.py). A peer's cell comes from its *rank* in the membership it reads from the
presence records, sorted by a hash of the run, the cycle of d rounds and the peer id, so ranks fill
the grid cell by cell and every cycle lays the swarm out afresh. In round t a peer meets the peers
that share its coordinates in every dimension except ``t mod d``, through a DHT key for that slice,
and knows how many to wait for. On a full grid (N = 8, 16, 32, 64 with g = 4) every peer holds the
exact mean after d rounds.

(Coordinates hashed from peer ids, as before, made cells collide: at 16 peers groups came out small,
a tenth of the peer-rounds found no group, and consensus took 14 rounds instead of 2.)

    async with NetworkRuntime("my-run") as runtime, Averager(runtime, [flat], settings=Moshpit(group_size=4)) as averager:
        report = await averager.step(weight=samples_since_last_round)
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Callable, Iterable, Mapping, Sequence

import torch

from swarmgrad.averaging.allreduce import AllReduceReport, GroupAllReduce
from swarmgrad.averaging.codecs import ErrorFeedback, get_codec
from swarmgrad.averaging.codecs.base import all_finite
from swarmgrad.averaging.grid import (
    grid_order,
    grid_position,
    grid_sides,
    hub_groups,
    slice_ranks,
    slices_reach_everyone,
)
from swarmgrad.averaging.group_plan import GroupPlan
from swarmgrad.averaging.layout import Schema, check_averager_name
from swarmgrad.averaging.matchmaking import Matchmaker, Retried
from swarmgrad.averaging.privacy import BudgetExhausted, Privacy, PrivateReleaser
from swarmgrad.averaging.report import RoundReport
from swarmgrad.averaging.result_frames import Frame, FramedAverage, ResultDecoder, ordered_frames
from swarmgrad.averaging.settings import DEFAULT_COMPRESSION, Aggregation, Moshpit
from swarmgrad.averaging.stragglers import Pace
from swarmgrad.dht.membership import reachability
from swarmgrad.errors import ConfigError
from swarmgrad.eventloop import timeout
from swarmgrad.net.channel import Channel
from swarmgrad.net.network_runtime import NetworkRuntime
from swarmgrad.net.wire import expect_kind
from swarmgrad.net.wire import field as frame_field

logger = logging.getLogger(__name__)


AVERAGING_ROLES = ("peer", "client")  # client: a training peer that others cannot dial
NO_GROUP = "no group formed this round; tensors unchanged"
SWARM_MOVED_ON = "the swarm finished this round without this peer; tensors unchanged"
UNREACHABLE_GROUP = "no member of this round's group can be reached (none publishes an address): left out of the round"


def _flat_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Float32 CPU tensors that tile one contiguous buffer end to end (a single tensor, or views cut
    from one flat vector in order) are sent from that memory, without a copy (it is only read
    during a round: the average lands in a separate buffer first). None when they do not."""
    first = tensors[0]
    storage, offset, total = first.untyped_storage(), first.storage_offset(), 0
    for tensor in tensors:
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        if tensor.untyped_storage().data_ptr() != storage.data_ptr() or tensor.storage_offset() != offset + total:
            return None
        total += tensor.numel()
    if len(tensors) == 1:
        return first.detach().view(-1)
    return torch.empty(0, dtype=torch.float32).set_(storage, offset, (total,), (1,))


class Averager:
    """Averages a fixed set of tensors in place with moshpit groups of the run's peers.

    ``aggregation``: the rule a part's owner combines contributions by and the most weight one may
    claim (``Aggregation``: centered-clip, no cap, by default); peers of a group use the same rule.

    ``write_back=False``: a successful round leaves the tensors as they are and the average in
    ``averager.average`` (flat; ``take_average`` hands it over), for a caller that reads it once where
    it landed instead of copying it back. Each round's average is a buffer of its own, freed once
    the caller is done with it: between rounds the averager holds no model-sized result.

    ``swap_storage=True`` (one contiguous float32 CPU tensor, no privacy): after a successful round
    the tensor's storage is *replaced* by the buffer the average landed in (``Tensor.set_``), which
    saves a copy of the whole tensor per round. Only for a tensor that nothing else views: a view
    taken before the round keeps the old values.
    """

    def __init__(
        self,
        runtime: NetworkRuntime,
        tensors: Iterable[torch.Tensor] | Mapping[str, torch.Tensor],
        *,
        name: str = "tensors",
        settings: Moshpit = Moshpit(),
        codec: str = DEFAULT_COMPRESSION,
        grid_dims: int | None = None,
        coordinates: Sequence[int] | None = None,
        share: float = 1.0,
        privacy: Privacy | None = None,
        swap_storage: bool = False,
        write_back: bool = True,
        aggregation: Aggregation = Aggregation(),
    ):
        named = list(tensors.items()) if isinstance(tensors, Mapping) else [(str(i), t) for i, t in enumerate(tensors)]
        if not named:
            raise ConfigError("nothing to average: no tensors given")
        for tensor_name, tensor in named:
            if not tensor.is_floating_point():
                raise ConfigError(f"tensor {tensor_name!r} is {tensor.dtype}; only float tensors can be averaged")
        self.runtime, self.run_id, self.name, self.settings = runtime, runtime.run_id, check_averager_name(name), settings
        self.names, self.tensors = [tensor_name for tensor_name, _ in named], [tensor for _, tensor in named]
        self.schema = Schema.of(named)
        try:
            self.codec = get_codec(codec)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self.feedback = ErrorFeedback(self.codec) if self.codec.lossy else None
        self.aggregation = aggregation  # how owners combine contributions (allreduce.py, rules/)
        self.group_size, self.min_group_size = settings.group_size, settings.min_group_size
        self.grid_dims, self.coordinates = grid_dims, list(coordinates) if coordinates is not None else None
        self.matchmaking_seconds, self.share = settings.matchmaking_seconds, share
        limits = runtime.limits  # a capped link bounds the rate a first round's deadline assumes
        self.timer = runtime.timing.round_timer(settings.round_timeout, *(
            bucket.rate if bucket is not None else None for bucket in (limits.upload, limits.download)))
        self.round_index = 0
        # with privacy the contribution is a released copy, never the tensors themselves
        self.releaser = PrivateReleaser(privacy) if privacy is not None else None
        flat = _flat_view(self.tensors) if self.releaser is None else None
        if swap_storage and (flat is None or len(self.tensors) != 1):
            raise ConfigError("swap_storage needs one contiguous float32 CPU tensor and no privacy (the result "
                              "buffer becomes the tensor's storage)")
        self.swap_storage, self.write_back = swap_storage, write_back
        self._reader: Callable[[], Callable[[int, int], torch.Tensor] | None] | None = None  # read_in_place
        # write_back=False: the last round's average (flat), as its frames where the return codec is lossy
        # and it did not land in the contribution (result_frames.py), else float32
        self.average: torch.Tensor | FramedAverage | None = None
        # the last round's result as it travelled (result_frames.py), None when it failed or the
        # return codec is lossless (then the float values are the smallest form)
        self.result_frames: list[Frame] | None = None
        self.result_decoder = ResultDecoder(self.schema, self.codec)
        self._buffer = flat if flat is not None else torch.empty(self.schema.total, dtype=torch.float32)
        # swap_storage: the tensor's old storage is the next round's result buffer; else each round's
        # result is a fresh buffer, freed once the caller applied it (no model-sized buffer between rounds)
        self._result = torch.zeros(self.schema.total, dtype=torch.float32) if swap_storage else None
        self._rounds: dict[str, GroupAllReduce] = {}
        self._rounds_changed = asyncio.Condition()
        # the averager's name keeps two averagers of one peer apart even when their tensors look alike
        prefix = f"swarmgrad/{self.run_id}/averaging/{name}/{self.schema.digest[:12]}"
        self._allreduce_protocol, self._match_protocol = f"{prefix}/allreduce", f"{prefix}/match"
        self.matchmaker: Matchmaker | None = None

    @property
    def node(self):
        return self.runtime.node

    async def __aenter__(self) -> Averager:
        transport = self.runtime.transport
        if transport is None:
            raise RuntimeError("enter the NetworkRuntime before the Averager")
        self.matchmaker = Matchmaker(
            self.node, transport, self._match_protocol, schema_digest=self.schema.digest, codec=self.codec.spec,
            aggregator=self.aggregation.rule,
            reply_timeout=self.runtime.timing.reply_timeout,
        )
        await transport.serve(self._match_protocol, self.matchmaker.serve)
        await transport.serve(self._allreduce_protocol, self._serve_allreduce)
        return self

    async def __aexit__(self, *exc_info) -> None:
        transport = self.runtime.transport
        if self.matchmaker is not None:
            await self.matchmaker.close()
        if transport is not None and self.node.p2p is not None:
            await transport.stop_serving(self._match_protocol)
            await transport.stop_serving(self._allreduce_protocol)

    # ---- one round -----------------------------------------------------------------------------

    async def step(
        self, weight: float = 1.0, round_index: int | None = None, expected_peers: int | None = None,
        attempt: int = 0, in_place: bool | Callable[[], bool] = False, moved_on: Callable[[], bool] | None = None,
        retry: int | None = None,
    ) -> RoundReport:
        """Meet this round's group, average, and write the result into the tensors.

        ``weight`` is the number of samples behind this peer's tensors (architecture.md, invariant
        'weights are samples, bounded'). ``round_index`` lets peers that agree on a global step meet in the same round;
        by default a local counter. ``expected_peers``: how many peers the caller expects in this round (from swarm
        progress), so matchmaking ends as soon as they are all there. With ``privacy`` the tensors must be an *update*
        (a gradient or pseudo-gradient): it is clipped and noised before it leaves; past the budget the peer stops
        releasing and the report says so. The tensors are changed only when the round succeeds, and must not be changed
        by anyone else while the step runs. ``in_place`` (``write_back=False``): the average lands in the
        contribution buffer itself, no buffer of its own (a failed round leaves it partly overwritten:
        the caller fills it again before a retry); a callable is asked when the all-reduce begins, so
        the caller may change its mind while matchmaking runs. ``moved_on``: whether the swarm finished this round
        without this peer; once it says so before a group took this peer, the round ends unchanged
        (``SWARM_MOVED_ON``) instead of waiting out matchmaking (``Matchmaker.find_group``). ``retry``: the
        attempt the caller makes next if this one fails, said on this peer's declaration so that a peer
        that comes late follows it there; ``report.retried``: where the others went, a late peer's
        attempt ended at once (``Matchmaker.leave``).
        """
        if self.matchmaker is None:
            raise RuntimeError("use `async with Averager(...)` before calling step()")
        started = time.monotonic()
        index = self.round_index if round_index is None else round_index
        self.round_index = index + 1
        key, slice_peers, unreachable = self._round_key(index, attempt)
        report = RoundReport("moshpit", index, key=key)
        if not (math.isfinite(weight) and weight > 0):
            report.error = f"weight must be finite and positive, got {weight}"
            return report
        clients = self._clients()
        if slice_peers is not None and slice_peers <= clients:
            report.group, report.error = [self.node.peer_id], UNREACHABLE_GROUP
            logger.info("round %d: %s", index, UNREACHABLE_GROUP)
            return report
        lazy = self._reader is not None and self._reader() is not None
        if not lazy and not self._prepare_contribution(report):
            return report
        # a member others cannot dial owns no part (they would have to dial it), and leads no group
        share = self.share if self.node.dialable else 0.0
        group_size = max(self.group_size, len(slice_peers or ()))  # a hub round's group may be larger
        plan = await self.matchmaker.find_group(
            key, group_size=group_size, min_group_size=self.min_group_size,
            window=self.matchmaking_seconds, share=share, expected=expected_peers, expected_members=slice_peers,
            unreachable=unreachable, clients=clients, paces=self._paces() if slice_peers is not None else None,
            moved_on=moved_on,
        )
        if isinstance(plan, Retried):
            report.group, report.retried = [self.node.peer_id], plan.attempt
            report.error = f"the others left this key for attempt {plan.attempt}; tensors unchanged"
            self.matchmaker.leave(key, plan.attempt)  # a peer later still follows them too
        elif plan is None:
            moved = moved_on is not None and moved_on()
            report.group, report.error = [self.node.peer_id], SWARM_MOVED_ON if moved else NO_GROUP
            if not moved and retry is not None:
                self.matchmaker.leave(key, retry)
        else:
            in_place = in_place() if callable(in_place) else in_place
            read = self._reader() if self._reader is not None else None  # a flight's too: what it sent
            if lazy and read is None and not self._prepare_contribution(report):
                return report  # the caller filled the contribution meanwhile (its round became a flight)
            result = await self._allreduce(plan, weight, in_place and not self.write_back, read)
            self._apply(report, result, plan)
            if not report.ok and retry is not None:
                self.matchmaker.leave(key, retry)
        report.seconds = time.monotonic() - started
        return report

    def read_in_place(self, reader: Callable[[], Callable[[int, int], torch.Tensor] | None]) -> bool:
        """From now on ``reader()`` may return ``read(offset, length)``: where a round (run in turn, or in
        flight) reads its contribution a chunk at a time instead of from the tensors (which the caller then leaves
        unfilled, having checked it finite itself), its average handed over as frames; None: from the
        tensors. Taken (True) only with write_back=False, a lossy return codec (the frames hold the
        result) and no privacy (a release needs all of it at once)."""
        if self.write_back or self.releaser is not None or not self.codec.average_codec().lossy:
            return False
        self._reader = reader
        return True

    def held_bytes(self) -> dict[str, int]:
        """Host bytes this averager holds of its own, by what they are for (the contribution it reads
        in place is its caller's): error feedback, a result not yet taken, a released or gathered copy."""
        average = self.average
        held = {"error_feedback": self.feedback.held_bytes() if self.feedback is not None else 0,
                "result": (self._result.numel() * 4 if self._result is not None else 0)
                + (average.nbytes() if isinstance(average, FramedAverage) else
                   average.numel() * 4 if average is not None else 0)
                + sum(r.result.numel() * 4 if r.result is not None else
                      sum(len(payload) for _, payload in r.result_frames.values())
                      for r in self._rounds.values() if r.result is not self._result and r.result is not self._buffer)}
        if not self.tensors or self._buffer.data_ptr() != self.tensors[0].data_ptr():
            held["release"] = self._buffer.numel() * 4
        return held

    def take_average(self) -> tuple[torch.Tensor | FramedAverage | None, list[Frame] | None]:
        """write_back=False: the last round's average and the frames it travelled in, handed over once:
        the averager keeps no reference, so they are freed when the caller is done with them."""
        average, frames, self.average, self.result_frames = self.average, self.result_frames, None, None
        return average, frames

    def _prepare_contribution(self, report: RoundReport) -> bool:
        """Fill the contribution buffer: the tensors, or their private release (architecture.md, invariant
        'privacy before anything leaves')."""
        tensors = self.tensors
        if self.releaser is not None:
            try:
                tensors = self.releaser.release(self.tensors)  # clip, noise, count: before anything leaves
            except BudgetExhausted as error:
                report.error = f"privacy budget exhausted, not releasing: {error}"
                return False
            except ValueError as error:  # NaN/Inf in the update
                report.error = f"cannot release the update: {error}"
                return False
            finally:
                report.privacy = self.releaser.status()
        if self._buffer.data_ptr() != tensors[0].data_ptr():  # several tensors, or a release: gather them
            self.schema.flatten_into(tensors, self._buffer)
        if not all_finite(self._buffer):
            report.error = "local tensors hold NaN or Inf; not sending them"
            return False
        return True

    async def _allreduce(self, plan: GroupPlan, weight: float, in_place: bool,
                         read: Callable[[int, int], torch.Tensor] | None = None) -> tuple[AllReduceReport, GroupAllReduce]:
        assert self.runtime.transport is not None
        # a caller that reads the average where it landed gets a lossy round's frames alone: no
        # float32 result of the model's size beside the contribution (result_frames.py)
        frames_only = read is not None or (
            not (in_place or self.write_back or self.swap_storage) and self.codec.average_codec().lossy)
        if frames_only:
            result = None
        elif in_place:
            result = self._buffer
        elif self._result is not None:
            result = self._result
        else:
            result = torch.empty(self.schema.total, dtype=torch.float32)
        allreduce = GroupAllReduce(
            plan, self.node.peer_id, self.schema, read if read is not None else self._buffer, weight, self.codec,
            self.runtime.transport, self._allreduce_protocol, self.feedback, contribution_checked=True,
            result="frames" if frames_only else result, weight_cap=self.aggregation.weight_cap,
        )
        async with self._rounds_changed:
            self._rounds[plan.round_id] = allreduce
            self._rounds_changed.notify_all()
        nbytes = allreduce.planned_bytes()
        try:
            result = await allreduce.run(self.timer.deadline(nbytes))
        finally:
            self._rounds.pop(plan.round_id, None)
        if result.ok:
            self.timer.observe(nbytes, result.seconds)
        elif result.timed_out:  # the message says what the deadline assumed, and what comes next
            result.error = f"{result.error} ({self.timer.missed(nbytes)})"
        return result, allreduce

    def _apply(self, report: RoundReport, outcome: tuple[AllReduceReport, GroupAllReduce], plan: GroupPlan) -> None:
        result, allreduce = outcome
        report.group, report.contributors, report.error = result.group, result.contributors, result.error
        report.bytes_sent, report.bytes_received = result.bytes_sent, result.bytes_received
        report.allreduce_seconds, report.transports = result.seconds, result.transports
        report.suspicions, report.observed = result.suspicions, result.observed
        report.rejected_share = result.rejected_share
        self.result_frames = ordered_frames(allreduce.result_frames, self.schema) if result.ok else None
        if not result.ok:
            if self.feedback is not None:
                self.feedback.discard()
            logger.info("round %s failed: %s", plan.round_id, result.error)
            return
        if self.swap_storage:
            self._swap_in(allreduce.result)
        elif self.write_back:
            self.schema.unflatten_into(allreduce.result, self.tensors)
        elif allreduce.result is None:  # frames only: the caller reads them a slice at a time
            assert self.result_frames is not None  # a lossy return codec keeps every chunk's frame
            self.average = FramedAverage(self.result_frames, self.schema, self.codec)
        else:  # the caller reads it where it landed (``take_average``)
            self.average = allreduce.result
        if self.feedback is not None:
            self.feedback.commit()
        report.ok = True

    @torch.no_grad()
    def _swap_in(self, result: torch.Tensor) -> None:
        """The tensor takes the result buffer as its storage, and its old storage becomes the next
        round's result buffer: no copy of the average. Every writer of the buffer has finished (the
        all-reduce awaited its tasks and served streams before reporting success)."""
        tensor = self.tensors[0]
        tensor.set_(result.view(tensor.shape))
        self._buffer, self._result = result, self._buffer

    def _round_key(self, index: int, attempt: int = 0) -> tuple[str, frozenset[str] | None, frozenset[str]]:
        """This round's DHT key (the slice of the grid this peer is in, along dimension index mod d,
        or its hub group when that grid would leave a slice with no member others can dial), the
        peers this peer's view of the membership puts there (None when the caller fixed the
        coordinates, or while members are still arriving: a view that misses a newcomer would end
        matchmaking before the newcomer's declaration is read), and which members cannot be dialled."""
        unreachable = self._unreachable()
        if self.coordinates is not None:
            dim = index % len(self.coordinates)
            place = ".".join(str(c) if d != dim else "*" for d, c in enumerate(self.coordinates))
            slice_peers = None
        else:
            place, slice_peers = self._position(index, unreachable)
            if not self.runtime.presence.settled:
                slice_peers = None
        round_name = f"r{index}" if attempt == 0 else f"r{index}.{attempt}"
        key = (f"swarmgrad/{self.run_id}/moshpit/{self.name}/{self.schema.digest[:12]}/{self.codec.spec}/"
               f"{round_name}/{place}")
        return key, slice_peers, unreachable

    def _averaging_members(self) -> list:
        """Members that take part in rounds: training roles, not paused (a paused one would be waited for)."""
        return [m for m in self.runtime.members() if m.role in AVERAGING_ROLES and not getattr(m, "paused", False)]

    def _paces(self) -> dict[str, Pace]:
        """What training members' records claim about their pace (stragglers.py: claims decide only
        whether a straggler is waited for, never for how long)."""
        return {m.peer_id: Pace(m.progress.steps_per_second, m.progress.averaging)
                for m in self._averaging_members() if m.progress is not None}

    def _unreachable(self) -> frozenset[str]:
        """Members others cannot dial, by the addresses they publish (presence), this peer by its own
        check. A member not listed yet counts as dialable, as every member did before NATs were
        known: all members then agree on a slice's leader however far their views are."""
        found = {m.peer_id for m in self._averaging_members() if m.reachability != "public"}
        me = self.node.peer_id
        return frozenset((found - {me}) if self.node.dialable else (found | {me}))

    def _clients(self) -> frozenset[str]:
        """Members nobody can reach at all, not even through a relay: they publish no address."""
        found = {m.peer_id for m in self._averaging_members() if m.reachability == "client"}
        me = self.node.peer_id
        return frozenset((found | {me}) if reachability(self.node.maddrs) == "client" else (found - {me}))

    def _position(self, index: int, unreachable: frozenset[str]) -> tuple[str, frozenset[str]]:
        """This peer's place in round ``index`` (its slice's coordinates, ``*`` along this round's
        dimension, or ``hub<j>``) from its rank among the members that average (as of the last
        presence refresh; bootstrap nodes and monitors never join a group), and whom that puts with
        it. Every d rounds the grid order is drawn afresh; hub groups are drawn every round."""
        me = self.node.peer_id
        peers = {member.peer_id for member in self._averaging_members()} | {me}
        if self.matchmaker is not None:
            self.matchmaker.attendance.keep_only(peers)
        sides = (self.group_size,) * self.grid_dims if self.grid_dims else grid_sides(len(peers), self.group_size)
        order = grid_order(list(peers), f"{self.run_id}/{self.name}/{index // len(sides)}")
        dim = index % len(sides)
        reachable = peers - unreachable
        # the grid, unless a slice of this round would hold only NATed members while some member is
        # public; with nobody public, NATed members meet over hole-punched or relayed connections
        if not unreachable & peers or not reachable or slices_reach_everyone(order, reachable, dim, sides):
            rank = order.index(me)
            coordinates = grid_position(rank, sides)
            place = ".".join(str(c) if d != dim else "*" for d, c in enumerate(coordinates))
            return place, frozenset(order[r] for r in slice_ranks(rank, len(order), dim, sides))
        groups = hub_groups(grid_order(list(peers), f"{self.run_id}/{self.name}/hub/{index}"), reachable,
                            self.group_size)
        for number, group in enumerate(groups):
            if me in group:
                return f"hub{number}", frozenset(group)
        return "unreachable", frozenset({me})

    # ---- incoming all-reduce streams -------------------------------------------------------------

    async def _serve_allreduce(self, channel: Channel) -> None:
        async with timeout(self.runtime.timing.control_timeout):
            first = expect_kind(await channel.recv(max_payload=0), "part")
        round_id = frame_field(first.header, "round", str)
        try:
            # the contributor may have learnt the plan a moment before we registered the round
            async with timeout(self.matchmaking_seconds + self.runtime.timing.control_timeout), self._rounds_changed:
                await self._rounds_changed.wait_for(lambda: round_id in self._rounds)
        except (asyncio.TimeoutError, TimeoutError):
            await channel.send_error(f"no round {round_id!r} is running here")
            return
        await self._rounds[round_id].accept(channel, first)
