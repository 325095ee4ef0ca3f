"""Accountability: a per-peer score of misbehaviour, and local bans past a threshold (issue 15, item 5).

Whatever this peer catches another peer doing wrong adds that kind's weight to the other's score:

    kind                   weight  where it is seen
    invalid frame          1       a served stream's handler raised FrameError (transport.py, direct.py),
                                   a donor's state description or part broke the protocol
    clipped                0 (*)   a round's robust aggregation clipped its contribution (round suspicions)
    rejected               0 (*)   it left the contribution out, over 3 τ from the result (rules/centered_clip.py)
    weight cut             2       it claimed a weight above the bound (round suspicions)
    bad state              3       a donor's state held NaN or Inf (in its sketch or the parts it served),
                                   or parts it served failed the check against the donors' sketches
    implausible progress   1       its record claimed an epoch over one past the swarm's (peer/progress.py), once per claim
    digest disagreement    2       a donor's state (layout or sketch) lay outside the tolerance of the
                                   majority of the donors a joiner asked (state/transfer.py)

A kind not in the table weighs 1.

(*) ``Accountability.far_rows``, 0 by default: robust aggregation bounds what a far contribution does
in the round it is sent, but distance alone does not tell a liar from an honest peer. Late in
training most honest rows nearly coincide (shards learnt by heart: per-chunk norms of 1e-5 beside
0.2-1.0 after the same 20 steps, attack benchmark on ``digits``), so an honest peer still learning
is rejected round after round, as far out as a liar (honest rows rejected at a median 107 τ in a
clean run, x100 attackers at 62-166 τ, sign flips at 5-12 τ) and at 0.5 a row it was banned (one
honest peer in one of two clean rows, two in a fake-samples row). What bans by default is what no
honest peer does: frames that break the protocol, weights over the run's cap, bad or outvoted
state, implausible progress. A run whose honest rows stay alike may set ``far_rows`` (0.5 was the
earlier default).

Two things bring a score down. A round in which this peer took a member's contribution and found
nothing wrong with it halves that member's score (``note_round`` with the report's ``observed``:
the peers whose contributions to this peer's part it aggregated), so what bans is misbehaving in
round after round: 5 weight cuts in a row, or with ``far_rows`` 0.5 about 20 far rows in a row,
however often rounds come. And every score halves every
``half_life`` seconds (60 s by default), for what no round forgives (invalid frames, bad state,
a peer no longer in rounds). A burst of 10 points bans at once. One number per peer, no history.

Past ``ban_threshold`` the peer is banned for ``ban_seconds``: the admission (admission.py) refuses its
streams and ignores its records, so it leaves this peer's grid and progress. A ban is one WARNING line;
when it ends, the score starts from zero. Bans are local: peers of one run may differ in these settings,
and nothing about a ban is published (only a count, in the peer's stats).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Annotated, Callable

import pydantic

from swarmgrad.settings import SettingsModel, flag

logger = logging.getLogger(__name__)

FAR_ROWS = ("clipped", "rejected")  # weighed by Accountability.far_rows
WEIGHTS: dict[str, float] = {
    "invalid frame": 1.0,
    "weight cut": 2.0,
    "bad state": 3.0,
    "implausible progress": 1.0,
    "digest disagreement": 2.0,
}
REACHED = 0.99  # a score at 99% of the threshold has reached it


class Accountability(SettingsModel):
    """A peer's local rule for banning others: not a run setting (peers of one run may differ)."""

    ban_threshold: Annotated[float, pydantic.Field(gt=0, le=1e6)] = pydantic.Field(
        10.0, description="Misbehaviour score at which another peer is banned here (invalid frame 1, weight cut 2, "
        "bad state 3; scores halve every --ban-half-life).")
    ban_seconds: Annotated[float, pydantic.Field(gt=0, le=30 * 86400)] = pydantic.Field(
        600.0, description="How long a ban lasts: its streams refused, its records ignored.")
    half_life: Annotated[float, pydantic.Field(gt=0, le=86400)] = pydantic.Field(
        60.0, description="Seconds for a misbehaviour score to halve.", json_schema_extra=flag("ban-half-life"))
    far_rows: Annotated[float, pydantic.Field(ge=0, le=1e6)] = pydantic.Field(
        0.0, description="Score of a contribution the robust aggregation clipped or left out (0: none; see "
        "net/accountability.py).", json_schema_extra=flag("ban-far-rows"))


DEFAULT_ACCOUNTABILITY = Accountability()


class Misbehaviour:
    """Scores and bans, by peer id. ``clock``: monotonic seconds (tests pass a fake one)."""

    def __init__(self, settings: Accountability = DEFAULT_ACCOUNTABILITY, *, clock: Callable[[], float] = time.monotonic):
        self.settings, self.clock = settings, clock
        self._scores: dict[str, tuple[float, float]] = {}  # peer -> (score, when it was last updated)
        self._reasons: dict[str, Counter[str]] = {}  # peer -> kinds noted since its score last started
        self._bans: dict[str, float] = {}  # peer -> when (clock) its ban ends
        self.bans_total = 0  # bans so far, lifted ones included
        self.ignore: set[str] = set()  # never scored: this peer itself

    def score(self, peer_id: str) -> float:
        """``peer_id``'s score now, decayed."""
        score, since = self._scores.get(peer_id, (0.0, 0.0))
        return score * 0.5 ** ((self.clock() - since) / self.settings.half_life) if score else 0.0

    def note(self, peer_id: str, kind: str, detail: str = "") -> bool:
        """Count one misbehaviour of ``kind`` (WEIGHTS); True when it bans the peer now."""
        if peer_id in self.ignore or self.banned(peer_id):
            return False  # a banned peer's late reports (a round in flight) change nothing
        score = self.score(peer_id) + (self.settings.far_rows if kind in FAR_ROWS else WEIGHTS.get(kind, 1.0))
        reasons = self._reasons.setdefault(peer_id, Counter())
        reasons[kind] += 1
        logger.debug("misbehaviour of %s: %s%s (score %.1f)", peer_id, kind, f" ({detail})" if detail else "", score)
        # within 1% counts as reaching it: n points noted moments apart have decayed by a hair, and ban at n
        if score < self.settings.ban_threshold * REACHED:
            self._scores[peer_id] = (score, self.clock())
            return False
        self._scores.pop(peer_id, None)
        self._reasons.pop(peer_id, None)
        self._bans[peer_id] = self.clock() + self.settings.ban_seconds
        self.bans_total += 1
        until = time.strftime("%H:%M:%S UTC", time.gmtime(time.time() + self.settings.ban_seconds))
        logger.warning("banned %s for %.0f s, until %s: score %.1f >= %g (%s)", peer_id, self.settings.ban_seconds,
                       until, score, self.settings.ban_threshold,
                       ", ".join(f"{kind} x{count}" for kind, count in reasons.most_common()))
        return True

    def note_round(self, suspicions: dict[str, list[str]], group: list[str] | tuple[str, ...] = ()) -> None:
        """A round's suspicions (peer -> reasons, as AllReduceReport and RoundReport carry them); each
        peer of ``group`` (whose contributions this peer aggregated: the report's ``observed``) that is
        not suspected has its score halved."""
        for peer_id, reasons in suspicions.items():
            for reason in reasons:
                self.note(peer_id, reason)
        for peer_id in group:
            if peer_id not in suspicions and peer_id in self._scores:
                score = self.score(peer_id) / 2
                self._scores[peer_id] = (score, self.clock())

    def least_suspect_first(self, peers: list[str]) -> list[str]:
        """``peers`` by score, lowest first (ties keep their order): where a few of many are asked
        (donors of a round's result), one seen clipped or cut is asked only if too few others are."""
        return sorted(peers, key=self.score)

    def banned(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is banned now (a dict lookup for everyone else: every stream asks)."""
        until = self._bans.get(peer_id)
        if until is None:
            return False
        if until > self.clock():
            return True
        del self._bans[peer_id]
        logger.info("the ban of %s ended", peer_id)
        return False

    def bans(self) -> dict[str, float]:
        """Peers banned now -> seconds left."""
        now = self.clock()
        # a copy first: peer.status() reads this from the caller's thread while the loop may ban
        return {peer_id: until - now for peer_id, until in list(self._bans.items()) if until > now}
