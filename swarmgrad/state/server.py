"""The donor's side of handing over a state: a peer's latest snapshots (and the one before, so a
download that started just before the donor moved on can finish, and any a download under way still
reads) and the results of its last rounds, served to joiners (state/transfer.py) and to peers that
missed a round and replay it (state/results.py, peer/catch_up.py).

Protocol (one channel per donor, any number of requests on it, then ``done``: on the direct data
plane the connection is pooled, so the end of an exchange is said, not inferred from a close).
Requests are answered one at a time, in the order they came, so a joiner may send several before
reading the answers (state/transfer.py keeps ``PIPELINE_PARTS`` part requests in flight):
    -> {"t": "describe"[, "version"]}         <- {"t": "state", "version", "digest", "nbytes"} + msgpack(specs, meta)
    -> {"t": "sketch", "version", "seed",     <- {"t": "sketch", "version", "seed", "parts", "classes", "k"}
        "parts": [ascending indices]}            + float32[parts][classes][k]
    -> {"t": "part", "version", "index"}      <- {"t": "part", "version", "index"} + raw bytes
    -> {"t": "result", "epoch"[, "frames"]    <- {"t": "result", "epoch", "numel"} + bfloat16 bytes, or, when
        [, "chunks"][, "first", "count"]}        asked for chunks: {"t": "result", "epoch", "numel", "chunks": n}
                                                 then n frames {"t": "result-chunk", "epoch", "index"} + at most
                                                 RESULT_CHUNK_BYTES of those bytes each, or, when asked for frames
                                                 and kept: {"t": "result", "epoch", "numel", "frames": n} then the
                                                 n chunk frames it travelled in (with "first" and "count": those
                                                 frames only, said in the reply's header too)
    -> {"t": "digest", "epoch"}               <- {"t": "digest", "epoch", "sha256"} (of those bytes)
    -> {"t": "done"}
``describe`` without a version describes the latest snapshot. A sketch reads the parts asked for,
at most ``SKETCH_PARTS`` (state/sketch.py; an older joiner's request without ``parts`` gets every
part), so its cost does not grow with the state (measured: 1.6-4 ms per MiB read idle, up to 70 on
a loaded 2-core machine); its parts are read on the event loop, between the owner's outer steps, and
projected off it, one sketch at a time; donors keep the last
``SKETCH_CACHE`` by (version, seed, parts) and answer at most ``SKETCHES_PER_CHANNEL`` per channel
(one to compare, one per verification pass); past that the request is an invalid frame. A result asked for in chunks travels in frames of at most
``RESULT_CHUNK_BYTES`` (state/results.py): one frame is one AES-GCM message, which holds under 2 GiB.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Callable

import torch

from swarmgrad.eventloop import timeout
from swarmgrad.net.channel import Channel
from swarmgrad.net.transport import Transport
from swarmgrad.net.wire import FrameError, field, int_field
from swarmgrad.state import sketch as state_sketch
from swarmgrad.state.kept import HELD_RESULT_BYTES_PER_ELEMENT, KEPT_RESULTS, KeptResults, ResultHolds
from swarmgrad.state.results import ResultPieces
from swarmgrad.state.served import OuterStep, ServedState
from swarmgrad.state.sketch import CLASSES, MAX_SEED, SKETCH_PROJECTIONS, SKETCHES_PER_CHANNEL, sketch
from swarmgrad.state.snapshot import StateSnapshot, part_count
from swarmgrad.timing import DEFAULT_TIMING

# older snapshots a donor keeps while downloads under way still read them (past its latest ``keep``):
# on a slow link a state takes longer than an epoch (40 MB at 10 Mbit/s: 32 s, against epochs of
# 8 s), and a download whose version the donor dropped failed on every retry; bounded, since each
# held snapshot is a copy of the whole state and any peer may open a channel
PINNED_SNAPSHOTS = 2
SKETCH_CACHE = 4  # sketches a donor keeps, by (version, seed, parts)


def state_protocol(run_id: str) -> str:
    """The protocol a run's donors serve their state on."""
    return f"swarmgrad/{run_id}/state"


class StateServer:
    """Serves this peer's latest snapshots to joiners over ``protocol``."""

    def __init__(self, transport: Transport, protocol: str, keep: int = 2,
                 idle_seconds: float = DEFAULT_TIMING.join_timeout, keep_results: int = KEPT_RESULTS,
                 held_result_bytes: float = HELD_RESULT_BYTES_PER_ELEMENT):
        self.transport, self.protocol, self.keep, self.idle_seconds = transport, protocol, keep, idle_seconds
        self.holds = ResultHolds(idle_seconds)
        # held_result_bytes: per element, beyond the last ``keep_results`` (on disk: state/kept.py)
        self.results = KeptResults(self.holds, keep_results, held_result_bytes)
        self._snapshots: dict[int, StateSnapshot | ServedState] = {}
        self._described: dict[int, bytes] = {}
        self._readers: Counter[int] = Counter()  # version -> channels whose download reads it
        self._saving: Counter[int] = Counter()  # version -> checkpoints written from it (``hold``)
        self._sketches: dict[tuple[int, int, tuple[int, ...]], bytes] = {}  # (version, seed, parts): oldest first
        self._sketching = asyncio.Lock()  # one sketch at a time: joiners cannot make this peer compute more

    async def __aenter__(self) -> StateServer:
        await self.transport.serve(self.protocol, self._serve)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.transport.stop_serving(self.protocol)

    @property
    def latest(self) -> StateSnapshot | ServedState | None:
        return self._snapshots[max(self._snapshots)] if self._snapshots else None

    def publish(self, snapshot: StateSnapshot | ServedState) -> None:
        for version in [version for version in self._snapshots if version > snapshot.version]:
            self._snapshots.pop(version)  # this peer went back to the swarm's epoch: what it held past it goes
            self._described.pop(version)
        self._snapshots[snapshot.version] = snapshot
        self._described[snapshot.version] = snapshot.describe()
        self._drop_old()

    def retire(self, step: OuterStep | None = None) -> bool:
        """The owner is about to change the tensors its served states read (state/served.py): a state
        a download under way reads keeps them, any other is no longer served. True when one kept
        them: the owner then goes on with copies and leaves these alone. ``step``: the change is one
        the states can read past (no copies; state/served.py), unless a checkpoint holds a state
        (it writes the tensors themselves) or a state cannot."""
        if step is not None and (self._saving or not all(state.can_read_past(step)
                                                         for state in self._snapshots.values())):
            step = None
        kept = [snapshot.retire(self._readers[version], step) for version, snapshot in list(self._snapshots.items())]
        self._drop_old()
        return any(kept)

    def hold(self, version: int) -> Callable[[], None]:
        """Read ``version`` outside a download (a checkpoint written from it): it is kept, and its
        tensors left alone by the owner, until the returned call releases it. On the event loop."""
        self._readers[version] += 1
        self._saving[version] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._saving[version] -= 1
                if self._saving[version] <= 0:
                    del self._saving[version]
                self._reading(version, None)

        return release

    def _drop_old(self) -> None:
        """Keep the latest ``keep`` snapshots, and the newest ``PINNED_SNAPSHOTS`` older ones that a
        download under way reads; never a state whose live tensors moved on (stale), nor one frozen
        for downloads (state/served.py) once none reads it."""
        older = sorted(self._snapshots)[: -self.keep]
        read = [version for version in older if self._readers[version] > 0]
        read = read[max(0, len(read) - PINNED_SNAPSHOTS):]
        for version in list(self._snapshots):
            snapshot = self._snapshots[version]
            unread = self._readers[version] <= 0 and version != max(self._snapshots)
            if (version in older and version not in read) or snapshot.stale or \
                    (snapshot.frozen and unread):
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

    def publish_result(self, epoch: int, result: torch.Tensor | ResultPieces,
                       frames: list[tuple[dict, bytes]] | None = None) -> None:
        """Keep what round ``epoch`` applied here, for a peer that missed the round to replay
        (state/kept.py: as the ``frames`` it travelled in where given, else as bfloat16; on disk)."""
        self.results.add(epoch, result, frames)

    def held_bytes(self) -> dict[str, int]:
        """Host bytes this server holds of its own: served states' copies and kept results."""
        return {"served_state_copies": sum(snapshot.held_bytes() for snapshot in self._snapshots.values()),
                "kept_results": self.results.held_bytes_in_memory()}

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
                    self.holds.reading(channel.peer_id, snapshot.version, new_channel=reading is None)
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
                    parts = sketched_parts(request.header, part_count(snapshot.nbytes))
                    await channel.send({"t": "sketch", "version": version, "seed": seed, "parts": len(parts),
                                        "classes": len(CLASSES), "k": SKETCH_PROJECTIONS},
                                       await self._sketch(snapshot, seed, parts))
                elif request.kind == "part":
                    version = field(request.header, "version", int)
                    snapshot = self._snapshots.get(version)
                    if snapshot is None:
                        await channel.send_error(f"version {version} is no longer held here")
                        return
                    index = int_field(request.header, "index", 0, max(0, part_count(snapshot.nbytes) - 1))
                    await channel.send({"t": "part", "version": version, "index": index},
                                       memoryview(snapshot.read_part(index).numpy()))
                elif request.kind in ("result", "digest"):
                    epoch = field(request.header, "epoch", int)
                    self.holds.replaying(channel.peer_id, epoch)
                    if epoch not in self.results:
                        await channel.send_error(f"the result of round {epoch} is not kept here")
                        return
                    if request.kind == "digest":
                        digest = await self.results[epoch].named()
                        await channel.send({"t": "digest", "epoch": epoch, "sha256": digest})
                    else:
                        await self._send_result(channel, epoch, request.header)
                else:
                    raise FrameError(f"unexpected request {request.kind!r}")
        finally:
            if reading is not None:
                self.holds.read(channel.peer_id)  # held idle_seconds more: its replay comes next
            self._reading(reading, None)

    async def _send_result(self, channel: Channel, epoch: int, request: dict) -> None:
        """A kept result: in the frames it travelled in when asked for them and kept (``first`` and
        ``count``: those of them only, so that a peer takes one result from several donors at once),
        else as bfloat16, in chunks of at most ``RESULT_CHUNK_BYTES`` when asked for chunks (an older
        peer reads one frame). Read from disk a payload at a time (state/kept.py)."""
        kept = self.results[epoch]
        if kept.framed and request.get("frames") is not True:  # kept as frames only: a replaying peer decodes them
            await channel.send_error(f"the result of round {epoch} is kept only in the frames it travelled in")
            return
        if kept.framed:
            assert kept.headers is not None
            header = {"t": "result", "epoch": epoch, "numel": kept.numel, "frames": kept.count}
            first, count = 0, kept.count
            if "first" in request:
                first = int_field(request, "first", 0, max(0, kept.count - 1))
                count = int_field(request, "count", 1, kept.count - first)
                header.update(first=first, count=count)
            await channel.send(header)
            for index in range(first, first + count):
                await channel.send(kept.headers[index], await kept.read(index))
        elif request.get("chunks") is True:
            await channel.send({"t": "result", "epoch": epoch, "numel": kept.numel, "chunks": kept.count})
            for index in range(kept.count):
                await channel.send({"t": "result-chunk", "epoch": epoch, "index": index}, await kept.read(index))
        else:  # an older peer reads it in one frame
            data = b"".join([await kept.read(index) for index in range(kept.count)])
            await channel.send({"t": "result", "epoch": epoch, "numel": kept.numel}, data)

    async def _sketch(self, snapshot: StateSnapshot | ServedState, seed: int, parts: tuple[int, ...]) -> bytes:
        """The sketch of ``parts`` of ``snapshot`` for ``seed``, computed off the event loop, one at a
        time, kept for reuse. The parts are read on the loop, a part at a time, as served parts are:
        the owner's outer steps change the live tensors in place there, and a state read past them
        (state/served.py) is whole only between two steps. Read on a worker thread, a sketch taken
        during a step undid it on pieces it had not reached yet (lab, q2, 201M parameters: both
        donors' sketches were off, and a joiner's 5-minute download failed its verification)."""
        key = (snapshot.version, seed, parts)
        async with self._sketching:
            if key not in self._sketches:
                read: dict[int, torch.Tensor] = {}  # at most SKETCH_PARTS parts (64 MiB)
                for index in parts:
                    read[index] = snapshot.read_part(index)
                    await asyncio.sleep(0)  # one part's read at a time on the loop
                drawn = await asyncio.to_thread(sketch, read.__getitem__, snapshot.specs, seed, parts)
                self._sketches[key] = drawn.numpy().tobytes()
                while len(self._sketches) > SKETCH_CACHE:
                    self._sketches.pop(next(iter(self._sketches)))
            return self._sketches[key]


def sketched_parts(header: dict, count: int) -> tuple[int, ...]:
    """The parts a sketch request asks for, of a state of ``count`` parts: at most ``SKETCH_PARTS``,
    ascending, each once; every part where it names none (an older joiner)."""
    if "parts" not in header:
        return tuple(range(count))
    parts = header["parts"]
    most = state_sketch.SKETCH_PARTS
    if not (isinstance(parts, list) and len(parts) <= most
            and all(type(index) is int and 0 <= index < count for index in parts)
            and all(a < b for a, b in zip(parts, parts[1:]))):
        raise FrameError(f"a sketch asks for at most {most} ascending parts of 0..{count - 1}")
    return tuple(parts)
