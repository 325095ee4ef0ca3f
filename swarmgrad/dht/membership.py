"""Run membership: who is in run R right now.

Each peer keeps a signed ``MemberRecord`` in its own slot of the DHT key ``swarmgrad/R/members``,
refreshed on a heartbeat and expiring after ``ttl`` seconds, so a peer that dies silently drops
out within its TTL. A graceful leave overwrites the slot with a ``left`` record, so it is gone from
every listing at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import asdict, dataclass
from typing import Annotated, Literal

import pydantic

from swarmgrad.dht.node import SwarmNode
from swarmgrad.dht.records import RecordBody, record_kind
from swarmgrad.errors import ConfigError
from swarmgrad.version import __version__

logger = logging.getLogger(__name__)

Role = Literal["peer", "bootstrap", "client", "monitor"]
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DEFAULT_TTL = 30.0


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.fullmatch(run_id):
        raise ConfigError(
            f"run id {run_id!r} is invalid: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return run_id


def members_key(run_id: str) -> str:
    return f"swarmgrad/{check_run_id(run_id)}/members"


@record_kind
class MemberRecord(RecordBody):
    kind = "member"
    max_ttl = 600.0

    maddrs: Annotated[list[Annotated[str, pydantic.Field(max_length=256)]], pydantic.Field(max_length=16)]
    role: Role
    version: Annotated[str, pydantic.Field(max_length=32)]
    step: Annotated[int, pydantic.Field(ge=0)]
    samples_per_second: Annotated[float, pydantic.Field(ge=0, allow_inf_nan=False)]
    updated_at: Annotated[float, pydantic.Field(allow_inf_nan=False)]
    state: Literal["alive", "left"] = "alive"
    epsilon: Annotated[float, pydantic.Field(ge=0)] | None = None  # privacy spent so far; inf without noise


@dataclass(frozen=True)
class Member:
    """One live member of a run, as listed by ``list_members`` and ``swarmgrad status``."""

    peer_id: str
    maddrs: list[str]
    role: str
    version: str
    step: int
    samples_per_second: float
    last_seen: float  # unix time of the member's latest heartbeat
    expires: float
    epsilon: float | None = None  # differential privacy spent so far, when the member releases privately

    def to_json(self) -> dict:
        data = asdict(self)
        if data["epsilon"] is not None and not math.isfinite(data["epsilon"]):
            data["epsilon"] = "inf"  # JSON has no infinity
        return data


async def list_members(node: SwarmNode, run_id: str) -> list[Member]:
    """Live members of ``run_id`` (left and expired ones excluded), sorted by peer id."""
    records = await node.get_records(members_key(run_id), MemberRecord)
    members = [
        Member(
            peer_id=owner,
            maddrs=list(record.body.maddrs),
            role=record.body.role,
            version=record.body.version,
            step=record.body.step,
            samples_per_second=record.body.samples_per_second,
            last_seen=record.body.updated_at,
            expires=record.expires,
            epsilon=record.body.epsilon,
        )
        for owner, record in records.items()
        if record.body.state == "alive"
    ]
    return sorted(members, key=lambda member: member.peer_id)


class Membership:
    """Announces this node as a member of a run until the block exits (then leaves at once).

    ``async with Membership(node, "my-run") as membership: membership.update(step=10)``
    """

    def __init__(self, node: SwarmNode, run_id: str, role: Role = "peer", ttl: float = DEFAULT_TTL):
        if not 1.0 <= ttl <= MemberRecord.max_ttl:
            raise ConfigError(f"membership ttl must be within 1..{MemberRecord.max_ttl:.0f} s, got {ttl}")
        self.node, self.run_id, self.role, self.ttl = node, check_run_id(run_id), role, ttl
        self.key = members_key(run_id)
        self.step = 0
        self.samples_per_second = 0.0
        self.epsilon: float | None = None
        self._last_expires = 0.0
        self._heartbeat: asyncio.Task | None = None

    def update(
        self, *, step: int | None = None, samples_per_second: float | None = None, epsilon: float | None = None
    ) -> None:
        """Change what the next heartbeat announces."""
        if step is not None:
            self.step = step
        if samples_per_second is not None:
            self.samples_per_second = samples_per_second
        if epsilon is not None:
            self.epsilon = epsilon

    async def __aenter__(self) -> Membership:
        await self.announce()
        self._heartbeat = asyncio.create_task(self._beat(), name=f"membership heartbeat {self.run_id}")
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        await self.leave()

    async def announce(self, state: Literal["alive", "left"] = "alive") -> bool:
        now = time.time()
        # A record replaces the stored one only if it expires later, so a leave outlives the last beat.
        expires = max(now + self.ttl, self._last_expires + 1e-3)
        body = MemberRecord(
            maddrs=self.node.maddrs,
            role=self.role,
            version=__version__,
            step=self.step,
            samples_per_second=float(self.samples_per_second),
            updated_at=now,
            state=state,
            epsilon=self.epsilon,
        )
        stored = await self.node.store(self.key, body, expires)
        if stored:
            self._last_expires = expires
        else:
            logger.warning("membership record for run %s was not stored; retrying on the next heartbeat", self.run_id)
        return stored

    async def leave(self) -> None:
        if self.node.dht is not None and self._last_expires > 0:
            await self.announce(state="left")

    async def _beat(self) -> None:
        interval = self.ttl / 3  # two beats may be lost before the record expires
        while True:
            await asyncio.sleep(interval)
            try:
                await self.announce()
            except Exception as error:  # keep beating: the next one may get through
                logger.warning("membership heartbeat failed: %s", error)
