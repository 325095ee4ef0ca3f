"""Fakes for matchmaking unit tests (tests/averaging/): a DHT that shows chosen declarations."""

from __future__ import annotations

import time
from types import SimpleNamespace

from swarmgrad.averaging.matchmaking import MatchRecord


class DeclaredNode:
    """A DHT that shows the declarations of ``declared`` under any key, at once."""

    def __init__(self, declared: list[str]):
        self.peer_id, self.dht_latency, self.declared = "me", 0.001, declared

    async def store(self, key, record, *, expires, all_replicas):
        pass

    async def get_records(self, key, kind):
        body = MatchRecord(ready_at=time.time(), share=1.0, schema_digest="schema", codec="none")
        return {peer: SimpleNamespace(body=body) for peer in self.declared}
