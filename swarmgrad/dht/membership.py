"""Run presence: who is in run R right now, and how far each member has got.

Each peer keeps one signed ``MemberRecord`` in its own slot of the DHT key ``swarmgrad/R/members``,
refreshed every ``refresh`` seconds (and at once when ``publish_soon`` is called) and expiring after
``ttl`` seconds, so a peer that dies silently drops out within its TTL. A graceful leave overwrites
the slot with a ``left`` record, so it is gone from every listing at once. A training peer's record
carries its ``Progress`` and its ``TrainingStats`` (loss, rounds, traffic: what a dashboard shows),
both filled by the peer layer; this layer only carries them. So membership and training progress
are one record with one TTL, and a watching member rereads everyone's records on the same beat.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Annotated, Callable, Literal

import pydantic

from swarmgrad.dht.config import check_run_id
from swarmgrad.dht.node import SwarmNode
from swarmgrad.dht.records import RecordBody, record_kind
from swarmgrad.dht.tickets import MAX_TICKET_BYTES
from swarmgrad.errors import ConfigError
from swarmgrad.version import __version__

logger = logging.getLogger(__name__)

Role = Literal["peer", "bootstrap", "client", "monitor"]
Reachability = Literal["public", "relayed", "client"]
DEFAULT_TTL = 30.0
FIRST_FAST_READS = 3  # a joiner's first rereads come every refresh, however large the run
# The nodes a presence store or reread visits: twice the replicas a record is stored on (hivemind's
# 5), so a read also reaches holders that a store with a partial routing table took for the nearest.
# hivemind's default, a bucket (20), visited a third of a 64-peer swarm every beat: 45 find and store
# requests a beat, 300 a second, both cores busy, 4 s a store and 3.5 s a reread.
PRESENCE_BEAM = 10
WORK_SAMPLES = 3  # beats whose measured store and reread a record's lifetime allows for (the slowest)


def members_key(run_id: str) -> str:
    return f"swarmgrad/{check_run_id(run_id)}/members"


class Progress(pydantic.BaseModel):
    """A training member's progress in its current epoch (its meaning is the peer layer's)."""

    # as in RecordBody: wrong types are errors, unknown fields are skipped (newer peers may add some)
    model_config = pydantic.ConfigDict(frozen=True, extra="ignore", strict=True)

    epoch: Annotated[int, pydantic.Field(ge=0)]
    samples: Annotated[int, pydantic.Field(ge=0)]  # in this epoch
    steps: Annotated[int, pydantic.Field(ge=0)]  # local optimizer steps in this epoch
    steps_per_second: Annotated[float, pydantic.Field(ge=0, le=1e6, allow_inf_nan=False)]
    averaging: bool = False  # has started averaging for this epoch: the others should join now
    settings: Annotated[str, pydantic.Field(max_length=64)] = ""  # digest of the run settings it trains with


class TrainingStats(pydantic.BaseModel):
    """A training member's totals, for dashboards: its smoothed loss and averaging counters.

    Claims like everything in a record: readers show them attributed, and combine them robustly.
    """

    model_config = pydantic.ConfigDict(frozen=True, extra="ignore", strict=True)

    loss: Annotated[float, pydantic.Field(ge=-1e9, le=1e9, allow_inf_nan=False)] | None = None
    rounds_ok: Annotated[int, pydantic.Field(ge=0)] = 0
    rounds_failed: Annotated[int, pydantic.Field(ge=0)] = 0
    bytes_sent: Annotated[int, pydantic.Field(ge=0)] = 0
    bytes_received: Annotated[int, pydantic.Field(ge=0)] = 0
    state_downloads: Annotated[int, pydantic.Field(ge=0)] = 0
    bans: Annotated[int, pydantic.Field(ge=0)] = 0  # peers it bans now (net/accountability.py)


@record_kind
class MemberRecord(RecordBody):
    kind = "member"
    max_ttl = 600.0

    maddrs: Annotated[list[Annotated[str, pydantic.Field(max_length=256)]], pydantic.Field(max_length=16)]
    role: Role
    version: Annotated[str, pydantic.Field(max_length=32)]
    step: Annotated[int, pydantic.Field(ge=0)]
    samples_per_second: Annotated[float, pydantic.Field(ge=0, allow_inf_nan=False)]
    updated_at: Annotated[float, pydantic.Field(allow_inf_nan=False)]
    state: Literal["alive", "left"] = "alive"
    epsilon: Annotated[float, pydantic.Field(ge=0)] | None = None  # privacy spent so far; inf without noise
    progress: Progress | None = None  # training members only
    stats: TrainingStats | None = None  # training members only
    paused: bool = False  # a member that paused (peer.pause(), SIGUSR1): in the run, but in no round
    # a private run's membership ticket (dht/tickets.py, its JSON): readers take the record only with a valid one
    ticket: Annotated[str, pydantic.Field(max_length=MAX_TICKET_BYTES)] | None = None


def reachability(maddrs: list[str]) -> Reachability:
    """How others reach a member, from the addresses it publishes: none (it dials out only), only
    through circuit relays, or directly (as far as it knows: it announces what it listens on)."""
    if not maddrs:
        return "client"
    if all("/p2p-circuit" in maddr for maddr in maddrs):
        return "relayed"
    return "public"


@dataclass(frozen=True)
class Member:
    """One live member of a run, as listed by ``list_members`` and ``swarmgrad status``."""

    peer_id: str
    maddrs: list[str]
    role: str
    version: str
    step: int
    samples_per_second: float
    last_seen: float  # unix time of the member's latest heartbeat
    expires: float
    epsilon: float | None = None  # differential privacy spent so far, when the member releases privately
    progress: Progress | None = None
    stats: TrainingStats | None = None
    paused: bool = False  # do not expect it in rounds until it resumes

    @property
    def reachability(self) -> Reachability:
        return reachability(self.maddrs)

    def to_json(self) -> dict:
        data = asdict(self)
        data["progress"] = self.progress.model_dump() if self.progress is not None else None
        data["stats"] = self.stats.model_dump() if self.stats is not None else None
        data["reachability"] = self.reachability
        if data["epsilon"] is not None and not math.isfinite(data["epsilon"]):
            data["epsilon"] = "inf"  # JSON has no infinity
        return data


async def list_members(node: SwarmNode, run_id: str) -> list[Member]:
    """Live members of ``run_id`` (left and expired ones excluded), sorted by peer id."""
    alive, _ = await _read_listing(node, run_id)
    return alive


# admit(peer_id, ticket) -> whether to take that peer's record (net/admission.py: private runs)
RecordFilter = Callable[[str, "str | None"], bool]


async def _read_listing(node: SwarmNode, run_id: str, admit: RecordFilter | None = None) -> tuple[list[Member], set[str]]:
    """The live members of ``run_id``, sorted by peer id, and the ids of those that said they left;
    records ``admit`` refuses are skipped entirely (their members, progress and leaves)."""
    records = await node.get_records(members_key(run_id), MemberRecord, beam_size=PRESENCE_BEAM)
    if admit is not None:
        records = {owner: record for owner, record in records.items() if admit(owner, record.body.ticket)}
    now = time.time()
    members = [
        Member(
            peer_id=owner,
            maddrs=list(record.body.maddrs),
            role=record.body.role,
            version=record.body.version,
            step=record.body.step,
            samples_per_second=record.body.samples_per_second,
            last_seen=record.body.updated_at,
            expires=record.expires,
            epsilon=record.body.epsilon,
            progress=record.body.progress,
            stats=record.body.stats,
            paused=record.body.paused,
        )
        for owner, record in records.items()
        if record.body.state == "alive" and record.expires > now
    ]
    left = {owner for owner, record in records.items() if record.body.state == "left"}
    return sorted(members, key=lambda member: member.peer_id), left


class Membership:
    """Announces this node as a member of a run until the block exits (then leaves at once).

    ``async with Membership(node, "my-run") as membership: membership.update(step=10)``

    ``refresh``: seconds between heartbeats (default ttl/3, so two may be lost before the record
    expires). ``watch=True`` also rereads the run's members on every beat into ``members``. With
    ``members_per_read``, a run of more members than that beats every refresh x members /
    members_per_read, its record living as much longer (a listing costs O(members) to read and to
    serve, and every beat is a store); an epoch change still publishes at once.
    ``before_publish``: called before each heartbeat, to fill in what it announces. ``admit``: which
    records rereads take (private runs); ``ticket``: this member's own ticket, announced with it.
    """

    def __init__(self, node: SwarmNode, run_id: str, role: Role = "peer", ttl: float = DEFAULT_TTL, *,
                 refresh: float | None = None, watch: bool = False, members_per_read: int | None = None,
                 before_publish: Callable[[Membership], None] | None = None, admit: RecordFilter | None = None,
                 ticket: str | None = None):
        if not 1.0 <= ttl <= MemberRecord.max_ttl:
            raise ConfigError(f"membership ttl must be within 1..{MemberRecord.max_ttl:.0f} s, got {ttl}")
        self.node, self.run_id, self.role, self.ttl = node, check_run_id(run_id), role, ttl
        self.refresh = refresh if refresh is not None else ttl / 3
        if not 0 < self.refresh < ttl:
            raise ConfigError(f"membership refresh must be within (0, ttl={ttl}) s, got {self.refresh}")
        self.key = members_key(run_id)
        self.watch, self.before_publish, self.members_per_read = watch, before_publish, members_per_read
        self.step = 0
        self.samples_per_second = 0.0
        self.epsilon: float | None = None
        self.progress: Progress | None = None
        self.stats: TrainingStats | None = None
        self.paused = False  # announced as is; set by a peer that pauses
        self.admit, self.ticket = admit, ticket
        self.members: list[Member] = []  # with watch=True: the latest listing (this member included)
        self.members_read_at = -math.inf  # time.monotonic() of that listing
        self._arriving = False  # the last reread found a member the one before did not list
        self._reads = 0
        self._work: deque[float] = deque(maxlen=WORK_SAMPLES)  # seconds each recent beat's store and reread took
        self._last_expires = 0.0
        self._heartbeat: asyncio.Task | None = None
        self._publish_now: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def update(
        self, *, step: int | None = None, samples_per_second: float | None = None, epsilon: float | None = None,
        progress: Progress | None = None, stats: TrainingStats | None = None,
    ) -> None:
        """Change what the next heartbeat announces."""
        if step is not None:
            self.step = step
        if samples_per_second is not None:
            self.samples_per_second = samples_per_second
        if epsilon is not None:
            self.epsilon = epsilon
        if progress is not None:
            self.progress = progress
        if stats is not None:
            self.stats = stats

    def publish_soon(self) -> None:
        """Announce now rather than at the next beat (thread-safe): an epoch changed, a round began."""
        if self._loop is not None and self._publish_now is not None:
            self._loop.call_soon_threadsafe(self._publish_now.set)

    async def __aenter__(self) -> Membership:
        self._loop, self._publish_now = asyncio.get_running_loop(), asyncio.Event()
        started = time.monotonic()
        await self.announce()
        if self.watch:
            await self.read()
        self._work.append(time.monotonic() - started)
        self._heartbeat = asyncio.create_task(self._beat(), name=f"membership heartbeat {self.run_id}")
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        await self.leave()

    async def announce(self, state: Literal["alive", "left"] = "alive") -> bool:
        if self.before_publish is not None and state == "alive":
            self.before_publish(self)
        await self.node.refresh_maddrs()  # behind a NAT: the relays it holds a slot on now
        now = time.time()
        # A record replaces the stored one only if it expires later, so a leave outlives the last beat.
        expires = max(now + self.record_lifetime, self._last_expires + 1e-3)
        body = MemberRecord(
            maddrs=self.node.maddrs,
            role=self.role,
            version=__version__,
            step=self.step,
            samples_per_second=float(self.samples_per_second),
            updated_at=now,
            state=state,
            epsilon=self.epsilon,
            progress=self.progress,
            stats=self.stats,
            paused=self.paused,
            ticket=self.ticket,
        )
        # a frequent heartbeat needs latency more than durability: the next one follows soon. A leave
        # has no next one, and the node usually shuts down right after it, which would cut off the
        # replicas still being written in the background: it waits for all of them.
        durable = state == "left" or self.refresh >= 5.0
        stored = await self.node.store(self.key, body, expires, all_replicas=durable, beam_size=PRESENCE_BEAM)
        if stored:
            self._last_expires = expires
        else:
            logger.warning("membership record for run %s was not stored; retrying on the next heartbeat", self.run_id)
        return stored

    async def read(self) -> list[Member]:
        """Reread the listing. A member that one read misses (a record holder that did not answer in
        time, on a loaded swarm) stays listed until its last record expires or it says it left: every
        peer lays out the moshpit grid from this list, and a member dropping out of one peer's view
        for a beat would shift that peer's rank and send it to the wrong group. A member whose record
        ``admit`` now refuses (banned, its ticket expired) leaves the list at once."""
        refused: set[str] = set()

        def admit(owner: str, ticket: str | None) -> bool:
            assert self.admit is not None
            taken = self.admit(owner, ticket)
            if not taken:
                refused.add(owner)
            return taken

        alive, left = await _read_listing(self.node, self.run_id, admit if self.admit is not None else None)
        now = time.time()
        gone = left | refused
        merged = {member.peer_id: member for member in self.members if member.expires > now and member.peer_id not in gone}
        merged.update((member.peer_id, member) for member in alive)
        self._arriving = bool(merged.keys() - {member.peer_id for member in self.members})
        self._reads += 1
        self.members = sorted(merged.values(), key=lambda member: member.peer_id)
        for member in self.members:
            self.node.remember_addresses(member.peer_id, member.maddrs)
        self.members_read_at = time.monotonic()
        return self.members

    @property
    def settled(self) -> bool:
        """The last reread found no member the one before it did not list (and there was one)."""
        return self.members_read_at > -math.inf and not self._arriving

    @property
    def stretch(self) -> float:
        """How much longer than ``refresh`` a beat takes, for the run's size at the last reread; not
        for this member's first ``FIRST_FAST_READS`` rereads, so a joiner lists the swarm at once
        (the swarm lists a joiner at its next beat; not stretching every beat while anyone arrives:
        at a start where 64 peers arrive together, that was everyone rereading every refresh and
        membership took 70 s to converge instead of 9)."""
        if self.members_per_read is None or self._reads < FIRST_FAST_READS:
            return 1.0
        return max(1.0, len(self.members) / self.members_per_read)

    @property
    def beat_interval(self) -> float:
        return self.refresh * self.stretch

    @property
    def record_lifetime(self) -> float:
        """Seconds the next record lives: as many beats as ``ttl`` holds refreshes, each beat as long
        as it really is (the interval plus what the slowest of the last ``WORK_SAMPLES`` beats' store
        and reread took; before any, twice the node's DHT latency). On a swarm whose DHT answers in
        milliseconds that is ``ttl`` x stretch. Measured without it: 64 peers starting on 2 cores
        took 8-10 s for a store and a reread, the records lived 6 s, so each was in the DHT a quarter
        of the time and membership had not converged after 120 s."""
        work = max(self._work) if self._work else 2 * self.node.dht_latency
        return min(MemberRecord.max_ttl, self.ttl / self.refresh * (self.beat_interval + work))

    async def leave(self) -> None:
        if self.node.dht is not None and self._last_expires > 0:
            await self.announce(state="left")

    async def _beat(self) -> None:
        """Announce and reread every beat, and at once when asked (an epoch changed)."""
        assert self._publish_now is not None
        while True:
            try:
                await asyncio.wait_for(self._publish_now.wait(), timeout=self.beat_interval)
            except asyncio.TimeoutError:
                pass
            self._publish_now.clear()
            started = time.monotonic()
            try:
                if self.node.routing_peers == 0:  # every peer it knew through the DHT is gone: join again
                    await self.node.rebootstrap()  # through the members it saw (a no-op knowing none)
                await self.announce()
                if self.watch:
                    await self.read()
                self._work.append(time.monotonic() - started)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # keep beating: the next one may get through
                logger.warning("membership heartbeat failed: %s: %s", type(error).__name__, error)
