"""Asynchronous gossip: push-sum averaging with no rounds and no barrier (SGP, arXiv 1811.10792).

Each peer holds its tensors x and a weight w (the samples behind them); x is its estimate of the
swarm's weighted mean. A push sends half the weight with the current estimate to one or a few
peers, picked from a time-varying exponential graph over the sorted live members (peer i talks to
i + 1, i + 2, i + 4, ... in turn). The receiver checks the push completely, queues it, and merges
everything queued at its next ``step``: x <- (w x + sum w_k x_k) / (w + sum w_k), w <- w + sum w_k.

Why push-sum and not pairwise averaging: a push needs no reply from the receiver's training loop,
so a slow peer never holds up a fast one, and weights make uneven peers mix fairly (architecture.md,
invariant 'weights are samples, bounded').

Mass accounting (DESIGN "Gossip"): the sender gives its half away *before* sending, so a push that
may have arrived is never counted twice; only an explicit refusal from the receiver gives it back.

Compression: a push carries x relative to a *reference* both ends of that edge hold (the last value
that crossed it, versioned), so as the swarm agrees the differences, and with them the codec's
error, shrink to zero (as in CHOCO-gossip). The receiver gets x^ = reference + decode(x - reference);
the sender keeps exactly what it did not give away, x' = (w x - given x^) / (w - given), so the
total sum of w x is conserved exactly and the compression error stays with the sender (error
feedback by construction). A reference that went out of step (a lost acknowledgement) is refused
explicitly and the edge starts over from zero.

Sparse codecs (topk) run one push-sum per coordinate instead (``sparse_gossip.py``).

Robustness: a merge first admits the pushes by the ``aggregator``'s gossip form (averaging/rules/).
With ``centered-clip`` (the run default) that is *clipped gossip*: the change a push would make to
this peer's estimate is clipped to τ, chosen from the distances of recent senders' pushes, so one
push moves a peer by at most τ whatever it claims; ``mean`` merges plain push-sum. Admission comes
after decoding and after the sender's privacy noise, so it composes with every codec and with privacy.

Privacy: with ``privacy`` set, what leaves is the difference to the edge's reference, clipped and
noised (each push is one release). The sender's own tensors are never noised, so the sum of w x
is then conserved in expectation rather than exactly. The first push on an edge releases the
whole estimate clipped to clip_norm, so private gossip suits small models or large clip norms;
DiLoCo with moshpit, which releases pseudo-gradients, is the better fit for private training.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Iterable, Mapping

import torch

from swarmgrad.averaging.codecs import get_codec
from swarmgrad.averaging.codecs.base import all_finite
from swarmgrad.averaging.frames import decode_chunk, encode_chunk
from swarmgrad.averaging.layout import Schema, check_averager_name
from swarmgrad.averaging.privacy import BudgetExhausted, Privacy, PrivateReleaser
from swarmgrad.averaging.pushsum import Push, exponential_neighbors, give, merge
from swarmgrad.averaging.report import RoundReport
from swarmgrad.averaging.rules import get_rule
from swarmgrad.averaging.settings import DEFAULT_AGGREGATOR, DEFAULT_COMPRESSION, Gossip, check_aggregator
from swarmgrad.averaging.sparse_gossip import BYTES_PER_ENTRY, SparseMass, pack, unpack
from swarmgrad.errors import ConfigError
from swarmgrad.eventloop import timeout
from swarmgrad.net.channel import Channel
from swarmgrad.net.network_runtime import NetworkRuntime
from swarmgrad.net.transport import Transport
from swarmgrad.net.wire import FrameError, RemoteError, int_field
from swarmgrad.net.wire import field as frame_field

logger = logging.getLogger(__name__)

MAX_WEIGHT = 1e15
# a peer whose weight fell below this fraction of what its neighbours hold (the last push it merged,
# or its starting weight) waits to receive before it gives more: weights halve with every push, and
# a peer that only pushes (its neighbours are slower) would otherwise reach weights no arithmetic
# can carry (2**-150 is 0 in float32). Relative to the neighbours, so that mass lost with failed
# pushes, which shrinks everyone's weight alike, never stops the swarm from mixing.
MIN_WEIGHT_FRACTION = 2.0**-40
MAX_RECEIVE_REFERENCES = 32  # per-sender references kept; an evicted sender starts over from zero
UNREACHABLE_FACTOR = 3.0  # a peer a push failed to reach is skipped this many presence TTLs (at least)


class GossipAverager:
    """Keeps ``tensors`` moving toward the swarm's weighted mean by push-sum gossip.

        async with NetworkRuntime("my-run") as runtime, GossipAverager(runtime, params, weight=len(shard)) as gossip:
            for batch in loader:
                train_step(batch)
                await gossip.step()        # merge what arrived, push half our weight onwards
    """

    def __init__(
        self,
        runtime: NetworkRuntime,
        tensors: Iterable[torch.Tensor] | Mapping[str, torch.Tensor],
        *,
        name: str = "params",
        settings: Gossip = Gossip(),
        weight: float = 1.0,
        codec: str = DEFAULT_COMPRESSION,
        max_pending: int = 16,
        privacy: Privacy | None = None,
        aggregator: str = DEFAULT_AGGREGATOR,
    ):
        named = list(tensors.items()) if isinstance(tensors, Mapping) else [(str(i), t) for i, t in enumerate(tensors)]
        if not named or not all(t.is_floating_point() for _, t in named):
            raise ConfigError("gossip needs at least one tensor, all of them floating point")
        if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
            raise ConfigError(f"weight must be finite and positive, got {weight}")
        try:
            self.codec = get_codec(codec)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self.runtime, self.node, self.run_id = runtime, runtime.node, runtime.run_id
        self.aggregator = check_aggregator(aggregator, "gossip")
        form = get_rule(aggregator).gossip()  # what of each push is merged
        assert form is not None  # check_aggregator admits only rules with a gossip form
        self.gossip_form = form
        if privacy is not None and privacy.noise_shares != 1:  # a push is seen alone: it must carry all the noise
            raise ConfigError(f"privacy noise_shares={privacy.noise_shares}: gossip pushes are not summed in groups; "
                              "use noise_shares=1")
        self.releaser = PrivateReleaser(privacy) if privacy is not None else None
        self.tensors = [t for _, t in named]
        self.schema = Schema.of(named)
        self.weight, self.fanout = float(weight), settings.fanout
        self._neighbour_weight = self.weight  # the scale of the weights around us (see MIN_WEIGHT_FRACTION)
        self.push_timeout, self.max_pending = settings.push_timeout, max_pending
        self.protocol = f"swarmgrad/{self.run_id}/gossip/{check_averager_name(name)}/{self.schema.digest[:12]}/{self.codec.spec}"
        self.step_index = 0
        self._values = torch.empty(self.schema.total, dtype=torch.float32)
        self._pending: list[Push] = []
        # peers a push just failed to reach (gone, or hung while leaving), skipped until then: a
        # departed peer costs one push timeout, not one per step until its membership expires
        self._unreachable: dict[str, tuple[float, float]] = {}  # peer -> (skipped until, its heartbeat then)
        self._received_bytes = 0
        self._sent_refs: dict[str, tuple[int, torch.Tensor]] = {}  # per receiver: version, last x^ sent
        self._received_refs: dict[str, tuple[int, torch.Tensor]] = {}  # per sender: version, last x^ received
        self.max_payload = max(self.codec.encoded_nbytes(chunk.view) for chunk in self.schema.chunks)
        # topk: one push-sum per coordinate, see sparse_gossip.py
        self.sparse = SparseMass(self.schema.total, weight, self.codec.fraction) if self.codec.name == "topk" else None
        if self.sparse is not None and privacy is not None:
            raise ConfigError("private gossip needs a dense codec (none, fp16, bf16, int8); topk is not supported")

    @property
    def transport(self) -> Transport | None:
        return self.runtime.transport

    async def __aenter__(self) -> GossipAverager:
        if self.transport is None:
            raise RuntimeError("enter the NetworkRuntime before the GossipAverager")
        await self.transport.serve(self.protocol, self._receive)
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self.transport is not None and self.node.p2p is not None:
            await self.transport.stop_serving(self.protocol)

    # ---- one step -------------------------------------------------------------------------------

    def add_weight(self, samples: float) -> None:
        """Mass for ``samples`` trained on since the last step: the estimate stays, its weight grows, so
        peers mix by the samples behind their values rather than one unit each (architecture.md,
        invariant 'weights are samples, bounded'). Nothing for a sample count that is not finite and positive."""
        if not (math.isfinite(samples) and samples > 0):
            return
        samples = min(float(samples), MAX_WEIGHT / 2)
        if self.sparse is not None:
            self.sparse.weights.add_(samples)
            self.weight = self.sparse.mean_weight
        else:
            self.weight = min(self.weight + samples, MAX_WEIGHT / 2)

    async def step(self) -> RoundReport:
        """Merge the pushes that arrived, then push half of our weight to this step's neighbours."""
        started = time.monotonic()
        report = RoundReport("gossip", self.step_index)
        report.merged = self._merge(report)
        neighbors = exponential_neighbors(self._live_members(), self.node.peer_id, self.step_index, self.fanout)
        self.step_index += 1
        self.schema.flatten_into(self.tensors, self._values)
        if self.weight < self._neighbour_weight * MIN_WEIGHT_FRACTION:
            neighbors = []  # starved: nothing left worth giving until a push arrives
        if neighbors and all_finite(self._values):
            try:
                outcomes = await asyncio.gather(*(self._push(peer, len(neighbors)) for peer in neighbors))
            except BudgetExhausted as error:
                report.error, outcomes = f"privacy budget exhausted, not pushing: {error}", []
            for peer, (accepted, sent) in zip(neighbors, outcomes):
                (report.pushed_to if accepted else report.failed).append(peer)
                report.bytes_sent += sent
        if self.releaser is not None:
            report.privacy = self.releaser.status()
        report.weight = self.weight
        report.bytes_received, self._received_bytes = self._received_bytes, 0
        report.seconds = time.monotonic() - started
        report.ok = report.error is None
        return report

    def _merge(self, report: RoundReport | None = None) -> int:
        pending, self._pending = self._pending, []
        if not pending:
            return 0
        self.schema.flatten_into(self.tensors, self._values)
        pending, clipped = self.gossip_form.admit(self._values, pending)
        for sender in sorted({pending[index].sender for index in clipped}):
            logger.info("step %d: the push from %s was clipped", self.step_index, sender)
            if report is not None:
                report.suspicions[sender] = ["clipped"]
        if report is not None:
            report.clipped = len(clipped)
        if self.sparse is not None:
            for push in pending:
                self.sparse.merge(self._values, push.indices, push.values, push.weight)
            self.weight = self.sparse.mean_weight
            self.schema.unflatten_into(self._values, self.tensors)
            return len(pending)
        self._neighbour_weight = max(push.weight for push in pending)
        self.weight = merge(self._values, self.weight, pending)
        self.schema.unflatten_into(self._values, self.tensors)
        return len(pending)

    def _live_members(self) -> list[str]:
        """Training members as of the runtime's last presence refresh, less those a push just failed to
        reach, those paused, and (behind a NAT) those behind NATs too: nothing could carry the push."""
        now, members = time.monotonic(), self.runtime.members()
        heard = {m.peer_id: m.last_seen for m in members}
        self._unreachable = {peer: (until, seen) for peer, (until, seen) in self._unreachable.items()
                             if until > now or heard.get(peer, math.inf) <= seen}  # gone from the list: forgotten
        return [m.peer_id for m in members if m.role == "peer" and m.peer_id not in self._unreachable
                and not m.paused and self.runtime.can_reach(m.peer_id)]

    def _mark_unreachable(self, peer: str) -> None:
        # a departed peer costs one push timeout: it is skipped for a few TTLs and, past that, for as
        # long as its listing shows no newer heartbeat (a dead peer's record only expires, and on a
        # loaded DHT a record lives as many of its owner's beats as they really take: past the TTL)
        heard = max((m.last_seen for m in self.runtime.members() if m.peer_id == peer), default=0.0)
        self._unreachable[peer] = (time.monotonic() + UNREACHABLE_FACTOR * self.runtime.timing.presence_ttl, heard)

    async def _push(self, peer: str, neighbors: int) -> tuple[bool, int]:
        """Give ``weight / (neighbors + 1)`` away to ``peer``; True if it took it."""
        assert self.transport is not None
        if self.sparse is not None:
            return await self._push_sparse(peer, neighbors)
        given = self.weight / (neighbors + 1)
        version, reference = self._sent_refs.get(peer, (0, None))
        difference = self._values if reference is None else self._values - reference
        # what leaves is the clipped, noised difference (architecture.md, invariant 'privacy before anything leaves')
        if self.releaser is not None:
            difference = self.releaser.release([difference])[0]
        frames = [encode_chunk(self.codec, difference[c.start : c.start + c.length].view(c.view))
                  for c in self.schema.chunks]
        arrives = self._decoded(frames, reference)  # exactly what the receiver will compute
        # give the mass away first: a push that may have arrived is never counted twice. With privacy
        # the local estimate keeps its own values (it is never noised); mass is conserved in expectation.
        before = self._give(given, self._values if self.releaser is not None else arrives)
        channel = None
        try:
            async with timeout(self.push_timeout):
                channel = await self.transport.open(peer, self.protocol)
                await channel.send({"t": "push", "weight": given, "chunks": len(frames), "ref": version})
                for chunk, (header, payload) in zip(self.schema.chunks, frames):
                    await channel.send({"t": "chunk", "c": chunk.index, **header}, payload)
                reply = await channel.recv(max_payload=0)
            if reply.kind != "ack":
                raise RemoteError(f"unexpected reply {reply.kind!r}")
            self._sent_refs[peer] = (version + 1, arrives)
            return True, channel.bytes_sent
        except RemoteError as error:  # refused with a reason, before merging: take the mass back
            logger.info("push to %s refused: %s", peer, error)
            self._take_back(given, before)
            self._sent_refs.pop(peer, None)  # start this edge over from zero
            return False, channel.bytes_sent if channel else 0
        except Exception as error:  # may or may not have arrived: the share is lost, never doubled
            logger.info("push to %s failed (%s: %s); its share is lost", peer, type(error).__name__, error)
            self._sent_refs.pop(peer, None)
            self._mark_unreachable(peer)
            return False, channel.bytes_sent if channel else 0
        finally:
            if channel is not None:
                await channel.close()

    async def _push_sparse(self, peer: str, neighbors: int) -> tuple[bool, int]:
        assert self.transport is not None and self.sparse is not None
        indices = self.sparse.select(self._values)
        given = self.sparse.give(self._values, indices, 1.0 / (neighbors + 1))  # before sending, as dense pushes
        self.weight = self.sparse.mean_weight
        payload = pack(indices, self._values[indices], given)
        channel = None
        try:
            async with timeout(self.push_timeout):
                channel = await self.transport.open(peer, self.protocol)
                await channel.send({"t": "push", "sparse": len(indices)}, payload)
                reply = await channel.recv(max_payload=0)
            if reply.kind != "ack":
                raise RemoteError(f"unexpected reply {reply.kind!r}")
            return True, channel.bytes_sent
        except RemoteError as error:  # refused before merging: the mass comes back
            logger.info("sparse push to %s refused: %s", peer, error)
            self.sparse.take_back(indices, given)
            self.weight = self.sparse.mean_weight
            return False, channel.bytes_sent if channel else 0
        except Exception as error:  # may or may not have arrived: lost, never doubled
            logger.info("sparse push to %s failed (%s: %s); its share is lost", peer, type(error).__name__, error)
            self._mark_unreachable(peer)
            return False, channel.bytes_sent if channel else 0
        finally:
            if channel is not None:
                await channel.close()

    def _decoded(self, frames: list[tuple[dict, bytes | memoryview]], reference: torch.Tensor | None) -> torch.Tensor:
        """reference + decode(frames): what the receiver of these frames ends up with."""
        if not self.codec.lossy and reference is None:
            return self._values.clone()
        decoded = torch.empty_like(self._values)
        for chunk, (header, payload) in zip(self.schema.chunks, frames):
            decoded[chunk.start : chunk.start + chunk.length] = decode_chunk(self.codec, header, payload, chunk.view)
        return decoded if reference is None else decoded.add_(reference)

    def _give(self, given: float, arrives: torch.Tensor) -> torch.Tensor | None:
        """Keep exactly what was not given away: w x - given x^ = (w - given) x'.

        ``self._values`` follows, so a second push of the same step starts from what is left.
        Returns the values before, when they changed (for ``_take_back``); None when they did not.
        """
        kept, self.weight = give(self._values, self.weight, given, arrives)
        if kept is self._values:
            return None
        before, self._values = self._values, kept
        self.schema.unflatten_into(kept, self.tensors)
        return before

    def _take_back(self, given: float, before: torch.Tensor | None) -> None:
        self.weight += given
        if before is not None:
            self._values = before
            self.schema.unflatten_into(before, self.tensors)

    # ---- receiving ----------------------------------------------------------------------------

    async def _receive_sparse(self, channel: Channel, header: dict, length: int) -> None:
        count = int_field(header, "sparse", 1, self.schema.total)
        payload = memoryview(bytearray(length))
        await channel.recv_payload_into(payload)
        indices, values, weights = unpack(payload, count, self.schema.total)
        if len(self._pending) >= self.max_pending:
            await channel.send_error("busy: too many pushes waiting to be merged; try another peer")
            return
        self._pending.append(Push(weights, values, indices, channel.peer_id))
        self._received_bytes += channel.bytes_received
        await channel.send({"t": "ack"})

    async def _receive(self, channel: Channel) -> None:
        """Validate a whole push into a private buffer, queue it, acknowledge. State is untouched."""
        async with timeout(self.push_timeout):
            header, length = await channel.recv_header(max_payload=BYTES_PER_ENTRY * self.schema.total)
            if header["t"] != "push":
                raise FrameError(f"expected a 'push' frame, got {header['t']!r}")
            if self.sparse is not None:
                await self._receive_sparse(channel, header, length)
                return
            if length:
                raise FrameError("a dense push header carries no payload")
            weight = frame_field(header, "weight", float)
            if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
                raise FrameError(f"push weight {weight} is not finite and positive")
            int_field(header, "chunks", len(self.schema.chunks), len(self.schema.chunks))
            version = int_field(header, "ref", 0, 2**62)
            base = None
            if version:
                known_version, base = self._received_refs.get(channel.peer_id, (-1, None))
                if known_version != version:
                    await channel.send_error(f"reference {version} is out of step here; start over from 0")
                    return
            if len(self._pending) >= self.max_pending:
                await channel.send_error("busy: too many pushes waiting to be merged; try another peer")
                return
            values = torch.empty(self.schema.total, dtype=torch.float32)
            scratch = memoryview(bytearray(self.max_payload))
            for expected in self.schema.chunks:
                header, length = await channel.recv_header(self.max_payload)
                if header["t"] != "chunk" or int_field(header, "c", 0, len(self.schema.chunks)) != expected.index:
                    raise FrameError(f"expected chunk {expected.index}")
                await channel.recv_payload_into(scratch[:length])
                decoded = decode_chunk(self.codec, header, scratch[:length], expected.view)
                values[expected.start : expected.start + expected.length] = decoded
            if base is not None:
                values.add_(base)
            if not all_finite(values):
                raise FrameError("push holds NaN or Inf once decoded")
            if len(self._pending) >= self.max_pending:
                await channel.send_error("busy: too many pushes waiting to be merged; try another peer")
                return
            self._pending.append(Push(weight, values, sender=channel.peer_id))
            self._received_refs.pop(channel.peer_id, None)
            self._received_refs[channel.peer_id] = (version + 1, values)
            while len(self._received_refs) > MAX_RECEIVE_REFERENCES:  # forget the longest-silent sender
                del self._received_refs[next(iter(self._received_refs))]
            self._received_bytes += channel.bytes_received
            await channel.send({"t": "ack"})
