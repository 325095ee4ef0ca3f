"""What a dashboard knows about a run: member rows, run-wide curves and published evaluations.

Pure bookkeeping, fed by the collector with what it read from the DHT and read by the web server;
no network. Every record is a peer's claim (any peer may lie): rows show each member's own claims,
run-wide numbers combine them robustly (a median, a sum with outliers capped), and what any number
of peers can make the dashboard hold is bounded (rows, evaluators, results, history).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from swarmgrad.dashboard.settings import DashboardSettings
from swarmgrad.dht.evaluations import Evaluation, EvaluationRecord
from swarmgrad.dht.membership import MemberRecord, reachability
from swarmgrad.dht.records import SignedRecord

Status = Literal["live", "quiet", "left", "expired"]
ROLE_ORDER = {"peer": 0, "client": 1, "monitor": 2, "bootstrap": 3}
STATUS_ORDER = {"live": 0, "quiet": 1, "left": 2, "expired": 3}
OUTLIER_FACTOR = 100.0  # a rate claim beyond this many times the median one counts as the cap
COUNTERS = ("rounds_ok", "rounds_failed", "bytes_sent", "bytes_received")


def finite(value: Any) -> float | None:
    """``value`` as a JSON-safe float: None unless it is a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def short_id(peer_id: str) -> str:
    return f"{peer_id[:6]}…{peer_id[-6:]}" if len(peer_id) > 14 else peer_id


def robust_sum(values: list[float]) -> float:
    """The sum, with each value capped at OUTLIER_FACTOR x the median: one lying peer among three
    cannot make the swarm look a million times faster."""
    if not values:
        return 0.0
    cap = OUTLIER_FACTOR * statistics.median(values)
    return sum(min(value, cap) for value in values) if cap > 0 else sum(values)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass
class MemberRow:
    peer_id: str
    body: MemberRecord
    expires: float  # the record's signed expiry (the peer's clock)
    first_seen: float  # the dashboard's clock, as every time below
    gone_at: float | None = None  # when the dashboard first saw it left or expired

    def status(self, now: float) -> Status:
        if self.body.state == "left":
            return "left"
        if now >= self.expires:
            return "expired"
        # past half its lifetime without a fresh heartbeat: a peer that missed several in a row
        lifetime = max(1.0, self.expires - self.body.updated_at)
        return "quiet" if now - self.body.updated_at > lifetime / 2 else "live"

    def to_json(self, now: float) -> dict[str, Any]:
        body, progress, stats = self.body, self.body.progress, self.body.stats
        return {
            "peer_id": self.peer_id, "short_id": short_id(self.peer_id), "status": self.status(now),
            "role": body.role, "reachability": reachability(list(body.maddrs)), "version": body.version,
            "maddrs": list(body.maddrs), "step": body.step, "epoch": progress.epoch if progress else None,
            "averaging": progress.averaging if progress else False,
            "samples_per_second": finite(body.samples_per_second),
            "loss": finite(stats.loss) if stats else None,
            "bytes_sent": stats.bytes_sent if stats else None, "bytes_received": stats.bytes_received if stats else None,
            "rounds_ok": stats.rounds_ok if stats else None, "rounds_failed": stats.rounds_failed if stats else None,
            "epsilon": finite(body.epsilon), "last_seen": body.updated_at, "age": max(0.0, now - body.updated_at),
            "first_seen": self.first_seen,
        }


@dataclass
class Evaluator:
    """One peer's published evaluations, as far back as the dashboard has seen them."""

    peer_id: str
    task: str
    results: deque[Evaluation]
    latest: float = -math.inf  # evaluated_at of the newest result kept

    def to_json(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "short_id": short_id(self.peer_id), "task": self.task,
                "results": [{"t": r.evaluated_at, "epoch": r.epoch, "step": r.step, "accuracy": r.accuracy,
                             "loss": finite(r.loss), "samples": r.samples} for r in self.results]}


HISTORY_SERIES = ("t", "members", "training", "samples_per_second", "loss", "epoch", "rounds_ok", "rounds_failed")


@dataclass
class RunState:
    run_id: str
    settings: DashboardSettings
    started_at: float
    rows: dict[str, MemberRow] = field(default_factory=dict)
    evaluators: dict[str, Evaluator] = field(default_factory=dict)
    members_read_at: float | None = None
    evaluations_read_at: float | None = None
    history: dict[str, deque] = field(init=False)
    _counted: dict[str, dict[str, int]] = field(default_factory=dict)  # each member's counters as last added
    _totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def __post_init__(self) -> None:
        self.history = {name: deque(maxlen=self.settings.history_points) for name in HISTORY_SERIES}

    # ---- fed by the collector -------------------------------------------------------------------

    def update_members(self, records: dict[str, SignedRecord[MemberRecord]], now: float) -> None:
        """The run's presence records as just read (left ones included); appends a point to the curves."""
        for owner, record in records.items():
            row = self.rows.get(owner)
            if row is None:
                if record.body.state == "left" or record.expires <= now:
                    continue  # left before we saw it: nothing to show
                row = self.rows[owner] = MemberRow(owner, record.body, record.expires, first_seen=now)
                self._make_room()
            elif record.body.updated_at >= row.body.updated_at:
                if record.body.state == "alive" and row.body.state == "left":
                    row.gone_at = None  # the same peer id is back
                row.body, row.expires = record.body, record.expires
            self._count(owner, row.body)
        for peer_id, row in list(self.rows.items()):
            if row.status(now) in ("left", "expired"):
                row.gone_at = now if row.gone_at is None else row.gone_at
                if now - row.gone_at > self.settings.forget_after:
                    del self.rows[peer_id]
                    self._counted.pop(peer_id, None)  # its rounds stay in the totals
        self.members_read_at = now
        self._add_history_point(now)

    def update_evaluations(self, records: dict[str, EvaluationRecord], now: float) -> None:
        for owner, record in records.items():
            evaluator = self.evaluators.get(owner)
            if evaluator is None:
                evaluator = Evaluator(owner, record.task, deque(maxlen=self.settings.results_per_evaluator))
                self.evaluators[owner] = evaluator
            evaluator.task = record.task
            for result in record.results:  # in order (the schema checks it): only the ones not seen yet
                if result.evaluated_at > evaluator.latest:
                    evaluator.results.append(result)
                    evaluator.latest = result.evaluated_at
        while len(self.evaluators) > self.settings.max_evaluators:  # keep the most recent evaluators
            stalest = min(self.evaluators.values(), key=lambda kept: kept.latest)
            del self.evaluators[stalest.peer_id]
        self.evaluations_read_at = now

    def _make_room(self) -> None:
        while len(self.rows) > self.settings.max_members:
            stalest = min(self.rows.values(), key=lambda row: (row.gone_at is None, row.body.updated_at))
            del self.rows[stalest.peer_id]
            self._counted.pop(stalest.peer_id, None)

    def _count(self, peer_id: str, body: MemberRecord) -> None:
        """Add what a member's counters grew by since last read (all of them when it restarted)."""
        if body.stats is None:
            return
        before = self._counted.get(peer_id, {})
        now = {name: getattr(body.stats, name) for name in COUNTERS}
        for name, value in now.items():
            previous = before.get(name, 0)
            self._totals[name] += value - previous if value >= previous else value
        self._counted[peer_id] = now

    def _add_history_point(self, now: float) -> None:
        present = [row for row in self.rows.values() if row.status(now) in ("live", "quiet")]
        training = [row for row in present if row.body.progress is not None]
        losses = [row.body.stats.loss for row in training if row.body.stats and row.body.stats.loss is not None]
        point = {"t": now, "members": len(present), "training": len(training),
                 "samples_per_second": robust_sum([row.body.samples_per_second for row in training]),
                 "loss": median(losses), "epoch": median([row.body.progress.epoch for row in training]),
                 "rounds_ok": self._totals["rounds_ok"], "rounds_failed": self._totals["rounds_failed"]}
        for name, value in point.items():
            self.history[name].append(value)

    # ---- read by the server ---------------------------------------------------------------------

    def members_json(self, now: float) -> list[dict[str, Any]]:
        rows = [row.to_json(now) for row in self.rows.values()]
        return sorted(rows, key=lambda row: (STATUS_ORDER[row["status"]], ROLE_ORDER.get(row["role"], 9),
                                             row["peer_id"]))

    def latest_evaluation(self) -> dict[str, Any] | None:
        newest = max(self.evaluators.values(), key=lambda kept: kept.latest, default=None)
        if newest is None or not newest.results:
            return None
        result = newest.results[-1]
        return {"peer_id": newest.peer_id, "short_id": short_id(newest.peer_id), "t": result.evaluated_at,
                "epoch": result.epoch, "accuracy": result.accuracy, "loss": finite(result.loss)}

    def summary(self, now: float) -> dict[str, Any]:
        history = {name: series[-1] if series else None for name, series in self.history.items()}
        return {"members": history["members"] or 0, "training": history["training"] or 0,
                "samples_per_second": finite(history["samples_per_second"]), "loss": finite(history["loss"]),
                "epoch": finite(history["epoch"]), "rounds_ok": self._totals["rounds_ok"],
                "rounds_failed": self._totals["rounds_failed"], "bytes_sent": self._totals["bytes_sent"],
                "bytes_received": self._totals["bytes_received"], "evaluation": self.latest_evaluation()}

    def message(self, now: float) -> str | None:
        """What the page says when there is nothing to show (an unknown run id is an empty run, not an error)."""
        if self.members_read_at is None:
            return f"Joining the swarm and reading run {self.run_id!r}…"
        # monitors (this dashboard among them) and bootstrap nodes do not make a run
        peers = [row for row in self.rows.values() if row.body.role in ("peer", "client")]
        if not peers and not self.evaluators:
            return (f"No peers of run {self.run_id!r} found. Check the run id; this page keeps looking "
                    f"(every {self.settings.members_every:g} s).")
        if not any(row.status(now) in ("live", "quiet") for row in peers):
            return f"No peer of run {self.run_id!r} is training right now; every one seen has left."
        return None

    def history_json(self) -> dict[str, list]:
        return {name: [finite(value) if name != "t" else value for value in series]
                for name, series in self.history.items()}

    def evaluations_json(self) -> list[dict[str, Any]]:
        ordered = sorted(self.evaluators.values(), key=lambda kept: -kept.latest)
        return [evaluator.to_json() for evaluator in ordered if evaluator.results]
