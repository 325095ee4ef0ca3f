"""Every deadline a peer keeps, derived from one ``Timing`` object instead of literals spread around.

What sets the pace is the presence refresh (how often a peer republishes its presence record and
rereads everyone's, in a swarm of up to ``members_per_read`` members) and, for what moves a model's
bytes, those bytes at the rate rounds measured (``RoundTimer``; before any, ``assumed_rate_mbps``):
never a constant that a bigger model outgrows. The rest are small fixed budgets for exchanges that
take milliseconds on a live peer, collected here so they are tuned in one place.
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
    # A slow home uplink (ADSL's is about 1 Mbit/s; cable and fibre uplinks are 10 or more): with
    # round_slack 4 a first round fits links down to 0.5 Mbit/s, a slower one gets through after
    # doubling deadlines, and from then on the measured rate sizes them. Measured before this rule:
    # a 21 MB round at a 2 Mbit/s cap (84 s) failed every round at a fixed 60 s.
    assumed_rate_mbps: Annotated[float, pydantic.Field(gt=0, le=1e6, allow_inf_nan=False)] = pydantic.Field(
        2.0, description="Mbit/s a round's bytes are assumed to move at before a round measured the rate (this "
        "peer's upload/download caps bound it further); sizes first round deadlines and caps replays.")
    first_round_deadline: Seconds = pydantic.Field(
        60.0, description="Shortest deadline, in seconds, of a round's all-reduce before any round succeeded "
        "(connections are set up then).")
    min_round_deadline: Seconds = pydantic.Field(5.0, description="Shortest round deadline, in seconds.")
    round_slack: Annotated[float, pydantic.Field(ge=1, le=100)] = pydantic.Field(
        4.0, description="A round's deadline is this many times its bytes at the measured (or assumed) rate.")
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

    def assumed_rate(self, *caps: float | None) -> float:
        """Bytes/s to assume before anything was measured: ``assumed_rate_mbps``, or the slowest of this
        peer's ``caps`` (bytes/s; None: no cap) where lower."""
        return min([self.assumed_rate_mbps * 1e6 / 8, *(cap for cap in caps if cap is not None)])

    def round_timer(self, override: float | None = None, *caps: float | None) -> RoundTimer:
        """``override`` (``Moshpit.round_timeout``) fixes every deadline; ``caps``: this peer's upload and
        download caps in bytes/s (None: no cap)."""
        return RoundTimer(self.assumed_rate(*caps), self.first_round_deadline, self.min_round_deadline,
                          self.round_slack, fixed=override)


MAX_STRETCH = 16  # deadlines grow after timeouts up to 16x: beyond, a hung groupmate would hold rounds ever longer


class RoundTimer:
    """A round's all-reduce deadline from the bytes it moves and the rate rounds measured:

        deadline = stretch x max(least, slack x bytes / rate)

    ``rate``: bytes/s of the rounds that succeeded (smoothed), ``floor`` before any; ``least``:
    ``first`` until a round succeeded (connections are set up then), ``minimum`` after; ``stretch``
    doubles with each round that timed out since the last success (up to ``MAX_STRETCH``), so a link
    slower than assumed still gets a round through and its rate takes over. ``fixed``: every
    deadline is that. Bytes are what the round's codec says it moves (allreduce.py
    ``planned_bytes``), in the busier direction, for deadlines and measurements alike, so the two
    agree (a codec's size may be an upper bound: ``nonzero``'s)."""

    def __init__(self, floor: float, first: float, minimum: float, slack: float, fixed: float | None = None):
        self.floor, self.first, self.minimum, self.slack, self.fixed = floor, first, minimum, slack, fixed
        self.rate: float | None = None
        self.stretch = 1
        self.nbytes: int | None = None  # of the last round asked about: what ``next_deadline`` sizes

    @property
    def assumed_rate(self) -> float:
        """Bytes/s the next deadline assumes: measured, else the floor."""
        return self.floor if self.rate is None else self.rate

    def deadline(self, nbytes: int) -> float:
        """Seconds a round that moves ``nbytes`` (the busier direction) may take."""
        self.nbytes = nbytes
        if self.fixed is not None:
            return self.fixed
        least = self.first if self.rate is None else self.minimum
        return self.stretch * max(least, self.slack * nbytes / self.assumed_rate)

    @property
    def next_deadline(self) -> float | None:
        """The deadline a round like the last one gets now (None before any)."""
        return None if self.nbytes is None else self.deadline(self.nbytes)

    def observe(self, nbytes: int, seconds: float) -> None:
        """A round that moved ``nbytes`` succeeded in ``seconds``: learn the rate, drop any stretch."""
        if nbytes > 0 and seconds > 0:
            rate = nbytes / seconds
            self.rate = rate if self.rate is None else 0.7 * self.rate + 0.3 * rate
        self.stretch = 1

    def missed(self, nbytes: int) -> str:
        """A round that was to move ``nbytes`` timed out: the next deadline grows. Says why, for the
        round's failure message."""
        size = f"{nbytes / 1e6:.1f} MB"
        if self.fixed is not None:
            return f"{size}; Moshpit.round_timeout fixes the deadline"
        rate = self.assumed_rate
        self.stretch = min(MAX_STRETCH, 2 * self.stretch)
        return (f"{size} at an assumed {rate * 8 / 1e6:.2f} Mbit/s takes {nbytes / rate:.0f} s; "
                f"next deadline {self.deadline(nbytes):.0f} s")


DEFAULT_TIMING = Timing()
