"""Swarm-wide training progress through the DHT, so peers agree when a step is due without a coordinator.

Each peer's presence record (``swarmgrad/R/members``, one record with one TTL, published and reread
by the peer's ``NetworkRuntime`` every presence refresh, and at once when the epoch changes or the
peer starts averaging) carries its ``Progress``: its epoch (the number of swarm steps it has taken
part in), the samples and local steps it has trained on in that epoch, its rates, and the digest of
the run settings it trains with. The training thread only ever looks at a cached ``SwarmProgress``.

Others' counts are extrapolated from their rates since their last record (as hivemind's progress
tracker does), so a peer does not wait one refresh interval to see that the target was reached.
Peers that train with other settings (another digest) never meet this peer's rounds: they are
listed apart (``SwarmProgress.other_settings``) and counted neither as groupmates nor as donors.

Progress that cannot be gamed: every number the driver acts on comes from distinct peers through a
quorum or a median, never a max or a sum of raw claims, so one peer's records can neither force,
stall nor skip a swarm step, nor trigger a download:
- the swarm's epoch is the (low) median of the peers' epochs;
- a peer catches up only when at least ``catch_up_quorum(n)`` distinct other peers are past its epoch
  (n: the other peers with its settings seen within ``POPULATION_MEMORY``, listed now or not), and
  its target is the highest epoch that many reached (a quantile, not the max). Peers more than
  ``IMPLAUSIBLE_LEAD`` epochs past the others' median are "implausible progress": never donors, and
  named in ``ProgressTracker.suspicions`` for a later accountability feature;
- a step is due by samples when the swarm's sum reaches the target with each other peer's claim
  capped at ``CLAIM_SLACK`` x the median claim (this peer's own count, which it knows, is never cut),
  by steps when the median peer (of an even count: the middle one nearer this peer's own count)
  took them, and by someone averaging only when ``averaging_quorum`` peers at the epoch say so.
A peer that claims zero forever cannot stall a step: the sum only grows with the others' samples,
and a median moves past one low value.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from swarmgrad.dht.membership import Membership, Progress, TrainingStats

RATE_SMOOTHING = 0.3  # weight of the newest interval in the samples/s average
# share of the peers with this peer's settings (itself included) that must be past its epoch before it
# takes the swarm's state: half, so the peers that moved on are the swarm and not a minority that
# lies. The least is 2 distinct peers, except that a peer with one other peer has nobody to outvote it.
CATCH_UP_QUORUM = 0.5
# epochs past the other peers' median epoch that a peer may be before its progress is implausible:
# honest peers are within a round or two of each other (a straggler catches up, it does not lead)
IMPLAUSIBLE_LEAD = 2
# the most samples or steps one other peer's claim counts for, as a multiple of the median claim: an
# honest peer up to this many times faster than the median one is counted in full (as WEIGHT_SLACK)
CLAIM_SLACK = 4.0
# how long a peer with this peer's settings still counts toward the swarm's size after its record was
# last listed: on a loaded machine honest records can lapse for a beat or two, and a liar that is for
# a moment the only peer listed must not become "the only other peer", who decides alone
POPULATION_MEMORY = 30.0


def catch_up_quorum(others: int, share: float = CATCH_UP_QUORUM) -> int:
    """Distinct other peers that must be past this peer's epoch before it catches up, among ``others``
    other peers with its settings: max(2, ceil(share x (others + 1))), at most ``others`` (with one
    other peer that peer decides: a swarm of two must still take in a joiner)."""
    return min(others, max(2, math.ceil(share * (others + 1))))


def averaging_quorum(others: int) -> int:
    """Other peers at this epoch that must say they average before this peer's step is due: two, or the
    only one (one peer's flag alone cannot force a round on a larger swarm)."""
    return min(others, 2)


def low_median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0


@dataclass(frozen=True)
class PeerProgress:
    peer_id: str
    epoch: int
    samples: float  # extrapolated to the time the snapshot was taken
    steps: float
    samples_per_second: float
    averaging: bool


@dataclass(frozen=True)
class SwarmProgress:
    """A snapshot of everyone's progress (this peer's own entry is exact, others' extrapolated).
    ``peers``: this peer and those with its settings; ``other_settings``: peers with other settings."""

    peers: tuple[PeerProgress, ...] = ()
    taken_at: float = 0.0
    other_settings: tuple[str, ...] = ()
    population: int = 0  # other peers with this peer's settings seen within POPULATION_MEMORY (listed or not)

    @property
    def epoch(self) -> int:
        """The swarm's epoch: the (low) median of the live peers' epochs, which no one peer can move far."""
        return int(low_median([peer.epoch for peer in self.peers]))

    def others(self, me: str) -> list[PeerProgress]:
        return [peer for peer in self.peers if peer.peer_id != me]

    def implausible(self, me: str) -> list[PeerProgress]:
        """Other peers more than ``IMPLAUSIBLE_LEAD`` epochs past the other peers' median epoch."""
        others = self.others(me)
        median = low_median([peer.epoch for peer in others])
        return [peer for peer in others if peer.epoch > median + IMPLAUSIBLE_LEAD]

    def ahead(self, me: str, epoch: int) -> tuple[list[str], int]:
        """(donors, target) for peer ``me`` at ``epoch``: when at least ``catch_up_quorum`` distinct other
        peers are past ``epoch``, the target is the highest epoch that many reached and the donors are
        the plausible peers at or past it; otherwise no donors and the target is ``epoch``."""
        others = self.others(me)
        past = sorted((peer for peer in others if peer.epoch > epoch), key=lambda peer: -peer.epoch)
        needed = catch_up_quorum(max(len(others), self.population))
        if not past or len(past) < needed:
            return [], epoch
        target = past[needed - 1].epoch
        implausible = {peer.peer_id for peer in self.implausible(me)}
        return [peer.peer_id for peer in past if peer.epoch >= target and peer.peer_id not in implausible], target

    def capped_samples_in(self, me: str, epoch: int) -> float:
        """The epoch's samples with each other peer's claim cut to ``CLAIM_SLACK`` x the median claim."""
        peers = self.at(epoch)
        cap = CLAIM_SLACK * statistics.median([peer.samples for peer in peers]) if peers else 0.0
        return sum(peer.samples if peer.peer_id == me else min(peer.samples, cap) for peer in peers)

    def median_steps_in(self, me: str, epoch: int) -> float:
        """The median peer's local steps in the epoch; of an even count, the middle one nearer this peer's own."""
        peers = self.at(epoch)
        if not peers:
            return 0.0
        ordered = sorted(peer.steps for peer in peers)
        low, high = ordered[(len(ordered) - 1) // 2], ordered[len(ordered) // 2]
        mine = next((peer.steps for peer in peers if peer.peer_id == me), low)
        return low if abs(low - mine) <= abs(high - mine) else high

    def averaging_quorum_in(self, me: str, epoch: int) -> bool:
        """Enough other peers at ``epoch`` say they average (``averaging_quorum``)."""
        others = [peer for peer in self.at(epoch) if peer.peer_id != me]
        flagged = sum(peer.averaging for peer in others)
        return flagged > 0 and flagged >= averaging_quorum(len(others))

    def at(self, epoch: int) -> list[PeerProgress]:
        return [peer for peer in self.peers if peer.epoch == epoch]

    def samples_in(self, epoch: int) -> float:
        return sum(peer.samples for peer in self.at(epoch))

    def mean_steps_in(self, epoch: int) -> float:
        peers = self.at(epoch)
        return sum(peer.steps for peer in peers) / len(peers) if peers else 0.0

    def averaging_in(self, epoch: int) -> bool:
        return any(peer.averaging for peer in self.at(epoch))

    @property
    def samples_per_second(self) -> float:
        return sum(peer.samples_per_second for peer in self.peers)


@dataclass
class LocalProgress:
    """This peer's counters; written by the training thread, read by the tracker's task."""

    epoch: int = 0
    samples: int = 0  # in this epoch
    steps: int = 0  # in this epoch
    total_samples: int = 0
    total_steps: int = 0
    samples_per_second: float = 0.0
    steps_per_second: float = 0.0
    averaging: bool = False
    _rate_mark: tuple[float, int, int] = field(default_factory=lambda: (time.monotonic(), 0, 0))

    def add(self, samples: int) -> None:
        self.samples += samples
        self.steps += 1
        self.total_samples += samples
        self.total_steps += 1

    def update_rates(self) -> None:
        now = time.monotonic()
        since, samples, steps = self._rate_mark
        if now - since < 0.2:
            return
        sample_rate = (self.total_samples - samples) / (now - since)
        step_rate = (self.total_steps - steps) / (now - since)
        if self.samples_per_second == 0.0:
            self.samples_per_second, self.steps_per_second = sample_rate, step_rate
        else:
            self.samples_per_second += RATE_SMOOTHING * (sample_rate - self.samples_per_second)
            self.steps_per_second += RATE_SMOOTHING * (step_rate - self.steps_per_second)
        self._rate_mark = (now, self.total_samples, self.total_steps)


class ProgressTracker:
    """Fills this peer's presence record with its progress and keeps a fresh ``SwarmProgress`` of the run.

    ``ProgressTracker(runtime.presence, settings_digest)``, then ``tracker.add(batch)`` from training
    code, ``tracker.swarm`` for the latest snapshot, ``tracker.next_epoch(e)`` after a swarm step.
    """

    def __init__(self, presence: Membership, settings: str = "", *,
                 epsilon: Callable[[], float | None] = lambda: None,
                 stats: Callable[[], TrainingStats | None] = lambda: None):
        self.presence, self.settings, self.epsilon, self.stats = presence, settings, epsilon, stats
        self.local = LocalProgress()
        self.swarm = SwarmProgress()
        self._lock = threading.Lock()  # the training thread changes epochs while the loop reads counters
        # why each peer's progress records look wrong (peer id -> reasons, newest last): implausible
        # progress, for a later accountability feature to count; nothing here acts on them
        self.suspicions: dict[str, list[str]] = {}
        self._suspected: set[tuple[str, int]] = set()
        self._recent: dict[str, float] = {}  # peer id -> when last listed with this peer's settings
        presence.before_publish = self._fill

    @property
    def peer_id(self) -> str:
        return self.presence.node.peer_id

    # ---- called from the training side (any thread) -------------------------------------------

    def next_epoch(self, epoch: int) -> None:
        """Start counting a new epoch (after a swarm step, or after catching up to the swarm)."""
        with self._lock:
            self.local.epoch, self.local.samples, self.local.steps = epoch, 0, 0
            self.local.averaging = False
        self._snapshot()
        self.presence.publish_soon()

    def set_averaging(self, averaging: bool) -> None:
        with self._lock:
            self.local.averaging = averaging
        if averaging:
            self.presence.publish_soon()

    def add(self, samples: int) -> None:
        """Count one local step on ``samples`` samples (from the training thread)."""
        with self._lock:
            self.local.add(samples)

    def resume_counters(self, steps: int, samples: int) -> None:
        """Totals from a checkpoint; the rate starts over from them (they were not trained just now)."""
        with self._lock:
            self.local.total_steps, self.local.total_samples = steps, samples
            self.local._rate_mark = (time.monotonic(), samples, steps)

    # ---- the presence heartbeat ----------------------------------------------------------------

    def _fill(self, presence: Membership) -> None:
        """What this peer's next presence record says (called by the heartbeat, on the loop)."""
        with self._lock:
            self.local.update_rates()
            local = self.local
            progress = Progress(epoch=local.epoch, samples=local.samples, steps=local.steps,
                                steps_per_second=float(local.steps_per_second), averaging=local.averaging,
                                settings=self.settings)
            step, rate = local.total_steps, float(local.samples_per_second)
        epsilon = self.epsilon()
        presence.update(step=step, samples_per_second=rate, progress=progress, stats=self.stats(),
                        epsilon=epsilon if epsilon is not None and math.isfinite(epsilon) else None)

    # ---- reading -------------------------------------------------------------------------------

    def _snapshot(self) -> None:
        now, wall = time.monotonic(), time.time()
        with self._lock:
            local = self.local
            peers = [PeerProgress(self.peer_id, local.epoch, float(local.samples), float(local.steps),
                                  local.samples_per_second, local.averaging)]
        other_settings: list[str] = []
        for member in self.presence.members:
            record = member.progress
            if member.peer_id == self.peer_id or record is None or member.expires < wall:
                continue
            if record.settings != self.settings:
                other_settings.append(member.peer_id)
                continue
            # extrapolate by the peer's rate, at most two heartbeats (it may have stopped)
            elapsed = min(max(0.0, wall - member.last_seen), 2 * self.presence.beat_interval) if not record.averaging else 0.0
            samples = record.samples + member.samples_per_second * elapsed
            steps = record.steps + record.steps_per_second * elapsed
            peers.append(PeerProgress(member.peer_id, record.epoch, samples, steps, member.samples_per_second,
                                      record.averaging))
        for peer in peers[1:]:
            self._recent[peer.peer_id] = now
        for peer_id, seen in list(self._recent.items()):
            if now - seen > POPULATION_MEMORY:
                del self._recent[peer_id]
        self.swarm = SwarmProgress(tuple(peers), taken_at=now, other_settings=tuple(other_settings),
                                   population=len(self._recent))
        self._suspect(self.swarm)

    def _suspect(self, swarm: SwarmProgress) -> None:
        """Note each implausible claim once (per peer and claimed epoch)."""
        implausible = swarm.implausible(self.peer_id)
        if not implausible:
            return
        median = int(low_median([peer.epoch for peer in swarm.others(self.peer_id)]))
        for peer in implausible:
            if (peer.peer_id, peer.epoch) not in self._suspected and len(self._suspected) < 10_000:
                self._suspected.add((peer.peer_id, peer.epoch))
                self.suspicions.setdefault(peer.peer_id, []).append(
                    f"implausible progress: claims epoch {peer.epoch}, the other peers' median is {median}")

    def fresh(self) -> SwarmProgress:
        """A snapshot with this peer's exact counters and others' extrapolated to now."""
        self._snapshot()
        return self.swarm

    def ahead_of(self, epoch: int) -> list[str]:
        """Donors for a peer that fell behind: empty unless a quorum of distinct peers (with this peer's
        settings) is past ``epoch`` (``SwarmProgress.ahead``)."""
        return self.fresh().ahead(self.peer_id, epoch)[0]

    def catch_up_target(self, epoch: int) -> tuple[list[str], int]:
        """(donors, the epoch a quorum reached) for a peer at ``epoch``; no donors when no quorum is past it."""
        return self.fresh().ahead(self.peer_id, epoch)

    def others_at(self, epoch: int) -> list[str]:
        return [peer.peer_id for peer in self.fresh().at(epoch) if peer.peer_id != self.peer_id]
