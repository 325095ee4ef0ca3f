"""Matchmaking on a loaded DHT: when the window ends with too few declared, a peer reads on for as
long as the DHT now takes to show a declaration (a few of its recent request times), so a short
window does not leave every peer alone. In-process, with a fake node whose reads lag."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from swarmgrad.averaging.matchmaking import GRACE_LATENCIES, Matchmaker, MatchRecord

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

        matchmaker._lead = lead
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
