"""Swarm-wide training progress through the DHT, so peers agree when a step is due without a coordinator.

Each peer keeps a signed ``ProgressRecord`` in its own slot of ``swarmgrad/R/progress``: its epoch
(the number of swarm steps it has taken part in), the samples and local steps it has trained on in
that epoch, and its rates. A background task republishes it every ``refresh`` seconds (and at
once when the epoch changes or the peer starts averaging) and reads everyone else's, so the
training thread only ever looks at a cached ``SwarmProgress``.

Others' counts are extrapolated from their rates since their last record (as hivemind's progress
tracker does), so a peer does not wait one refresh interval to see that the target was reached.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Annotated

import pydantic

from swarmgrad.dht.membership import check_run_id
from swarmgrad.dht.node import SwarmNode
from swarmgrad.dht.records import RecordBody, record_kind

logger = logging.getLogger(__name__)

RATE_SMOOTHING = 0.3  # weight of the newest interval in the samples/s average


@record_kind
class ProgressRecord(RecordBody):
    kind = "progress"
    max_ttl = 600.0

    epoch: Annotated[int, pydantic.Field(ge=0)]
    samples: Annotated[int, pydantic.Field(ge=0)]  # in this epoch
    steps: Annotated[int, pydantic.Field(ge=0)]  # local optimizer steps in this epoch
    samples_per_second: Annotated[float, pydantic.Field(ge=0, le=1e9, allow_inf_nan=False)]
    steps_per_second: Annotated[float, pydantic.Field(ge=0, le=1e6, allow_inf_nan=False)]
    averaging: bool = False  # has started averaging for this epoch: the others should join now
    left: bool = False  # stopped training: no longer counted
    updated_at: Annotated[float, pydantic.Field(allow_inf_nan=False)]


@dataclass(frozen=True)
class PeerProgress:
    peer_id: str
    epoch: int
    samples: float  # extrapolated to the time the snapshot was taken
    steps: float
    samples_per_second: float
    averaging: bool


@dataclass(frozen=True)
class SwarmProgress:
    """A snapshot of everyone's progress (this peer's own entry is exact, others' extrapolated)."""

    peers: tuple[PeerProgress, ...] = ()
    taken_at: float = 0.0

    @property
    def epoch(self) -> int:
        """The swarm's epoch: the furthest any live peer has got."""
        return max((peer.epoch for peer in self.peers), default=0)

    def at(self, epoch: int) -> list[PeerProgress]:
        return [peer for peer in self.peers if peer.epoch == epoch]

    def samples_in(self, epoch: int) -> float:
        return sum(peer.samples for peer in self.at(epoch))

    def mean_steps_in(self, epoch: int) -> float:
        peers = self.at(epoch)
        return sum(peer.steps for peer in peers) / len(peers) if peers else 0.0

    def averaging_in(self, epoch: int) -> bool:
        return any(peer.averaging for peer in self.at(epoch))

    @property
    def samples_per_second(self) -> float:
        return sum(peer.samples_per_second for peer in self.peers)


@dataclass
class LocalProgress:
    """This peer's counters; written by the training thread, read by the tracker's task."""

    epoch: int = 0
    samples: int = 0  # in this epoch
    steps: int = 0  # in this epoch
    total_samples: int = 0
    total_steps: int = 0
    samples_per_second: float = 0.0
    steps_per_second: float = 0.0
    averaging: bool = False
    _rate_mark: tuple[float, int, int] = field(default_factory=lambda: (time.monotonic(), 0, 0))

    def add(self, samples: int) -> None:
        self.samples += samples
        self.steps += 1
        self.total_samples += samples
        self.total_steps += 1

    def update_rates(self) -> None:
        now = time.monotonic()
        since, samples, steps = self._rate_mark
        if now - since < 0.2:
            return
        sample_rate = (self.total_samples - samples) / (now - since)
        step_rate = (self.total_steps - steps) / (now - since)
        if self.samples_per_second == 0.0:
            self.samples_per_second, self.steps_per_second = sample_rate, step_rate
        else:
            self.samples_per_second += RATE_SMOOTHING * (sample_rate - self.samples_per_second)
            self.steps_per_second += RATE_SMOOTHING * (step_rate - self.steps_per_second)
        self._rate_mark = (now, self.total_samples, self.total_steps)


class ProgressTracker:
    """Publishes this peer's progress and keeps a fresh ``SwarmProgress`` of the run.

    ``async with ProgressTracker(node, "run") as tracker:`` then ``tracker.local.add(batch)`` from
    training code, ``tracker.swarm`` for the latest snapshot, ``tracker.next_epoch(e)`` after a swarm step.
    """

    def __init__(self, node: SwarmNode, run_id: str, *, refresh: float = 1.0, ttl: float | None = None):
        self.node, self.run_id, self.refresh = node, check_run_id(run_id), refresh
        self.key = f"swarmgrad/{run_id}/progress"
        self.ttl = ttl if ttl is not None else max(10.0, 5 * refresh)
        self.local = LocalProgress()
        self.swarm = SwarmProgress()
        self._others: dict[str, tuple[ProgressRecord, float]] = {}  # peer -> record, expiry
        self._lock = threading.Lock()  # the training thread changes epochs while the task reads counters
        self._publish_now: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._last_expires = 0.0

    async def __aenter__(self) -> ProgressTracker:
        self._loop = asyncio.get_running_loop()
        self._publish_now = asyncio.Event()
        await self.publish()
        await self.read()
        self._task = asyncio.create_task(self._run(), name=f"progress {self.run_id}")
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.node.dht is not None and self._last_expires > 0:
            await self.publish(left=True)  # the others stop counting (and waiting for) us at once

    # ---- called from the training side (any thread) -------------------------------------------

    def next_epoch(self, epoch: int) -> None:
        """Start counting a new epoch (after a swarm step, or after catching up to the swarm)."""
        with self._lock:
            self.local.epoch, self.local.samples, self.local.steps = epoch, 0, 0
            self.local.averaging = False
        self._snapshot()
        self.publish_soon()

    def set_averaging(self, averaging: bool) -> None:
        with self._lock:
            self.local.averaging = averaging
        if averaging:
            self.publish_soon()

    def publish_soon(self) -> None:
        if self._loop is not None and self._publish_now is not None:
            self._loop.call_soon_threadsafe(self._publish_now.set)

    # ---- background ----------------------------------------------------------------------------

    async def _run(self) -> None:
        last_publish = time.monotonic()
        while True:
            assert self._publish_now is not None
            try:
                await asyncio.wait_for(self._publish_now.wait(), timeout=self.refresh / 2)
            except asyncio.TimeoutError:
                pass
            try:
                if self._publish_now.is_set() or time.monotonic() - last_publish >= self.refresh:
                    self._publish_now.clear()
                    await self.publish()
                    last_publish = time.monotonic()
                await self.read()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the DHT may be briefly unreachable: try again next tick
                logger.warning("progress update failed: %s: %s", type(error).__name__, error)

    async def publish(self, left: bool = False) -> None:
        with self._lock:
            self.local.update_rates()
            local = self.local
            body = ProgressRecord(
                epoch=local.epoch, samples=local.samples, steps=local.steps,
                samples_per_second=float(local.samples_per_second), steps_per_second=float(local.steps_per_second),
                averaging=local.averaging, left=left, updated_at=time.time(),
            )
        expires = max(time.time() + self.ttl, self._last_expires + 1e-3)
        if await self.node.store(self.key, body, expires, all_replicas=False):
            self._last_expires = expires

    async def read(self) -> None:
        records = await self.node.get_records(self.key, ProgressRecord)
        self._others = {
            owner: (record.body, record.expires) for owner, record in records.items()
            if owner != self.node.peer_id and not record.body.left
        }
        self._snapshot()

    def _snapshot(self) -> None:
        now, wall = time.monotonic(), time.time()
        with self._lock:
            local = self.local
            peers = [PeerProgress(self.node.peer_id, local.epoch, float(local.samples), float(local.steps),
                                  local.samples_per_second, local.averaging)]
        for owner, (record, expires) in self._others.items():
            if expires < wall:
                continue
            # extrapolate by the peer's rate, at most two refresh intervals (it may have stopped)
            elapsed = min(max(0.0, wall - record.updated_at), 2 * self.refresh) if not record.averaging else 0.0
            peers.append(PeerProgress(owner, record.epoch, record.samples + record.samples_per_second * elapsed,
                                      record.steps + record.steps_per_second * elapsed,
                                      record.samples_per_second, record.averaging))
        self.swarm = SwarmProgress(tuple(peers), taken_at=now)

    def fresh(self) -> SwarmProgress:
        """A snapshot with this peer's exact counters and others' extrapolated to now."""
        self._snapshot()
        return self.swarm

    def resume_counters(self, steps: int, samples: int) -> None:
        """Totals from a checkpoint; the rate starts over from them (they were not trained just now)."""
        with self._lock:
            self.local.total_steps, self.local.total_samples = steps, samples
            self.local._rate_mark = (time.monotonic(), samples, steps)

    def add(self, samples: int) -> None:
        """Count one local step on ``samples`` samples (from the training thread)."""
        with self._lock:
            self.local.add(samples)

    def ahead_of(self, epoch: int) -> list[str]:
        """Other peers already past ``epoch``: donors for a peer that fell behind."""
        return [peer.peer_id for peer in self.fresh().peers if peer.peer_id != self.node.peer_id and peer.epoch > epoch]

    def others_at(self, epoch: int) -> list[str]:
        return [peer.peer_id for peer in self.fresh().at(epoch) if peer.peer_id != self.node.peer_id]
