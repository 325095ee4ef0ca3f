"""Reads a run's records from the DHT on a fixed schedule into a RunState, counting what it costs.

Two loops: presence records every ``members_every`` s and evaluation records every
``evaluations_every`` s. A read that fails or times out is counted and the next one comes on
schedule; the state keeps what it had (a row leaves only by its own signed expiry or a leave
record), so a slow DHT makes the page stale, never empty, and nothing a record holds can stop a loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from swarmgrad.dashboard.state import RunState
from swarmgrad.dht.evaluations import read_evaluations
from swarmgrad.dht.membership import MemberRecord, members_key
from swarmgrad.dht.node import SwarmNode

logger = logging.getLogger(__name__)


class Collector:
    """``async with Collector(node, state):`` keeps ``state`` fed until the block exits."""

    def __init__(self, node: SwarmNode, state: RunState):
        self.node, self.state, self.settings = node, state, state.settings
        self.reads = {"members": 0, "evaluations": 0}  # DHT gets made, by record kind
        self.failed_reads = 0
        self.read_seconds = 0.0  # time spent in those gets
        self.started = time.monotonic()
        self._tasks: list[asyncio.Task] = []

    @property
    def reads_per_second(self) -> float:
        return sum(self.reads.values()) / max(1e-9, time.monotonic() - self.started)

    async def __aenter__(self) -> Collector:
        self.started = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._every(self.settings.members_every, "members", self.read_members),
                                name="dashboard members"),
            asyncio.create_task(self._every(self.settings.evaluations_every, "evaluations", self.read_evaluations),
                                name="dashboard evaluations"),
        ]
        return self

    async def __aexit__(self, *exc_info) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def read_members(self) -> None:
        records = await self.node.get_records(members_key(self.state.run_id), MemberRecord)
        self.state.update_members(records, time.time())

    async def read_evaluations(self) -> None:
        records = await read_evaluations(self.node, self.state.run_id)
        self.state.update_evaluations(records, time.time())

    async def _every(self, seconds: float, kind: str, read: Callable[[], Awaitable[None]]) -> None:
        """``read()`` every ``seconds`` on a fixed schedule (a slow read delays the next, never piles them up)."""
        next_at = time.monotonic()
        while True:
            started = time.monotonic()
            self.reads[kind] += 1
            try:
                await read()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a dead daemon, a DHT error, a record we mishandle: try again on schedule
                self.failed_reads += 1
                logger.warning("dashboard: reading %s failed: %s: %s", kind, type(error).__name__, error)
            self.read_seconds += time.monotonic() - started
            next_at = max(next_at + seconds, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())
