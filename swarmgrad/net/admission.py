"""Who may talk to this peer: one object every entry point asks.

Presence listings ask it about each member record (``admit_record``), the transports about each
incoming stream (``admit``, and ``admits`` for each exchange on a pooled direct connection). In a
public run it admits everyone. In a private run (a manifest that names a run key) it admits a peer
once it has seen a valid ticket for that peer's id, signed by the run key, and until the ticket
expires. Local bans (accountability.py) apply in every run: a banned peer is refused and its records
ignored until the ban ends, ticket or not; ``blame`` feeds its score. ``admits`` is the one answer.

A stream may arrive from a ticketed peer whose record this peer has not read yet (it joined a
moment ago). ``admit`` then reads the run's member records once, at most every ``lookup_interval``
seconds whoever asks: a newcomer's first stream is served as soon as its record can be read, and a
peer without a ticket costs at most one listing read per interval, however many streams it opens.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Awaitable, Callable

from swarmgrad.dht.tickets import Ticket
from swarmgrad.errors import ConfigError
from swarmgrad.net.accountability import DEFAULT_ACCOUNTABILITY, Accountability, Misbehaviour

logger = logging.getLogger(__name__)

DEFAULT_LOOKUP_INTERVAL = 2.0  # seconds between listing reads that refused streams may trigger
# how a refused stream's error frame starts: an opener that reads it knows the peer is reachable
NOT_ADMITTED = "not admitted: this is a private run and your peer id has no valid ticket here"
BANNED = "banned here: this peer refuses your streams for a while (misbehaviour)"
REFUSALS = (NOT_ADMITTED, BANNED)  # how every refusal's error frame starts


class Admission:
    """``run_key`` (64 hex digits) makes the run private; None admits everyone. ``lookup``: reads the
    run's member records and hands each to ``admit_record`` (the runtime sets it). ``accountability``:
    when a peer's misbehaviour bans it (``misbehaviour``)."""

    def __init__(self, run_id: str, run_key: str | None = None, *, lookup_interval: float = DEFAULT_LOOKUP_INTERVAL,
                 accountability: Accountability = DEFAULT_ACCOUNTABILITY):
        self.run_id, self.run_key, self.lookup_interval = run_id, run_key, lookup_interval
        self.misbehaviour = Misbehaviour(accountability)
        self.lookup: Callable[[], Awaitable[None]] | None = None
        self._admitted: dict[str, float] = {}  # peer id -> when its ticket expires (inf: never)
        self._last_lookup = -math.inf
        self._lookup_task: asyncio.Task | None = None
        self.refused_records = 0  # member records ignored (each read of each one): no ticket, or banned
        self.refused_streams = 0  # incoming streams and exchanges refused: no ticket, or banned
        self.refused_peers: set[str] = set()  # peer ids either was refused for

    @property
    def private(self) -> bool:
        return self.run_key is not None

    def admit_self(self, peer_id: str) -> None:
        """This peer talks to itself (a loopback round, its own record) whatever its ticket says, and never bans itself."""
        self._admitted[peer_id] = math.inf
        self.misbehaviour.ignore.add(peer_id)

    def blame(self, peer_id: str, kind: str, detail: str = "") -> None:
        """Count a misbehaviour of ``peer_id`` (accountability.py WEIGHTS); past the threshold it is banned."""
        self.misbehaviour.note(peer_id, kind, detail)

    def refusal(self, peer_id: str) -> str:
        """The error frame that tells a refused ``peer_id`` why."""
        return BANNED if self.misbehaviour.banned(peer_id) else NOT_ADMITTED

    def admits(self, peer_id: str) -> bool:
        """Whether ``peer_id`` may talk to this peer now, from what this peer has read so far."""
        if self.misbehaviour.banned(peer_id):
            return False
        if self.run_key is None:
            return True
        return self._admitted.get(peer_id, -math.inf) > time.time()

    def admit_record(self, peer_id: str, ticket: str | None) -> bool:
        """Whether to take ``peer_id``'s member record, which carries ``ticket`` (its JSON, or None)."""
        if self.misbehaviour.banned(peer_id):
            self.refused_records += 1
            self.refused_peers.add(peer_id)
            return False
        if self.run_key is None:
            return True
        if self.admits(peer_id) or self._valid(peer_id, ticket):
            return True
        self.refused_records += 1
        self.refused_peers.add(peer_id)
        return False

    async def admit(self, peer_id: str) -> bool:
        """Whether to serve an incoming stream from ``peer_id``; for a peer not admitted yet, read the
        run's member records first (at most once per ``lookup_interval``). Counts a refusal."""
        if self.admits(peer_id):
            return True
        if not self.misbehaviour.banned(peer_id):  # reading records lifts no ban
            await self._look_up()
        if self.admits(peer_id):
            return True
        self.refused_streams += 1
        self.refused_peers.add(peer_id)
        return False

    def refuse_stream(self, peer_id: str) -> None:
        """Count a stream refused by a transport that asked ``admits`` (no lookup on that path)."""
        self.refused_streams += 1
        self.refused_peers.add(peer_id)

    def _valid(self, peer_id: str, ticket: str | None) -> bool:
        assert self.run_key is not None
        parsed, problem = None, "it has no ticket"
        if ticket is not None:
            try:
                parsed = Ticket.from_json(ticket, source="its ticket")
                problem = parsed.problem(self.run_key, self.run_id, peer_id)
            except ConfigError as error:
                problem = str(error)
        if parsed is None or problem is not None:
            # every reread sees the record again: say why once per peer, not once per beat
            level = logging.DEBUG if peer_id in self.refused_peers else logging.INFO
            logger.log(level, "private run %s: ignoring %s: %s", self.run_id, peer_id, problem)
            return False
        self._admitted[peer_id] = parsed.expires if parsed.expires is not None else math.inf
        return True

    async def _look_up(self) -> None:
        if self.lookup is None:
            return
        if self._lookup_task is None and time.monotonic() - self._last_lookup >= self.lookup_interval:
            self._last_lookup = time.monotonic()
            self._lookup_task = asyncio.ensure_future(self.lookup())
            self._lookup_task.add_done_callback(self._lookup_done)
        if self._lookup_task is not None:  # one read at a time, shared by every stream that waits on it
            await asyncio.gather(asyncio.shield(self._lookup_task), return_exceptions=True)

    def _lookup_done(self, task: asyncio.Task) -> None:
        self._lookup_task = None
        if not task.cancelled() and task.exception() is not None:
            logger.debug("private run %s: member lookup failed: %s", self.run_id, task.exception())
