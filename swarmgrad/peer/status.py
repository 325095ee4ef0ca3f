"""``Peer.status()``: what a peer reports about itself, for training loops, ``swarmgrad status``, the
dashboard, the soak benchmark and the ``--json`` progress events (``to_json``)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class PeerStatus:
    """What ``peer.status()`` returns; ``to_json()`` for scripts and event streams."""

    peer_id: str
    run_id: str
    step: int  # local optimizer steps (or accumulation steps) so far
    epoch: int  # swarm steps taken part in (or caught up to)
    samples: int  # samples trained on by this peer
    samples_per_second: float
    loss: float | None  # smoothed training loss, when step() was given one
    epsilon: float | None  # privacy spent so far, when privacy is on
    peers: int  # peers seen in the run's progress with this peer's settings (this one included)
    rounds_ok: int = 0
    rounds_failed: int = 0
    solo_steps: int = 0  # epochs finished alone (nobody to average with)
    # of ``samples``, those sent in rounds that succeeded (carried ones included), less the share of
    # each contribution the owners' robust rule left out (``RoundReport.rejected_share``)
    samples_averaged: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    state_downloads: int = 0
    rounds_replayed: int = 0  # rounds it missed and applied afterwards, from a peer that kept their result
    epsilon_local: float | None = None  # one release seen alone (update level with noise shares: > epsilon)
    rounds_overlapped: int = 0  # rounds that travelled while the next inner phase ran (overlap.py)
    settings: str = ""  # digest of the run settings this peer trains with
    warning: str | None = None  # why this peer trains alone, when it can tell
    paused: bool = False  # peer.pause() (SIGUSR1): no rounds, no training, until resume()
    reachability: str = "public"  # how others reach it: public, relayed (behind a NAT) or client
    rounds_unreachable: int = 0  # rounds sat out: nobody in its group publishes an address to reach it by
    last_report: dict[str, Any] | None = None
    refused_records: int = 0  # private run: member records of peers without a valid ticket, ignored
    refused_streams: int = 0  # private run: their streams, refused
    banned: dict[str, float] = field(default_factory=dict)  # peers banned here for misbehaviour -> seconds left
    # host bytes the swarm's work holds beyond the model, its gradients and the optimizer, by holder
    # (outer_start, outer_momentum, contribution, flight, error_feedback, result, kept_results, served_state_copies)
    swarm_memory: dict[str, int] = field(default_factory=dict)
    kept_results_on_disk: int = 0  # bytes of round results kept for replays, in temporary files (state/kept.py)
    round_deadline: float | None = None  # seconds a round like the last may take now (moshpit; timing.py RoundTimer)
    round_rate_mbps: float | None = None  # the rate it assumes: measured by rounds, else Timing.assumed_rate_mbps
    # members that were waited for in a round and never declared -> how often (averaging/attendance.py);
    # ``absent``: those of them not seen alive since, which matchmaking does not wait for
    no_shows: dict[str, int] = field(default_factory=dict)
    absent: list[str] = field(default_factory=list)
    # addresses a newcomer can join through (this peer's own if public, then members seen recently):
    # any public member is an entry point, so the run outlives its bootstrap node
    entry_points: list[str] = field(default_factory=list)
    longest_round: float = 0.0  # seconds the longest round took, matchmaking included
    longest_allreduce: float = 0.0  # seconds the longest all-reduce took (what round_deadline bounds)
    asyncio_tasks: int | None = None  # tasks on the peer's event loop now (a soak watches they stay flat)
    device_bytes: int = 0  # bytes that crossed between the training device and the host (device/boundary.py)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("loss", "epsilon", "epsilon_local"):
            if data[key] is not None and not math.isfinite(data[key]):
                data[key] = None
        return data
