"""Every deadline a peer keeps, derived from one ``Timing`` object instead of literals spread around.

What sets the pace is the presence refresh (how often a peer republishes its presence record and
rereads everyone's, in a swarm of up to ``members_per_read`` members) and the measured round times (``RoundTimer``); the rest are small fixed budgets
for exchanges that take milliseconds on a live peer, collected here so they are tuned in one place.
"""

from __future__ import annotations

from typing import Annotated

import pydantic

from swarmgrad.settings import SettingsModel

Seconds = Annotated[float, pydantic.Field(gt=0, le=3600, allow_inf_nan=False)]


class Timing(SettingsModel):
    """A peer's local timing: not a run-level setting (peers of one run may differ)."""

    presence_refresh: Annotated[float, pydantic.Field(ge=0.1, le=60)] = pydantic.Field(
        1.0, description="Seconds between republishing this peer's presence and rereading everyone's.")
    # A listing of the run costs its reader and the record's holders O(members), and every heartbeat
    # is a DHT store: beyond this many members a peer beats less often (``beat_interval``), so the
    # swarm's presence traffic grows as O(N), not O(N^2). Measured: 64 peers beating every second
    # saturated 2 cores and moshpit rounds took 16 s (benchmarks/scale.py).
    members_per_read: Annotated[int, pydantic.Field(ge=1, le=100_000)] = pydantic.Field(
        16, description="Swarm size beyond which presence heartbeats slow down in proportion.")
    control_timeout: Seconds = pydantic.Field(
        5.0, description="Seconds for one small control exchange (a direct-connection setup, a state description).")
    reply_timeout: Seconds = pydantic.Field(
        2.0, description="Seconds for a peer to answer an invitation (a live one answers in milliseconds).")
    connect_timeout: Seconds = pydantic.Field(2.0, description="Seconds for one TCP connect to a peer's data address.")
    first_round_deadline: Seconds = pydantic.Field(
        60.0, description="Seconds a round's all-reduce may take before any round was measured.")
    min_round_deadline: Seconds = pydantic.Field(5.0, description="Shortest round deadline, in seconds.")
    max_round_deadline: Seconds = pydantic.Field(600.0, description="Longest round deadline, in seconds.")
    round_slack: Annotated[float, pydantic.Field(ge=1, le=100)] = pydantic.Field(
        4.0, description="A round's deadline is this many times the measured round time.")
    # DiLoCo's overlap in auto (peer/overlap.py): a round travels behind the next inner phase while
    # the shorter of the measured round and inner phase is at least this share of the longer, and
    # rounds take at least overlap_min_round seconds. At 0.3 an overlapped epoch is at most 0.77 as
    # long as one in turn, and with the eager outer step an epoch loses little: at 5 Mbit/s
    # (benchmarks/bandwidth_sweep.py) q4 overlapped was at 0.854 after 3 epochs where compute-only
    # was at 0.873, and reached 85% in 0.91x its time
    overlap_share: Annotated[float, pydantic.Field(gt=0, le=1)] = pydantic.Field(
        0.3, description="overlap=auto overlaps while the shorter of a round and an inner phase is at least this "
        "share of the longer.")
    overlap_min_round: Seconds = pydantic.Field(
        1.0, description="overlap=auto: shorter rounds (seconds) are not worth a stale outer step.")
    join_timeout: Seconds = pydantic.Field(
        60.0, description="Seconds a state download may land no part before it fails (a slow one goes on).")
    catch_up_retry: Seconds = pydantic.Field(
        5.0, description="Seconds to train locally after a failed state download before retrying.")
    close_part: Seconds = pydantic.Field(
        10.0, description="Seconds for each part of leaving (averagers, presence, state server, node).")

    @property
    def presence_ttl(self) -> float:
        """A presence record outlives five missed refreshes, and never less than 6 s (DHT latency)."""
        return max(6.0, 6 * self.presence_refresh)

    def beat_interval(self, members: int) -> float:
        """Seconds between presence heartbeats (a store and a reread) in a swarm of ``members``:
        the refresh, stretched by members / ``members_per_read`` beyond that many."""
        return self.presence_refresh * max(1.0, members / self.members_per_read)

    def ahead_wait(self, members: int = 1) -> float:
        """How long a peer whose round failed waits to see whether the others finished it: a
        refresh to publish, a reread to see it, and a little slack."""
        return self.presence_refresh + self.beat_interval(members) + 0.5

    def round_timer(self, override: float | None = None) -> RoundTimer:
        if override is not None:
            return RoundTimer(override, override, override, self.round_slack)
        return RoundTimer(self.first_round_deadline, self.min_round_deadline, self.max_round_deadline, self.round_slack)


class RoundTimer:
    """A round's deadline from measured round times (a smoothed estimate times ``slack``)."""

    def __init__(self, initial: float, minimum: float, maximum: float, slack: float = 4.0):
        self.estimate: float | None = None
        self.initial, self.minimum, self.maximum, self.slack = initial, minimum, maximum, slack

    def deadline(self) -> float:
        if self.estimate is None:
            return self.initial
        return min(self.maximum, max(self.minimum, self.slack * self.estimate))

    def observe(self, seconds: float) -> None:
        self.estimate = seconds if self.estimate is None else 0.7 * self.estimate + 0.3 * seconds


DEFAULT_TIMING = Timing()
