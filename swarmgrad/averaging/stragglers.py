"""How long matchmaking waits for a straggler: a member seen alive that has not declared yet.

A member of this peer's slice that trains more slowly reaches a round a little after the others: it
checks whether the round is due only between its own local steps. Waiting for it keeps its samples
in the round; waiting too long costs every faster peer its time. So, once this peer has measured its
own round period (the median gap between the starts of its last rounds, ``RoundClock``), a member
whose presence record carries a pace (``Pace``: its claimed step rate, and whether it has started
averaging) is waited for only up to a cap, ``straggler_cap``: ``STRAGGLER_SHARE`` of that period,
never less than a few of this node's DHT request times (a declaration takes that long to show) nor
than one and a half of this peer's own steps (a member as fast comes within one), and never more
than the matchmaking window; and a declaration made at the cap's last moment is looked
for as long as a declaration takes to show. A member whose claimed pace says it cannot arrive within
the cap (one of its steps, unless it is averaging already, takes longer) is not waited for at all:
it replays the round when it comes and keeps its local progress for the next one (catch_up.py).
A member that was waited for and did not declare within the cap is a no-show (attendance.py).
The cap bounds the wait for at most half the members only: while fewer than half the alive members
have declared, those here are early rather than the rest late, and all are waited for as
attendance.py says (``half_declared``).

Pace values are claims: they only decide *whether* a member is waited for, never *how long*. The
cap comes from this peer's own measurements and the run's window, so no record stretches a wait past
it. Members with no pace (no training progress in their record) are waited for as attendance.py
says, up to the window; so is everyone before this peer measured a round period.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

# Issue 38's bar: fast peers keep at least 90% of their samples/s beside a 10x slower peer. A wait of
# at most a tenth of the round period holds them to that even when a straggler comes at the cap's
# last moment every round (it usually comes sooner, or is not waited for at all).
STRAGGLER_SHARE = 0.1
# a declaration shows after a store and a read: this many DHT request times (matchmaking.GRACE_LATENCIES)
CAP_LATENCIES = 3
# A member as fast as this peer comes within one of its steps of the round being due (it checks only
# between steps), so the cap is never less than this many of this peer's own steps: a tenth of a
# period of a few steps is less than one, and every member of equal pace that was not averaging yet
# when half had declared was left out of the round (a test's 3 peers at H=4: one of them every few
# runs under load). A 10x slower member's step is still far past it: not waited for.
OWN_STEPS = 1.5
ROUNDS_KEPT = 9  # round gaps the period is the median of: a retry's short gap moves it little


@dataclass(frozen=True)
class Pace:
    """What a member's presence record claims about its pace."""

    steps_per_second: float
    averaging: bool  # it started averaging: it is in matchmaking now or about to be

    def arrival(self) -> float:
        """Seconds until it declares, by its claim: at once if averaging, else at most one of its
        steps (it checks whether the round is due after each); never, if it claims no steps at all."""
        if self.averaging:
            return 0.0
        return 1.0 / self.steps_per_second if self.steps_per_second > 0 else float("inf")


class RoundClock:
    """This peer's own round period: the median gap between the starts of its last rounds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._last: float | None = None
        self._gaps: deque[float] = deque(maxlen=ROUNDS_KEPT)

    def started(self) -> None:
        now = self.clock()
        if self._last is not None:
            self._gaps.append(now - self._last)
        self._last = now

    @property
    def period(self) -> float | None:
        """None until two rounds started."""
        return statistics.median(self._gaps) if self._gaps else None


def straggler_cap(period: float | None, window: float, latency: float, step: float | None = None) -> float | None:
    """The longest wait for a straggler (None: no cap measured yet, the window rules). ``step``: this
    peer's own seconds a step, by its record: the cap is at least ``OWN_STEPS`` of them."""
    if period is None:
        return None
    return min(window, max(STRAGGLER_SHARE * period, CAP_LATENCIES * latency, OWN_STEPS * (step or 0.0)))


def half_declared(alive: frozenset[str], declared: set[str]) -> bool:
    """Whether at least half the ``alive`` members declared: only then are the others stragglers,
    waited for up to the cap. Capping the wait of an early minority split a 6-peer soak swarm: 2 peers
    declared first, gave up on the other 4 after the cap (60 ms there) and averaged alone, and the 4
    waited 6 s for a leader that had gone with the 2 (issue 38). Half, not a strict majority: 2 fast
    peers of 4 then still cap their wait for the other two (one evaluating, one 10x slower), as the
    heterogeneous benchmark wants (a strict majority measured 0.89 and 0.90 of the fast peers' rate
    against the 0.90 bar)."""
    return 2 * len(alive & declared) >= len(alive)


class Patience:
    """One round's matchmaking: which undeclared members it still waits for, from ``began`` on.
    ``shown_after``: how long a declaration takes to show here (a store and a read); a straggler that
    declares within the cap is waited for that much longer, so one that came in time is seen (a NAT
    lab peer declared 0.43 s into a 0.44 s cap, and the others went on without it)."""

    def __init__(self, cap: float | None, paces: Mapping[str, Pace],
                 clock: Callable[[], float] = time.monotonic, shown_after: float = 0.0):
        self.cap, self.paces, self.clock, self.shown_after = cap, paces, clock, shown_after
        self.began = clock()

    def _capped(self, peer: str) -> bool:
        return self.cap is not None and peer in self.paces

    def _out(self) -> bool:
        """The cap, and the time its last moment's declaration takes to show, have passed."""
        return self.clock() - self.began >= self.cap + self.shown_after  # type: ignore[operator]

    def waits_for(self, peer: str) -> bool:
        """Whether an alive, undeclared ``peer`` is still waited for now."""
        if not self._capped(peer):
            return True  # no cap or no pace: attendance's rule (the window)
        return self.paces[peer].arrival() <= self.cap and not self._out()  # type: ignore[operator]

    def gave_up_on(self, peers: Iterable[str]) -> set[str]:
        """Of ``peers`` (alive, listed, undeclared), those that were waited for up to the cap and did
        not come: no-shows. A straggler never waited for (beyond the cap) is not one."""
        return {peer for peer in peers if self._capped(peer) and self.paces[peer].arrival() <= self.cap  # type: ignore[operator]
                and self._out()}
