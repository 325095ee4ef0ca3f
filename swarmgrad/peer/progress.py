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

No single record can force, stall or skip a swarm step, or make peers download (issue 15):
- the swarm's epoch is the furthest epoch at least half of its peers (this one included) have
  reached, not the furthest any record claims. Every peer computes the same number from the same
  records, so the rule "be at the swarm's epoch" moves the minority, never both sides: a peer behind
  it catches up, taking the state only from peers at it (at most ``DONOR_LEAD`` past it), and a peer
  ahead of it on its own (nobody at its epoch, nobody about to come: a head start, or rounds that
  failed) rejoins it the same way, since in DiLoCo only a state download makes two models one.
  Claims past that epoch by more than ``DONOR_LEAD`` are implausible and left out, and the epoch
  is taken again over the rest: two records of eight claiming 10^6 would otherwise make it the
  second honest peer's, and four of six honest peers, a round behind only by their records' lag,
  downloaded instead of averaging (attack benchmark: 10 rounds in 40 s, 92.5% against 96.9%).
  A record claiming epoch 10^6 beside three honest peers moves nothing (before: the three froze at
  epoch 55 for the 40 s it lived, retrying downloads from its author); its author is blamed for
  ``implausible progress`` once per claim. In a swarm of two the other peer is half the swarm:
  there a liar is followed (nothing can tell it from an honest leader);
- whether a step is due comes from step and sample counts at this peer's epoch each capped at
  ``CLAIM_CAP`` x the median claim, from at least half of the other peers at this epoch averaging,
  and from this peer's own count reaching ``OWN_STEPS_DUE`` x the target: a huge claim counts as
  two peers, a zero one as none, and no claim keeps a peer from its round for long.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from swarmgrad.dht.membership import Membership, Progress, TrainingStats

RATE_SMOOTHING = 0.3  # weight of the newest interval in the samples/s average
# how far past the swarm's epoch a donor may be: honest peers are within a round of each other (a
# group that just stepped); a peer further ahead is never asked for its state
DONOR_LEAD = 1
# a peer's claimed samples or steps count at most this many times the median claim at its epoch:
# honest peers differ by their speed, a liar's 10^9 counts as two peers
CLAIM_CAP = 2.0
MAX_MET = 4096  # members whose last shared round is remembered (ProgressTracker.met)
# a peer's step is due once it trained this many times the steps a round wants, whatever the others
# claim: a swarm of slow peers (or liars claiming zero) cannot hold it past the run's weight cap
OWN_STEPS_DUE = 2.0


def _half_reached(peers: Iterable[PeerProgress]) -> int:
    """The furthest epoch at least half of ``peers`` reached (0 for none)."""
    epochs = sorted((peer.epoch for peer in peers), reverse=True)
    return epochs[math.ceil(len(epochs) / 2) - 1] if epochs else 0


def _capped(claims: list[float]) -> list[float]:
    if not claims:
        return []
    cap = CLAIM_CAP * statistics.median(claims)
    return [min(claim, cap) for claim in claims]


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

    @property
    def epoch(self) -> int:
        """The swarm's epoch: the furthest epoch at least half of the peers (this one included) reached,
        once the implausible claims (past the first such count by over ``DONOR_LEAD``) are left out."""
        first = _half_reached(self.peers)
        return _half_reached([peer for peer in self.peers if peer.epoch <= first + DONOR_LEAD])

    def at(self, epoch: int) -> list[PeerProgress]:
        return [peer for peer in self.peers if peer.epoch == epoch]

    def _donors(self, target: int) -> list[str]:
        """Other peers at ``target`` or at most ``DONOR_LEAD`` past it (``peers[0]`` is this peer)."""
        return [peer.peer_id for peer in self.peers[1:] if target <= peer.epoch <= target + DONOR_LEAD]

    def ahead(self, epoch: int) -> list[str]:
        """Donors for a peer at ``epoch`` behind the swarm's epoch; [] when it is not behind."""
        target = self.epoch
        return self._donors(target) if target > epoch else []

    def rejoin(self, epoch: int) -> list[str]:
        """Donors for a peer at ``epoch`` ahead of the swarm's epoch on its own: nobody else at its
        epoch, and nobody one behind it averaging (about to come); [] otherwise."""
        target, others = self.epoch, self.peers[1:]
        if target >= epoch or any(peer.epoch == epoch or (peer.epoch == epoch - 1 and peer.averaging)
                                  for peer in others):
            return []
        return self._donors(target)

    def implausible(self) -> list[PeerProgress]:
        """Peers further than a round past the epoch half of all peers reached: what no honest peer
        claims for long (measured before they are left out, so an honest leader never is)."""
        target = _half_reached(self.peers)
        return [peer for peer in self.peers[1:] if peer.epoch > target + DONOR_LEAD]

    def samples_in(self, epoch: int) -> float:
        """Samples trained at ``epoch``, each peer's claim capped at ``CLAIM_CAP`` x the median claim."""
        return sum(_capped([peer.samples for peer in self.at(epoch)]))

    def mean_steps_in(self, epoch: int) -> float:
        """The mean local step count at ``epoch``, each peer's claim capped at ``CLAIM_CAP`` x the median
        claim (a mean, not the median: a peer twice as fast pulls the round forward, as it should)."""
        steps = _capped([peer.steps for peer in self.at(epoch)])
        return sum(steps) / len(steps) if steps else 0.0

    def averaging_in(self, epoch: int) -> bool:
        """At least half of the other peers at ``epoch`` (this peer is ``peers[0]``) started averaging."""
        others = [peer for peer in self.peers[1:] if peer.epoch == epoch]
        return bool(others) and sum(peer.averaging for peer in others) >= math.ceil(len(others) / 2)

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
    _pace_held: bool = False

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
        self.samples_per_second = _smoothed(self.samples_per_second, (self.total_samples - samples) / (now - since))
        if not self._pace_held:
            self.steps_per_second = _smoothed(self.steps_per_second, (self.total_steps - steps) / (now - since))
        self._rate_mark = (now, self.total_samples, self.total_steps)

    @contextmanager
    def pace_held(self) -> Iterator[None]:
        """Time in it (taking the swarm's state, replaying rounds) is not in the step rate, the pace others
        wait for this peer by (stragglers.py): after minutes of catching up its average had decayed to
        about 0, and for its first heartbeats of training it claimed a fraction of its pace (0.7^n of
        the way short after n), which can put its arrival past the others' cap for stragglers just as it
        comes to its first round. Its samples/s, only shown, stays what it is."""
        self._pace_held = True
        try:
            yield
        finally:
            self._pace_held = False
            self._rate_mark = (time.monotonic(), self.total_samples, self.total_steps)


def _smoothed(average: float, newest: float) -> float:
    """A rate's running average with ``newest`` (its first nonzero one replaces a 0)."""
    return newest if average == 0.0 else average + RATE_SMOOTHING * (newest - average)


class ProgressTracker:
    """Fills this peer's presence record with its progress and keeps a fresh ``SwarmProgress`` of the run.

    ``ProgressTracker(runtime.presence, settings_digest)``, then ``tracker.add(batch)`` from training
    code, ``tracker.swarm`` for the latest snapshot, ``tracker.next_epoch(e)`` after a swarm step.
    """

    def __init__(self, presence: Membership, settings: str = "", *,
                 epsilon: Callable[[], float | None] = lambda: None,
                 stats: Callable[[], TrainingStats | None] = lambda: None,
                 blame: Callable[[str, str, str], None] = lambda peer_id, kind, detail: None):
        self.presence, self.settings, self.epsilon, self.stats = presence, settings, epsilon, stats
        self.blame = blame  # (peer id, kind, detail): told of implausible progress, once per claim
        self.suspicions: dict[str, str] = {}  # peer id -> why its progress is not believed, now
        self._blamed: set[tuple[str, int]] = set()  # (peer id, claimed epoch) already blamed
        self.local = LocalProgress()
        self.swarm = SwarmProgress()
        self._lock = threading.Lock()  # the training thread changes epochs while the loop reads counters
        # peer id -> (the epoch a round this peer averaged in with it took it to, wall time): believed
        # over its presence record until the record is newer (``met``)
        self._met: dict[str, tuple[int, float]] = {}
        presence.before_publish = self._fill

    @property
    def peer_id(self) -> str:
        return self.presence.node.peer_id

    # ---- called from the training side (any thread) -------------------------------------------

    def next_epoch(self, epoch: int, steps: int = 0, samples: int = 0) -> None:
        """Start counting a new epoch (after a swarm step, or after catching up to the swarm), with
        ``steps`` and ``samples`` already in it (made while its round travelled: overlap.py)."""
        with self._lock:
            self.local.epoch, self.local.samples, self.local.steps = epoch, samples, steps
            self.local.averaging = False
        self._snapshot()
        self.presence.publish_soon()

    def met(self, epoch: int, members: Iterable[str]) -> None:
        """``members`` averaged a round with this peer that took them to ``epoch``: until their
        presence records are newer than this, they count at ``epoch`` (records are a heartbeat old,
        and rounds of a second or less left them 2-3 epochs behind: a peer just out of a round with
        two others saw itself alone and ahead of the swarm, took its state, and fell out of step)."""
        now = time.time()
        with self._lock:
            for peer in members:
                if peer != self.peer_id:
                    self._met[peer] = (epoch, now)
            if len(self._met) > MAX_MET:  # bounded: members come and go for days
                for peer in sorted(self._met, key=lambda peer: self._met[peer][1])[:len(self._met) - MAX_MET]:
                    del self._met[peer]

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
            met = dict(self._met)
        other_settings: list[str] = []
        for member in self.presence.members:
            record = member.progress
            if member.peer_id == self.peer_id or record is None or member.expires < wall or member.paused:
                continue  # a paused member is neither waited for nor asked for its state
            if record.settings != self.settings:
                other_settings.append(member.peer_id)
                continue
            # extrapolate by the peer's rate, at most two heartbeats (it may have stopped)
            elapsed = min(max(0.0, wall - member.last_seen), 2 * self.presence.beat_interval) if not record.averaging else 0.0
            samples = record.samples + member.samples_per_second * elapsed
            steps = record.steps + record.steps_per_second * elapsed
            epoch, averaging = record.epoch, record.averaging
            round_epoch, at = met.get(member.peer_id, (-1, 0.0))
            if round_epoch > epoch and at > member.last_seen:  # a round with it since its record: it is there
                epoch, averaging = round_epoch, False
                since = min(wall - at, 2 * self.presence.beat_interval)
                samples, steps = member.samples_per_second * since, record.steps_per_second * since
            peers.append(PeerProgress(member.peer_id, epoch, samples, steps, member.samples_per_second, averaging))
        self.swarm = SwarmProgress(tuple(peers), taken_at=now, other_settings=tuple(other_settings))
        self._suspect(self.swarm)

    def _suspect(self, swarm: SwarmProgress) -> None:
        implausible = swarm.implausible()
        self.suspicions = {peer.peer_id: f"implausible progress: epoch {peer.epoch}, the swarm's is {swarm.epoch}"
                           for peer in implausible}
        for peer in implausible:
            if (peer.peer_id, peer.epoch) not in self._blamed:
                if len(self._blamed) > 4096:  # bounded: a liar changing its claim every beat is blamed each time
                    self._blamed.clear()
                self._blamed.add((peer.peer_id, peer.epoch))
                self.blame(peer.peer_id, "implausible progress", self.suspicions[peer.peer_id])

    def fresh(self) -> SwarmProgress:
        """A snapshot with this peer's exact counters and others' extrapolated to now."""
        self._snapshot()
        return self.swarm

    def ahead_of(self, epoch: int) -> list[str]:
        """Donors for a peer at ``epoch`` behind the swarm's epoch (``SwarmProgress.ahead``)."""
        return self.fresh().ahead(epoch)

    def rejoin_from(self, epoch: int) -> list[str]:
        """Donors for a peer at ``epoch`` ahead of the swarm on its own (``SwarmProgress.rejoin``)."""
        return self.fresh().rejoin(epoch)

    def others_at(self, epoch: int) -> list[str]:
        return [peer.peer_id for peer in self.fresh().at(epoch) if peer.peer_id != self.peer_id]
