"""Events that demo peers print as JSON lines on stdout, and the run log the demo builds from them.

Peers are separate processes that may print anything (a stray log line, a half-written line when killed),
so parsing never raises: a line that is not a known event is dropped.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

KINDS = frozenset({"ready", "progress", "eval", "done", "error"})


def parse_event(line: bytes | str) -> dict | None:
    """One event from one stdout line, or None for anything that is not a well-formed event of a known kind."""
    try:
        if isinstance(line, bytes):
            line = line.decode()
        event = json.loads(line)
    except (UnicodeDecodeError, ValueError, TypeError):
        return None
    if not isinstance(event, dict) or event.get("event") not in KINDS:
        return None
    if number(event.get("t")) is None or not isinstance(event.get("peer_id"), str):
        return None
    return event


def number(value: Any, default: float | None = None) -> float | None:
    """``value`` as a finite float, else ``default``: events come from other processes and may hold anything."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return default
    return float(value)


def integer(value: Any, default: int = 0) -> int:
    result = number(value)
    return default if result is None else int(result)


@dataclass
class PeerState:
    """What the demo knows about one peer: its lifecycle state and the latest event of each kind."""

    peer_id: str
    state: str = "ready"  # ready -> training -> done | error
    maddrs: list[str] = field(default_factory=list)
    progress: dict | None = None  # latest progress event
    done: dict | None = None
    error: str | None = None
    # (seconds since start, training loss) per progress event, for the plot
    losses: list[tuple[float, float]] = field(default_factory=list)

    @property
    def step(self) -> int:
        return integer(self._latest("step"))

    @property
    def epoch(self) -> int:
        return integer(self._latest("epoch"))

    def stat(self, key: str, default: float | None = None) -> float | None:
        """A numeric field of the latest progress event."""
        return number(self.progress.get(key), default) if self.progress else default

    def _latest(self, key: str) -> Any:
        # `done` carries the final step/epoch, which may be newer than the last progress report
        for event in (self.done, self.progress):
            if event is not None and key in event:
                return event[key]
        return None


class RunLog:
    """Every event of one demo run, grouped per peer; times are unix seconds, ``started_at`` included."""

    def __init__(self, started_at: float):
        self.started_at = started_at
        self.peers: dict[str, PeerState] = {}  # in order of first appearance
        self.evals: list[dict] = []  # in order of arrival
        self.last_t: float = started_at

    def add_line(self, line: bytes | str) -> dict | None:
        """Parse and add one stdout line; returns the event, or None if the line was ignored."""
        event = parse_event(line)
        if event is not None:
            self.add(event)
        return event

    def add(self, event: dict) -> None:
        peer = self.peers.setdefault(event["peer_id"], PeerState(event["peer_id"]))
        kind, t = event["event"], float(event["t"])
        self.last_t = max(self.last_t, t)
        if kind == "ready":
            peer.maddrs = [str(maddr) for maddr in event.get("maddrs") or []]
        elif kind == "progress":
            peer.progress = event
            if peer.state == "ready":  # a late progress line must not revive a peer that is done
                peer.state = "training"
            loss = number(event.get("loss"))
            if loss is not None:
                peer.losses.append((t - self.started_at, loss))
        elif kind == "eval":
            if number(event.get("accuracy")) is not None:
                self.evals.append(event)
        elif kind == "done":
            peer.done = event
            if peer.state != "error":  # keep the error visible; the reason is kept in `done`
                peer.state = "done"
        elif kind == "error":
            peer.state, peer.error = "error", str(event.get("message", ""))

    def seconds(self, t: float) -> float:
        return t - self.started_at

    def sorted_evals(self) -> list[dict]:
        """Evals by time: lines from different peers may arrive slightly out of order."""
        return sorted(self.evals, key=lambda event: float(event["t"]))

    def latest_eval(self) -> dict | None:
        return max(self.evals, key=lambda event: float(event["t"]), default=None)

    def best_accuracy(self) -> float | None:
        """Best held-out accuracy seen, final evaluations included."""
        accuracies = [number(event["accuracy"]) for event in self.evals]
        accuracies += [number(final.get("accuracy")) for final in self.finals()]
        return max((accuracy for accuracy in accuracies if accuracy is not None), default=None)

    def finals(self) -> list[dict]:
        """``done.final`` results by time of the done event."""
        dones = sorted((peer.done for peer in self.peers.values() if peer.done), key=lambda event: float(event["t"]))
        return [event["final"] for event in dones if isinstance(event.get("final"), dict)]
