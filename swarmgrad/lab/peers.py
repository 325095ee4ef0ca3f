"""The lab driver's per-peer plumbing: what it knows about each peer process, and reading from it.

:class:`LabPeer` holds one peer's process (one generation per start), what it reported, and the
estimate of its averaging round behind the hung-peer watch; :func:`follow_lines` is the reader
thread that feeds a process's stdout to the driver; :func:`tail_log` quotes the end of its log.
"""

from __future__ import annotations

import queue
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from swarmgrad.lab.scenario import PeerSpec
from swarmgrad.timing import DEFAULT_TIMING

# hung-peer watch: a peer is hung when silent for HANG_FACTOR of its round deadline
HANG_FACTOR = 3.0


@dataclass
class LabPeer:
    """The driver's view of peer ``index``: its process (one generation per start) and what it reported."""

    index: int
    spec: PeerSpec
    peer_id: str
    identity: Path
    checkpoint_dir: Path
    log_path: Path
    process: subprocess.Popen | None = None
    generation: int = 0
    state: str = "waiting"  # waiting -> starting -> running -> done | exited | killed
    started_at: float | None = None
    last_event_t: float | None = None  # of the current generation
    last_progress_t: float | None = None
    last_progress_epoch: int | None = None
    round_estimate: float | None = None
    reported_deadline: float | None = None  # its status's round_deadline (from the round's bytes and rate)
    hung: bool = False
    evaluating: bool = False  # its last progress report said an evaluation follows (silence is expected)
    rounds_total: int = 0  # rounds_ok over all generations (a restart starts its counter at 0)
    rounds_this_gen: int = 0
    reported_loss: bool = False  # this generation reported a finite loss
    history: list[dict] = field(default_factory=list)  # (generation, t, epoch, state_downloads, rounds_total)
    exited_at: dict[int, float] = field(default_factory=dict)  # generation -> when it was seen to exit by itself

    def learn_round(self, seconds: float) -> None:
        """Fold one observed round length into the estimate (a moving average)."""
        self.round_estimate = seconds if self.round_estimate is None else 0.7 * self.round_estimate + 0.3 * seconds

    def round_deadline(self) -> float:
        """How long the peer's round may take: the deadline it reports, and at least ``round_slack`` x
        the rounds seen from here (which include matchmaking) or, before any, a first round's least."""
        timing = DEFAULT_TIMING  # the lab's peers run with the default timing
        seen = timing.round_slack * self.round_estimate if self.round_estimate is not None else \
            timing.first_round_deadline
        return max(timing.min_round_deadline, self.reported_deadline or 0.0, seen)


def follow_lines(stream: IO[bytes], index: int, generation: int, lines: queue.Queue) -> None:
    """Reader thread: one process's stdout lines into the queue, then None at EOF."""
    try:
        for line in iter(stream.readline, b""):
            lines.put((index, generation, line))
    except (OSError, ValueError):
        pass
    finally:
        lines.put((index, generation, None))
        stream.close()


def tail_log(path: Path, lines: int = 3) -> str:
    """The last ``lines`` non-blank lines of a log, joined on one line for an error message."""
    try:
        text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(line.strip() for line in text[-lines:]) or "(empty)"


__all__ = ["HANG_FACTOR", "LabPeer", "follow_lines", "tail_log"]
