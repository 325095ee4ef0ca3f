"""A node that reads a new key every round keeps nothing per key it read (issue 38's soak: each peer's
memory grew ~30 MB an hour, one hivemind ``pending_get_requests`` entry per round key, an empty
SortedSet and its bound methods, never dropped). Real nodes on loopback."""

from __future__ import annotations

import gc
import time
from contextlib import AsyncExitStack

from conftest import run_async

from swarmgrad.averaging.matchmaking import MatchRecord
from swarmgrad.dht import NodeConfig, SwarmNode

READS = 40


def test_reads_of_many_keys_leave_no_entry_behind():
    async def scenario() -> tuple[int, int, int]:
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(SwarmNode(NodeConfig()))
            second = await stack.enter_async_context(SwarmNode(NodeConfig(initial_peers=first.maddrs)))
            for index in range(READS):  # what matchmaking does: a new key a round, some holding a record
                key = f"leak-test/r{index}"
                if index % 4 == 0:
                    await first.store(key, MatchRecord(ready_at=0.0, share=1.0, schema_digest="s", codec="none"),
                                      expires=time.time() + 60)
                await second.get_records(key, MatchRecord)
            gc.collect()
            return len(second.dht.pending_get_requests), len(first.dht.pending_get_requests), READS

    reader, writer, reads = run_async(scenario())
    assert reader == 0 and writer == 0, f"{reader} of {reads} keys read are still held"
