"""Fakes for matchmaking unit tests (tests/averaging/): a DHT that shows chosen declarations, a transport
on which chosen peers answer probes."""

from __future__ import annotations

import time
from types import SimpleNamespace

from swarmgrad.averaging.matchmaking import MatchRecord
from swarmgrad.net.wire import Frame


class DeclaredNode:
    """A DHT that shows the declarations of ``declared`` under any key, at once."""

    def __init__(self, declared: list[str]):
        self.peer_id, self.dht_latency, self.declared = "me", 0.001, declared

    async def store(self, key, record, *, expires, all_replicas):
        pass

    async def get_records(self, key, kind):
        body = MatchRecord(ready_at=time.time(), share=1.0, schema_digest="schema", codec="none")
        return {peer: SimpleNamespace(body=body) for peer in self.declared}


class ProbedTransport:
    """A transport on which the peers in ``alive`` answer probes (matchmaking's control protocol), as
    looking under the key asked about unless listed in ``not_looking``; no other stream opens.
    ``opened`` lists whom it was asked to reach, and when."""

    admission = None

    def __init__(self, alive: set[str] = frozenset(), not_looking: set[str] = frozenset()):
        self.alive, self.not_looking, self.opened, self.began = set(alive), set(not_looking), [], time.monotonic()

    async def open(self, peer: str, protocol: str):
        self.opened.append((peer, time.monotonic() - self.began))
        if peer not in self.alive:
            raise ConnectionError(f"{peer} is gone")
        return _ProbedChannel(peer not in self.not_looking)


class _ProbedChannel:
    def __init__(self, looking: bool):
        self.looking, self.asked = looking, {}

    async def send(self, header: dict) -> None:
        assert header["t"] == "probe", header
        self.asked = header

    async def recv(self, max_payload: int = 0) -> Frame:
        return Frame({"t": "alive", **({"looking": self.looking} if "key" in self.asked else {})})

    async def close(self) -> None:
        pass
