"""Matchmaking: turning "peers looking under the same DHT key" into one agreed group.

1. Each peer *declares* itself under the round's key (a signed ``MatchRecord``) and waits one
   matchmaking window, listening for invitations; it stops waiting early once a full group
   (``group_size`` peers) has declared.
2. Then it reads the key. The live declarations with the same schema, codec and aggregator
   are ordered by a per-key hash and cut into balanced groups of at most ``group_size``; the first
   peer of each group is its *leader*.
3. A leader invites its group over the control protocol, and sends the final plan to those who
   accepted (invitations.py: who accepts, who is left out, and why). Everyone then runs the
   all-reduce on exactly the same plan.

Of the members the caller expects (the moshpit grid's slice), matchmaking waits only for those seen
alive (attendance.py): a listed member that never declares costs at most one window, and one whose
record stands behind no live peer (it never answers a probe) costs none; an expected leader that
did not declare is probed as the window ends, and the next member leads once the probe fails (a
crashed leader costs one window, not the window and a plan's wait). A member whose record
carries a pace is waited for at most a cap from this peer's own round period, and not at all when
its pace says it cannot come within it (stragglers.py).

A peer whose attempt failed and that retries under a later key says so on its declaration (``leave``:
done, and the attempt it went on to). A peer that comes late to the failed key, and finds everyone
who declared there gone to a retry, follows them at once (``Retried``) instead of waiting its window
out alone: attempts are counted per peer, and a joiner that finished replaying a round 1-3 s late
looked under the first attempt's key while the others waited for it under the second's and third's,
and every attempt failed (benchmarks/big_model.py, 200M, lab: "the quorum trap").
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Callable, Mapping

import pydantic

from swarmgrad.averaging.attendance import Attendance
from swarmgrad.averaging.group_plan import GroupPlan
from swarmgrad.averaging.invitations import Invitations, Looking, Terms, quorum
from swarmgrad.averaging.stragglers import CAP_LATENCIES, Pace, Patience, RoundClock, half_declared, straggler_cap
from swarmgrad.dht.node import SwarmNode
from swarmgrad.dht.records import RecordBody, record_kind
from swarmgrad.eventloop import timeout
from swarmgrad.net.channel import Channel
from swarmgrad.net.transport import Transport
from swarmgrad.net.wire import expect_kind
from swarmgrad.timing import DEFAULT_TIMING

logger = logging.getLogger(__name__)
# Reading a round's declarations: soon after declaring (a full group is often there at once), then
# at doubling intervals up to window / 8, so a peer reads about a dozen times per round whatever
# the swarm's size (a fixed 10 ms poll was 200 DHT reads per peer in a 2 s window).
FIRST_POLL, POLLS_PER_WINDOW = 0.01, 8
# Too few declared when the window ends: read on for the window again, or for this many of the DHT's
# recent request times if longer. A store and the read that sees it each take one; a short window
# on a loaded machine (0.2 s against stores of 0.5 s) otherwise ends with every peer alone.
GRACE_LATENCIES = 3
# How often a peer that is looking asks whether the swarm finished the round without it: a local
# read of the presence records it already holds, which change once a presence refresh.
MOVED_ON_POLL = 0.1
MAX_RETRY = 64  # the latest attempt a declaration may send a late peer to (the driver makes 3)
KEPT_DECLARATIONS = 64  # keys whose declaration's expiry is kept, for ``leave`` (bounded: one a round)


@record_kind
class MatchRecord(RecordBody):
    kind = "match"
    max_ttl = 600.0

    ready_at: Annotated[float, pydantic.Field(allow_inf_nan=False)]
    share: Annotated[float, pydantic.Field(ge=0, le=1e12, allow_inf_nan=False)]
    schema_digest: Annotated[str, pydantic.Field(max_length=64)]
    codec: Annotated[str, pydantic.Field(max_length=32)]
    done: bool = False  # its owner left the key (``Matchmaker.leave``)
    aggregator: Annotated[str, pydantic.Field(max_length=32)] = "mean"  # absent: a peer that only averages
    retry: Annotated[int, pydantic.Field(ge=0, le=MAX_RETRY)] = 0  # done: the attempt it went on to (0: none)


@dataclass(frozen=True)
class Retried:
    """``find_group``'s answer when every other peer that declared under the key left it for a retry:
    the latest ``attempt`` they went on to (the caller looks there, at once)."""

    attempt: int


def split_groups(peer_ids: list[str], group_size: int, key: str) -> list[list[str]]:
    """Peers cut into ceil(n / group_size) groups whose sizes differ by at most one.

    The order is a hash of (key, peer id): the same on every peer that sees the same declarations,
    and different every round, so crowded keys still mix instead of repeating one partition.
    """
    ordered = sorted(peer_ids, key=lambda peer: hashlib.sha256(f"{key}/{peer}".encode()).digest())
    count = max(1, math.ceil(len(ordered) / group_size))
    base, extra = divmod(len(ordered), count)
    groups, start = [], 0
    for index in range(count):
        size = base + (1 if index < extra else 0)
        groups.append(ordered[start : start + size])
        start += size
    return groups


def leader_of(group: list[str], unreachable: frozenset[str], clients: frozenset[str] = frozenset()) -> str:
    """The group's first member that others can dial; else (all behind NATs) its first one with a
    relayed address; else its first member."""
    return next((peer for peer in group if peer not in unreachable),
                next((peer for peer in group if peer not in clients), group[0]))


class Matchmaker:
    """Finds this peer's group for a key; serves other leaders' invitations."""

    def __init__(self, node: SwarmNode, transport: Transport, protocol: str, *, schema_digest: str, codec: str,
                 aggregator: str = "mean", reply_timeout: float = DEFAULT_TIMING.reply_timeout):
        self.node, self.transport, self.protocol = node, transport, protocol
        self.terms = Terms(schema_digest, codec, aggregator)  # what a group's members share
        self.attendance = Attendance()
        self.invitations = Invitations(node, transport, protocol, self.terms, self.attendance, reply_timeout)
        self.rounds = RoundClock()  # this peer's round period, which caps the wait for stragglers
        self._background: set[asyncio.Task] = set()  # probes, and stores that say this peer left a key
        # key -> when this peer's declaration there expires, and how long an attempt's declaration lives
        self._expires: OrderedDict[str, tuple[float, float]] = OrderedDict()
        # whether this peer comes to rounds now: not while it takes the swarm's state (the peer sets it;
        # probes answered "alive" then had every member wait for one that could not come: issue 38)
        self.available: Callable[[], bool] = lambda: True

    @property
    def reply_deadline(self) -> float:
        """Seconds to wait for one reply of the matchmaking exchange (invitations.py ``REPLY_STRETCH``)."""
        return self.invitations.reply_deadline

    async def find_group(
        self, key: str, *, group_size: int, min_group_size: int, window: float, share: float,
        expected: int | None = None, expected_members: frozenset[str] | None = None,
        unreachable: frozenset[str] = frozenset(), clients: frozenset[str] = frozenset(),
        paces: Mapping[str, Pace] | None = None, moved_on: Callable[[], bool] | None = None,
    ) -> GroupPlan | Retried | None:
        """The agreed plan for this round, or None when no group of at least min_group_size formed, or
        ``Retried`` when all the others that declared under ``key`` left it for a retry (``leave``).

        ``expected``: how many peers the caller knows will look under this key (e.g. from swarm
        progress); ``expected_members``: which ones (e.g. from the moshpit grid). Once that many, or
        exactly those, have declared there is no need to wait out the window: a view that lists a
        peer that is not there, or misses one that declared, waits the window out as before. The
        expected members are grouped as if declared, so a read that missed one splits no group.
        ``unreachable``: the members others cannot dial, ``clients`` those nobody can reach at all;
        a group's leader is its first member others can dial (it must reach everyone to invite
        them), else its first one reachable through a relay, which then owns every part.
        Of ``expected_members`` only those seen alive are waited for and grouped as if declared
        (attendance.py); the others are probed meanwhile, and take part when they declare.
        ``paces``: what members' presence records claim about their pace; once this peer measured its
        round period, an undeclared member with one is waited for at most ``straggler_cap``, and not at
        all when its pace says it cannot come by then (stragglers.py).
        ``moved_on``: whether the swarm finished this round without this peer (the caller's view of
        the others' progress); once it says so, and no group has taken this peer yet, looking stops
        (None is returned): the round is replayed, not waited out (issue 38: a late peer waited about
        6 s, window, grace and a plan's wait, for a group nobody else was looking for any more)."""
        me = self.node.peer_id
        latency = self.node.dht_latency
        paces = paces or {}
        own = paces.get(me)  # this peer's own record: its seconds a step floor the cap
        step = 1.0 / own.steps_per_second if own is not None and own.steps_per_second > 0 else None
        patience = Patience(straggler_cap(self.rounds.period, window, latency, step), paces,
                            shown_after=CAP_LATENCIES * latency)
        self.rounds.started()
        waited = None
        if expected_members is not None:
            # nobody can dial a client to probe it: it is waited for until it misses a window
            for peer in self.attendance.to_probe(expected_members - clients, me):
                self._start_probe(peer)
            listed, attendance = expected_members, self.attendance

            def alive() -> frozenset[str]:
                return attendance.waited_for(listed, me) | ((listed & clients) - set(attendance.suspects()))

            def waiting(declared: set[str]) -> frozenset[str]:
                """The alive members, less the stragglers not (or no longer) waited for."""
                members = alive()
                capped = half_declared(members, declared)
                return frozenset(peer for peer in members
                                 if peer == me or peer in declared or not capped or patience.waits_for(peer))

            def waited(declared: set[str]) -> frozenset[str] | None:
                """Who to wait for, or None while a probe of a listed member is still in flight."""
                return None if attendance.probing(listed) else waiting(declared)
        aggregator = self.terms.aggregator
        present = len(alive()) if expected_members is not None else 0  # members known to be here
        looking = Looking(key, share, plan=asyncio.get_running_loop().create_future(),
                          quorum=quorum(aggregator, present, group_size))
        self.invitations.looking[key] = looking
        watch = asyncio.ensure_future(self._stop_when(moved_on, looking)) if moved_on is not None else None
        began, seen = time.monotonic(), {}  # seen: when the read that settled the group came, how many it saw
        gone: asyncio.Future[bool] | None = None  # whether the expected leader is not there to lead (``_gone``)
        ready_at = time.time() + window
        grace = max(window, GRACE_LATENCIES * self.node.dht_latency)
        try:
            terms = self.terms
            record = MatchRecord(ready_at=ready_at, share=share, schema_digest=terms.schema_digest, codec=terms.codec,
                                 aggregator=terms.aggregator)
            expires = ready_at + window + grace + self.reply_deadline
            self._expires[key] = (expires, expires - time.time())
            while len(self._expires) > KEPT_DECLARATIONS:
                self._expires.popitem(last=False)
            # read while our own declaration is still being stored: others are declaring at the same moment
            declaring = asyncio.ensure_future(self.node.store(key, record, expires=expires, all_replicas=False))
            try:
                # under a quorum, fewer declared than it asks for end no wait early: a count of the
                # peers at this epoch lags the records by a beat, and where it said 2 of 3 the pair
                # that formed was declined by the third's groupmate (big_model.py: a failed attempt
                # in every other round of three peers, each a replay or a step alone)
                least = max(min_group_size, looking.quorum)
                enough = max(least, group_size if expected is None else min(group_size, expected))
                peers, retried = await self._wait_for_peers(
                    key, looking, ready_at, enough, expected_members, least, grace=grace,
                    poll=min(FIRST_POLL, window / 4), waited=waited,
                )
                seen.update(at=time.monotonic() - began, peers=len(peers))
            finally:
                await declaring
                seen["stored"] = time.monotonic() - began
            if retried:
                logger.debug("%s: everyone else went on to attempt %d; following them", key, retried)
                return Retried(retried)
            declared = set(peers)
            if waited is not None:
                waiting_for, was_alive = waiting(declared), alive()
                for peer in declared - {me}:
                    self.attendance.seen_alive(peer)
                gave_up = patience.gave_up_on(was_alive - declared - {me}) if half_declared(was_alive, declared) \
                    else set()
                if logger.isEnabledFor(logging.DEBUG) and was_alive - declared:
                    logger.debug("%s: declared %s; alive and not declared %s, of them waited for %s (cap %s s, "
                                 "paces %s)", key, sorted(declared), sorted(was_alive - declared),
                                 sorted(waiting_for - declared), patience.cap,
                                 {peer: paces[peer] for peer in was_alive - declared if peer in paces})
                if not looking.committed:
                    # waited the window (or a straggler's cap) out: who did not come is not waited for again
                    missing = gave_up | (waiting_for - declared if time.time() >= ready_at else set())
                    if missing:
                        logger.debug("%s: %s never declared; not waited for until seen alive", key, sorted(missing))
                        self.attendance.missed(missing)
                # the caller knows who belongs here (the moshpit grid): every member then computes the
                # same group and leader even when a read missed a declaration (a holder that did not
                # answer in time); an expected peer that is not looking declines and is left out
                peers = sorted(declared | waiting_for)
            looking.quorum = max(looking.quorum, quorum(aggregator, len(peers), group_size))
            least = max(min_group_size, looking.quorum)
            group = self._my_group(key, peers, group_size) if not looking.committed else []
            if group and leader_of(group, unreachable, clients) == me:
                looking.committed = True
                return await self.invitations.lead(key, group, least, share)
            # a follower: the leader we accepted (or will accept) sends the plan
            leader = leader_of(group, unreachable, clients) if group else None
            if leader is not None:
                # a leader that never declared is asked at once whether it is there; one that did, only
                # if its plan is late: it may have left the key (failed, or gone on to a retry)
                gone = asyncio.ensure_future(self._gone(leader, key, after=0.0 if leader not in declared
                                                        else self.reply_deadline))
            plan = await self._plan(looking, window, unless=gone)
            if plan is not None or looking.committed or not group:
                return plan
            # No invitation came. An expected leader that never declared (a peer that crashed since the
            # last round, one the swarm left behind replaying a round, one taking the state), or one
            # that left the key, invites nobody here, and every member would fail the round: the next
            # member in order that declared leads those still looking. Not once a read misses the
            # leader (a leader whose declaration was slow to show still invites in time), but once its
            # plan's wait is over or a probe says it is not there to send one (``_gone``): waiting out
            # the plan's wait for a crashed leader cost the soak's swarm 6 s a kill (issue 38).
            left = gone is not None and gone.done() and not gone.cancelled() and gone.result()
            if leader in declared and not left:
                return None  # it was looking: its group went on without this peer
            rest = [peer for peer in group if peer != leader and peer in declared]
            if len(rest) < least:
                # too few for a group (a quorum counted the missing leader): the next member would
                # invite nobody, and the others would wait a plan's wait for it, then retry that much
                # later than it did and miss it under the next key (test_late_attempt.py)
                logger.debug("%s: expected leader %s never declared or left; too few remain", key, leader)
                return None
            logger.debug("%s: expected leader %s never declared or left; the next member leads", key, leader)
            if rest and leader_of(rest, unreachable, clients) == me:
                looking.committed = True
                return await self.invitations.lead(key, rest, least, share)
            return await self._plan(looking, window)
        finally:
            # where a round's matchmaking time goes (a DHT store, the reads, the invitations), for -vv
            logger.debug("%s: %s peers seen after %.2f s, declaration stored after %.2f s, done after %.2f s",
                         key, seen.get("peers", "no"), seen.get("at", math.nan), seen.get("stored", math.nan),
                         time.monotonic() - began)
            self.invitations.looking.pop(key, None)
            for task in (watch, gone):
                if task is not None:
                    task.cancel()
            if not looking.plan.done():
                looking.plan.cancel()

    @staticmethod
    async def _stop_when(moved_on: Callable[[], bool], looking: Looking) -> None:
        """Stop looking once ``moved_on()`` says so, unless a group took this peer first: from then on
        no invitation is accepted, and the waits for declarations and for a plan end with none."""
        while not looking.committed:
            if moved_on():
                looking.committed = True
                if not looking.plan.done():
                    looking.plan.set_result(None)
                return
            await asyncio.sleep(MOVED_ON_POLL)

    async def _wait_for_peers(
        self, key: str, looking: Looking, ready_at: float, enough: int, expected: frozenset[str] | None,
        min_group_size: int, grace: float, poll: float,
        waited: Callable[[set[str]], frozenset[str] | None] | None = None,
    ) -> tuple[list[str], int]:
        """Peers declared under ``key``, read until the window ends or ``enough`` of them, or exactly
        the ``expected`` ones, or all those of them ``waited()`` names (at least a group's worth)
        and none outside them, are there (no need to wait out the window then), or until an
        invitation commits us. If too few for a group have shown up when the window ends, read on for
        up to ``grace`` more: on a loaded machine a declaration can take longer than the window to
        become readable. Second: the attempt the others went on to, once this peer is alone under the
        key and some of them left it for a retry (0 otherwise: the peers are what counts)."""
        while True:
            peers, retried = await self._declared(key)
            now = time.time()
            declared = set(peers)
            if retried and not looking.committed and len(peers) == 1:
                looking.committed = True  # no invitation under this key is accepted from now on
                return peers, retried
            if looking.committed or len(peers) >= enough or expected == declared:
                return peers, 0
            if expected is not None and waited is not None:
                alive = waited(declared)
                if alive is not None and len(alive) >= min_group_size and alive <= declared <= expected:
                    return peers, 0
            if now >= ready_at and (len(peers) >= min_group_size or now >= ready_at + grace):
                return peers, 0
            try:
                await asyncio.wait_for(asyncio.shield(looking.plan), timeout=poll)
            except asyncio.TimeoutError:
                pass
            poll = min(2 * poll, max(FIRST_POLL, grace / POLLS_PER_WINDOW))

    def _start_probe(self, peer: str) -> None:
        self._in_background(self.probe(peer))

    def _in_background(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def probe(self, peer: str, key: str | None = None) -> bool:
        """Whether ``peer`` answers on this matchmaking protocol now (a record alone cannot); told to
        the attendance either way. With ``key``: and whether it is looking under that key."""
        channel = None
        try:
            async with timeout(self.reply_deadline):
                channel = await self.transport.open(peer, self.protocol)
                await channel.send({"t": "probe"} if key is None else {"t": "probe", "key": key})
                answer = expect_kind(await channel.recv(max_payload=0), "alive")
            self.attendance.answered(peer)
            return answer.header.get("looking", True) is not False
        except asyncio.CancelledError:
            self.attendance.probe_failed(peer)  # no longer in flight
            raise
        except Exception as error:  # not there, or not a peer of this averager: not waited for
            logger.debug("probe of %s failed: %s: %s", peer, type(error).__name__, error)
            self.attendance.probe_failed(peer)
            return False
        finally:
            if channel is not None:
                await channel.close()

    async def close(self) -> None:
        """Stop the probes and stores in flight."""
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(list(self._background))

    async def _plan(self, looking: Looking, window: float,
                    unless: asyncio.Future[bool] | None = None) -> GroupPlan | None:
        """The plan a leader sends (None: a cancel, or none within the window and two replies, or
        ``unless`` came back True before an invitation committed this peer). An invitation accepted
        as that wait ends is waited for too (``serve`` bounds its decision): leaving then, the leader
        would start a round with a member that never comes, and its group would wait out the
        all-reduce's deadline (soak: a next-in-order leader invited followers just as they gave up
        waiting for the expected one's plan; 5 s lost each time)."""
        loop = asyncio.get_running_loop()
        for wait in (window + 2 * self.reply_deadline, 2 * self.reply_deadline):
            ends = loop.time() + wait
            while not looking.plan.done() and loop.time() < ends:
                stop = unless if unless is not None and not unless.done() else None
                await asyncio.wait({looking.plan} if stop is None else {looking.plan, stop},
                                   timeout=ends - loop.time(), return_when=asyncio.FIRST_COMPLETED)
                if stop is not None and stop.done() and not stop.cancelled() and stop.result() \
                        and not looking.committed:
                    return None
            if looking.plan.done():
                return None if looking.plan.cancelled() else looking.plan.result()
            if not looking.committed:
                return None
        return None

    async def _gone(self, leader: str, key: str, after: float) -> bool:
        """After ``after`` seconds, whether ``leader`` is not there to lead the group under ``key``: a
        probe of it fails, it answers that it is taking the swarm's state (``available``), or that it
        is not looking under ``key`` (it failed the round, or went on to a retry)."""
        await asyncio.sleep(after)
        return not await self.probe(leader, key)

    def leave(self, key: str, retry: int) -> None:
        """Say on this peer's declaration under ``key`` that it left the key for attempt ``retry`` (a
        peer that comes late follows it there), in the background: the retry does not wait for it.
        Replaces the declaration: its expiry is later."""
        kept = self._expires.pop(key, None)
        if kept is None:
            return  # never declared here (or long ago): nobody waits under it for this peer
        declared, lives = kept
        terms = self.terms
        record = MatchRecord(ready_at=time.time(), share=0.0, schema_digest=terms.schema_digest, codec=terms.codec,
                             aggregator=terms.aggregator, done=True, retry=retry)
        expires = max(declared + 0.001, time.time() + lives)  # the DHT keeps the record that expires last

        async def store() -> None:
            try:
                await self.node.store(key, record, expires=expires, all_replicas=False)
            except Exception as error:  # a late peer then waits its window out, as before
                logger.debug("could not say that this peer left %s: %s: %s", key, type(error).__name__, error)

        self._in_background(store())

    async def _declared(self, key: str) -> tuple[list[str], int]:
        """The peers looking under ``key`` (this one included), and the latest attempt that those who
        left it went on to (0: none did)."""
        records = await self.node.get_records(key, MatchRecord)
        admission, terms = self.transport.admission, self.terms  # outsiders and banned peers declare in vain:
        peers, retried, me = [], 0, self.node.peer_id  # grouped with one, this peer would hand it its contribution
        ours = (terms.schema_digest, terms.codec, terms.aggregator)
        for owner, record in records.items():
            body = record.body
            if (admission is not None and not admission.admits(owner)) or (
                    body.schema_digest, body.codec, body.aggregator) != ours:
                continue
            if not body.done:
                peers.append(owner)
            elif owner != me:
                retried = max(retried, body.retry)
        if me not in peers:  # our own declaration may not be readable yet
            peers.append(me)
        return peers, retried

    def _my_group(self, key: str, peers: list[str], group_size: int) -> list[str]:
        for group in split_groups(peers, group_size, key):
            if self.node.peer_id in group:
                return group
        return []

    async def serve(self, channel: Channel) -> None:
        """Control-protocol handler: answer a probe, or one leader's invitation (invitations.py)."""
        async with timeout(self.reply_deadline):
            request = await channel.recv(max_payload=0)
        if request.kind == "probe":  # another member checks this peer is alive (attendance.py)
            if not self.available():
                await channel.send({"t": "busy"})  # a failed probe there
                return
            key = request.header.get("key")  # a follower asks whether its expected leader is still here
            looking = {"looking": key in self.invitations.looking} if isinstance(key, str) else {}
            await channel.send({"t": "alive", **looking})
            return
        await self.invitations.answer(channel, request)
