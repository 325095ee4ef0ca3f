"""Groupmates count at the epoch a shared round took them to until their records say more
(``ProgressTracker.met``): records are a heartbeat old, and with rounds of a second or less a peer
just out of a round with two others read them 2 epochs behind, saw itself alone and ahead of the
swarm, took its state instead of averaging the next round, and fell out of step with them (the quick
attack benchmark: two honest peers doing so left the third to pair with the attacker)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from swarmgrad.dht.membership import Member, Progress
from swarmgrad.peer.progress import ProgressTracker


class Presence:
    """The part of a Membership the tracker reads: this node, the members' records, the heartbeat."""

    def __init__(self):
        self.node = SimpleNamespace(peer_id="me")
        self.members: list[Member] = []
        self.beat_interval = 1.0
        self.before_publish = None

    def publish_soon(self) -> None:
        pass

    def record(self, peer: str, epoch: int, published: float) -> None:
        self.members = [m for m in self.members if m.peer_id != peer] + [Member(
            peer, [], "trainer", "test", 0, 10.0, last_seen=published, expires=published + 60,
            progress=Progress(epoch=epoch, samples=0, steps=0, steps_per_second=1.0))]


def test_groupmates_count_at_the_epoch_a_shared_round_took_them_to_until_their_records_are_newer():
    presence = Presence()
    now = time.time()
    for peer in ("a", "b"):
        presence.record(peer, epoch=5, published=now - 0.5)  # a heartbeat old: two rounds ago
    tracker = ProgressTracker(presence)
    tracker.next_epoch(7)
    # by the records alone this peer is alone at 7 and ahead of the swarm: it would take the state
    assert tracker.others_at(7) == [] and sorted(tracker.rejoin_from(7)) == ["a", "b"]

    tracker.met(7, ["me", "a", "b"])  # round 6 with both: they are at 7 too
    assert sorted(tracker.others_at(7)) == ["a", "b"] and tracker.rejoin_from(7) == []
    assert tracker.fresh().epoch == 7 and tracker.ahead_of(7) == []

    # a record newer than the round is believed again, even one that says less (b restarted)
    presence.record("b", epoch=0, published=time.time() + 1)
    assert tracker.others_at(7) == ["a"] and [p.epoch for p in tracker.fresh().peers if p.peer_id == "b"] == [0]
