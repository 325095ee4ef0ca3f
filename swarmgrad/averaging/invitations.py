"""The invitation exchange of matchmaking (matchmaking.py): a leader invites its group and sends the
plan; a peer that is looking answers the first invitation it gets.

A peer accepts the first invitation for a key it is looking under (so two leaders with different
views never share a member), declines the rest, and a leader declines every invitation. Members that
do not answer within the reply deadline are left out: stragglers are dropped, not waited for
(architecture.md, invariant 'stragglers are dropped'). The leader then sends ``begin`` with the final
plan (members, shares, codec, schema) to those who accepted, or ``cancel`` if fewer than
``min_group_size`` did.

Bans are local (accountability.py), so a group may hold a peer that one member has banned and will
not stream with: the whole round would fail for everyone, round after round, until every member
had banned it. So the invitation names the leader's group, and an accepting member lists the
members it refuses. The leader leaves out a member refused by a strict majority of the others,
then every member that still refuses one who stays (``left_out``). A liar that refuses an honest
peer thus loses only its own seat, and an honest peer that banned a liar before the others sits
rounds out until half of them have.

Under a rule that out-votes a liar only among three rows or more, a pair averages the liar at half
weight: while that many members of its slice are known to be here, a peer leads no group smaller and
declines to join one (``quorum``), and rejects a plan cut below it after an invitation to a larger
group (an honest leader cancels instead).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from dataclasses import dataclass

from swarmgrad.averaging.attendance import Attendance
from swarmgrad.averaging.group_plan import GroupPlan
from swarmgrad.averaging.settings import MAX_GROUP
from swarmgrad.dht.node import SwarmNode
from swarmgrad.eventloop import timeout
from swarmgrad.net.channel import Channel
from swarmgrad.net.transport import Transport
from swarmgrad.net.wire import Frame, FrameError, expect_kind, field

logger = logging.getLogger(__name__)
MAX_PEER_ID = 128  # characters: libp2p's base58 peer ids are 52
# An invitation, its answer and the plan are a stream and a few frames: milliseconds on a live peer.
# On loaded cores every p2pd round trip slows at once, DHT requests too, and a fixed 2 s let every
# invitation of a 16-peer round time out. A reply is waited for as long as this node's slowest recent
# DHT request, never less than reply_timeout nor more than this many times it: a peer that does not
# answer is still dropped, not waited for.
REPLY_STRETCH = 4


@dataclass(frozen=True)
class Terms:
    """What every member of a group must share: the model's schema, the codec and the aggregator."""

    schema_digest: str
    codec: str
    aggregator: str = "mean"


@dataclass
class Looking:
    """A peer's state while it looks for a group under one key."""

    key: str
    share: float
    committed: bool = False  # accepted an invitation, or leading: no more invitations accepted
    plan: asyncio.Future | None = None
    quorum: int = 1  # the fewest members it averages with (``quorum``)


def quorum(aggregator: str, present: int, group_size: int) -> int:
    """The fewest members a group may average with under ``aggregator`` when ``present`` members of
    the slice are known to be here (this peer included): a rule that out-votes a liar only among
    ``outvotes_from`` rows (rules/base.py) is not used in a smaller group while that many are here
    and a group may hold them; else 1. A pair with a liar averages its update at half weight, whatever
    the rule: in the quick attack benchmark one such round (two honest peers catching up, the other
    paired with the x100 attacker) left the honest peers at 16-60% accuracy against 95% clean."""
    from swarmgrad.averaging.rules import get_rule

    least = get_rule(aggregator).outvotes_from
    return least if least is not None and present >= least and group_size >= least else 1


@dataclass
class Invitee:
    """A peer that accepted a leader's invitation: its channel, bandwidth share, and the members of
    the leader's group it refuses (its local bans)."""

    channel: Channel
    share: float
    refuses: set[str]


def peer_ids(header: dict, name: str, most: int) -> set[str]:
    """A frame's optional list of at most ``most`` peer ids (absent: none), as a set."""
    if name not in header:
        return set()
    values = field(header, name, list)
    if len(values) > most or not all(isinstance(value, str) and 0 < len(value) <= MAX_PEER_ID for value in values):
        raise FrameError(f"frame field {name!r} must list at most {most} peer ids")
    return set(values)


def left_out(leader: str, refusals: dict[str, set[str]]) -> set[str]:
    """The members a leader leaves out of its group (the leader and the members that accepted;
    ``refusals``: member -> the members it refuses): each refused by a strict majority of the
    others, then each that refuses a member who stays. The leader itself always stays."""
    members = {leader, *refusals}
    dropped = {peer for peer in members - {leader}
               if 2 * sum(peer in refused for refused in refusals.values()) > len(members) - 1}
    staying = members - dropped
    return dropped | {peer for peer, refused in refusals.items() if peer in staying and refused & staying}


class Invitations:
    """Both sides of the invitation exchange for one averager: ``lead`` as a group's leader, ``answer``
    for the invitations that reach this peer while it looks under a key (``looking``)."""

    def __init__(self, node: SwarmNode, transport: Transport, protocol: str, terms: Terms, attendance: Attendance,
                 reply_timeout: float):
        self.node, self.me, self.transport, self.protocol, self.terms = node, node.peer_id, transport, protocol, terms
        self.attendance = attendance  # a peer that accepts, or leads, is alive
        self.reply_timeout = reply_timeout
        self.looking: dict[str, Looking] = {}

    @property
    def reply_deadline(self) -> float:
        """Seconds to wait for one reply of the exchange (see :data:`REPLY_STRETCH`)."""
        return min(REPLY_STRETCH * self.reply_timeout, max(self.reply_timeout, self.node.dht_latency))

    async def lead(self, key: str, group: list[str], min_group_size: int, share: float) -> GroupPlan | None:
        """Invite ``group`` and send the plan to those who accepted; the plan, or None when fewer
        than ``min_group_size`` stay."""
        me = self.me
        admission = self.transport.admission  # the expected members of a grid may hold a peer banned here
        group = [peer for peer in group if peer == me or admission is None or admission.admits(peer)]
        if len(group) < min_group_size:
            return None  # inviting peers to a group that cannot form only has them decline (or wait)
        invitations = {peer: asyncio.ensure_future(self.invite(peer, key, group)) for peer in group if peer != me}
        if invitations:
            await asyncio.wait(invitations.values())
        accepted: dict[str, Invitee] = {}
        for peer, task in invitations.items():
            if not task.cancelled() and task.exception() is None and task.result() is not None:
                accepted[peer] = task.result()
                self.attendance.seen_alive(peer)
        dropped = left_out(me, {peer: invitee.refuses for peer, invitee in accepted.items()})
        staying = {me, *accepted} - dropped
        for peer in sorted(dropped):
            refused = accepted[peer].refuses & staying
            why = f"it refuses {', '.join(sorted(refused))}" if refused else "most members refuse it"
            logger.info("%s: left %s out of the group (%s)", key, peer, why)
        await asyncio.gather(*(self._finish(accepted.pop(peer).channel, {"t": "cancel"}) for peer in sorted(dropped)))
        members = [me, *sorted(accepted)]
        plan = None
        if len(members) >= min_group_size:
            shares = [share] + [accepted[peer].share for peer in members[1:]]
            if not any(shares):  # all behind NATs: the leader owns every part, the others dial it
                shares[0] = 1.0
            round_id = f"{key}#{me[-8:]}.{secrets.token_hex(4)}"
            terms = self.terms
            plan = GroupPlan(round_id, tuple(members), tuple(shares), terms.codec, terms.schema_digest, terms.aggregator)
        message = {"t": "begin", "plan": plan.to_wire()} if plan else {"t": "cancel"}
        await asyncio.gather(*(self._finish(invitee.channel, message) for invitee in accepted.values()))
        return plan

    async def invite(self, peer: str, key: str, group: list[str]) -> Invitee | None:
        """Invite one peer to ``group``; its open channel, share and refusals if it accepted, None otherwise."""
        channel = None
        try:
            async with timeout(self.reply_deadline):
                channel = await self.transport.open(peer, self.protocol)
                await channel.send({"t": "invite", "key": key, "group": group})
                reply = await channel.recv(max_payload=0)
            if reply.kind == "accept":
                share = field(reply.header, "share", float)
                refuses = peer_ids(reply.header, "refuses", len(group))
                if math.isfinite(share) and 0 <= share <= 1e12 and refuses <= set(group) - {peer}:
                    return Invitee(channel, share, refuses)
            logger.debug("%s declined the invitation for %s: %s", peer, key, reply.header.get("reason"))
        except Exception as error:  # unreachable, slow or misbehaving: simply not in the group
            logger.debug("invitation to %s for %s failed: %s: %s", peer, key, type(error).__name__, error)
        if channel is not None:
            await channel.close()
        return None

    async def _finish(self, channel: Channel, message: dict) -> None:
        try:
            async with timeout(self.reply_deadline):
                await channel.send(message)
        except Exception as error:
            logger.debug("could not send %s to %s: %s", message["t"], channel.peer_id, error)
        finally:
            await channel.close()

    async def answer(self, channel: Channel, invite: Frame) -> None:
        """Answer one leader's invitation, then wait for its decision and hand it to the peer looking."""
        expect_kind(invite, "invite")
        key = field(invite.header, "key", str)
        group = peer_ids(invite.header, "group", MAX_GROUP)
        looking = self.looking.get(key)
        self.attendance.seen_alive(channel.peer_id)  # it leads a group of this averager
        if looking is None or looking.committed or len(group) < looking.quorum:
            reason = "not looking for a group under this key" if looking is None else "already in a group" \
                if looking.committed else f"a group of {len(group)} cannot out-vote a liar here"
            await channel.send({"t": "decline", "reason": reason})
            return
        looking.committed = True
        admission = self.transport.admission
        refuses = sorted(peer for peer in group if admission is not None and not admission.admits(peer))
        await channel.send({"t": "accept", "share": looking.share, "refuses": refuses})
        try:
            # the leader answers once every invitee has replied (each within its reply deadline)
            async with timeout(2 * self.reply_deadline):
                decision = await channel.recv(max_payload=0)
            plan = None
            if decision.kind == "begin":
                plan = GroupPlan.from_wire(decision.header.get("plan"))
                if self.me not in plan.members or plan.members[0] != channel.peer_id:
                    raise FrameError("plan does not list this peer, or is not led by the peer that invited it")
                if (plan.schema_digest, plan.codec, plan.aggregator) != (
                        self.terms.schema_digest, self.terms.codec, self.terms.aggregator):
                    raise FrameError("plan's schema, codec or aggregator differs from this peer's")
                least = max(looking.quorum, quorum(self.terms.aggregator, len(group), len(group)))
                if len(plan.members) < least:  # a leader that keeps to the quorum cancels instead
                    raise FrameError(f"plan of {len(plan.members)} members; its rule needs {least} here")
            elif decision.kind != "cancel":
                raise FrameError(f"expected begin or cancel, got {decision.kind!r}")
        except BaseException:
            if looking.plan is not None and not looking.plan.done():
                looking.plan.set_result(None)
            raise
        if looking.plan is not None and not looking.plan.done():
            looking.plan.set_result(plan)
