"""Matchmaking on a loaded DHT: when the window ends with too few declared, a peer reads on for as
long as the DHT now takes to show a declaration (a few of its recent request times), so a short
window does not leave every peer alone. In-process, with a fake node whose reads lag."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from matchmaking_fakes import DeclaredNode, ProbedTransport

from swarmgrad.averaging.invitations import REPLY_STRETCH
from swarmgrad.averaging.matchmaking import GRACE_LATENCIES, Matchmaker, MatchRecord, split_groups

WINDOW = 0.1


class LaggingNode:
    """A DHT whose stores and reads take ``latency``: the other peer's declaration is readable only
    ``visible_after`` seconds after the round began."""

    def __init__(self, latency: float, visible_after: float):
        self.peer_id, self.dht_latency, self.visible_after = "me", latency, visible_after
        self.began = time.monotonic()

    async def store(self, key, record, *, expires, all_replicas):
        await asyncio.sleep(self.dht_latency)

    async def get_records(self, key, kind):
        if time.monotonic() - self.began < self.visible_after:
            return {}
        body = MatchRecord(ready_at=time.time(), share=1.0, schema_digest="schema", codec="none")
        return {"other": SimpleNamespace(body=body)}


def find_group(latency: float, visible_after: float) -> list[str] | None:
    async def scenario():
        matchmaker = Matchmaker(LaggingNode(latency, visible_after), SimpleNamespace(admission=None), "test",
                                schema_digest="schema", codec="none", reply_timeout=0.1)

        async def lead(key, group, min_group_size, share):  # the group this peer would invite, if any
            return group if len(group) >= min_group_size else None

        matchmaker.invitations.lead = lead
        # "other" cannot be dialled: this peer leads whichever group holds both
        return await matchmaker.find_group("round", group_size=2, min_group_size=2, window=WINDOW, share=1.0,
                                           unreachable=frozenset({"other"}))

    return asyncio.run(scenario())


def test_a_slow_dht_stretches_the_wait_past_the_window():
    # stores of 0.2 s: the other's declaration shows at 0.35 s, past window + window (0.2 s)
    assert sorted(find_group(latency=0.2, visible_after=0.35)) == ["me", "other"]


def test_a_quick_dht_keeps_the_window_and_its_grace():
    # quick reads: the grace stays one window, so a declaration later than that is missed
    assert GRACE_LATENCIES * 0.001 < WINDOW
    assert find_group(latency=0.001, visible_after=0.5) is None


class SlowInvitee:
    """A transport to one peer that accepts an invitation ``answer_after`` seconds after it is sent."""

    admission = None

    def __init__(self, answer_after: float):
        self.answer_after = answer_after

    async def open(self, peer, protocol):
        answer_after = self.answer_after

        class Channel:
            peer_id = peer

            async def send(self, message):
                pass

            async def recv(self, max_payload):
                await asyncio.sleep(answer_after)
                return SimpleNamespace(kind="accept", header={"share": 1.0, "refuses": []})

            async def close(self):
                pass

        return Channel()


def invite(dht_latency: float, answer_after: float) -> bool:
    async def scenario():
        node = SimpleNamespace(peer_id="me", dht_latency=dht_latency)
        matchmaker = Matchmaker(node, SlowInvitee(answer_after), "test", schema_digest="schema", codec="none",
                                reply_timeout=0.1)
        return await matchmaker.invitations.invite("other", "round", ["me", "other"]) is not None

    return asyncio.run(scenario())


def test_a_slow_dht_stretches_the_wait_for_an_invitations_answer():
    """On loaded cores an answer takes as long as DHT requests do: a leader whose DHT answers in
    0.3 s waits that long for an accept (0.2 s after the invite), one whose DHT is quick does not."""
    assert invite(dht_latency=0.3, answer_after=0.2)
    assert not invite(dht_latency=0.0, answer_after=0.2)


def test_the_wait_for_an_answer_is_bounded_whatever_the_dht_takes():
    """A DHT slowed by a peer that answers late stretches the wait at most REPLY_STRETCH times."""
    assert not invite(dht_latency=100.0, answer_after=REPLY_STRETCH * 0.1 + 0.2)
    node = SimpleNamespace(peer_id="me", dht_latency=100.0)
    matchmaker = Matchmaker(node, SlowInvitee(0), "test", schema_digest="schema", codec="none", reply_timeout=0.1)
    assert matchmaker.reply_deadline == REPLY_STRETCH * 0.1


def key_ordering(first: str, second: str) -> str:
    """A round key under which split_groups orders ``first``, then ``second``, before the others."""
    return next(key for key in (f"round-{index}" for index in range(1000))
                if split_groups([first, second, "other"], 4, key)[0][:2] == [first, second])


def test_an_expected_leader_that_is_not_looking_hands_the_lead_to_the_next_member():
    """The grid expects ``behind`` (a peer the swarm left behind, replaying a round), and the group's
    order makes it the leader; it never declares, so nobody would invite anyone and every member
    would fail the round. The next member in order leads the ones that are looking instead."""
    key = key_ordering("behind", "me")

    async def scenario():
        matchmaker = Matchmaker(DeclaredNode(["me", "other"]), SimpleNamespace(admission=None), "test",
                                schema_digest="schema", codec="none", reply_timeout=0.1)

        async def lead(key, group, min_group_size, share):
            return group

        matchmaker.invitations.lead = lead
        began = time.monotonic()
        group = await matchmaker.find_group(key, group_size=4, min_group_size=2, window=WINDOW, share=1.0,
                                            expected=3, expected_members=frozenset({"me", "other", "behind"}))
        return group, time.monotonic() - began

    group, seconds = asyncio.run(scenario())
    assert group == ["me", "other"]
    assert seconds < 1.0  # its window, then the window and two replies a follower waits for a plan


def test_an_expected_leader_whose_declaration_shows_late_still_leads():
    """The expected leader's declaration shows only after the window, and its invitation follows:
    the others take its plan, none of them leads a group of its own."""
    key = key_ordering("late", "me")

    async def scenario():
        node = DeclaredNode(["me", "other"])
        # it answers the probe the others send once their window ends without its declaration
        matchmaker = Matchmaker(node, ProbedTransport(alive={"late"}), "test", schema_digest="schema",
                                codec="none", reply_timeout=0.1)
        for member in ("late", "other"):  # members that averaged before: waited for (attendance.py)
            matchmaker.attendance.seen_alive(member)
        led = []

        async def lead(key, group, min_group_size, share):
            led.append(group)
            return group

        async def declare_and_invite_late():
            await asyncio.sleep(1.5 * WINDOW)
            node.declared.append("late")
            looking = matchmaker.invitations.looking[key]  # what answer() does with its invitation
            looking.committed = True
            looking.plan.set_result(["late", "me", "other"])

        matchmaker.invitations.lead = lead
        asyncio.ensure_future(declare_and_invite_late())
        plan = await matchmaker.find_group(key, group_size=4, min_group_size=2, window=WINDOW, share=1.0,
                                           expected=3, expected_members=frozenset({"me", "other", "late"}))
        return plan, led

    plan, led = asyncio.run(scenario())
    assert plan == ["late", "me", "other"] and led == []
