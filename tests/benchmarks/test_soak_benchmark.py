"""The soak's 3-minute form end to end (issue 38, item 4): real ``swarmgrad bootstrap`` and ``swarmgrad
peer`` processes on loopback, the hour's schedule compressed (kills every 45 s, the floor; the
bootstrap node dies at 60 s; a newcomer joins through a member at 75 s). It checks what the
schedule is for, not the hour's slopes (3 minutes of samples on a loaded CI machine say nothing
about growth per hour): the swarm keeps averaging after its bootstrap node died, the newcomer gets
in through a member, every process (Python and p2pd) is sampled, and no process holds a file
descriptor or thread count that only a leak reaches. The full hour: ``python benchmarks/soak.py``.
Marked slow: about 5 minutes with the peers' start and shutdown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
# the most any process held in a 3-minute run here: 23 fds, 11 threads; a leak of one per round (a few
# hundred rounds per peer in 3 minutes) exceeds these bounds, a slower one shows only in the hour run
MAX_FDS, MAX_THREADS = 400, 200


@pytest.mark.slow
@pytest.mark.timeout(600)  # above the run's own 540 s limit, so that one can fire and say why
def test_three_minute_soak_goes_on_without_its_bootstrap_and_lets_a_newcomer_in(tmp_path):
    plot = tmp_path / "soak.png"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--minutes", "3", "--peers", "4", "--json",
                           "--plot", str(plot)], capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["schedule"]["bootstrap_dies"] == 60 and report["schedule"]["late_join"] == 75
    assert [what for _, what in report["timeline"]].count("bootstrap dies") == 1
    # kills every 45 s (the floor), always the last peer: the others live the whole run
    restarts = [what for _, what in report["timeline"] if what.startswith("restart")]
    assert len(restarts) >= 3 and set(restarts) == {"restart peer3"}, report["timeline"]
    assert report["unexpected_exits"] == []  # only the churner and the bootstrap are ended, by the soak
    assert report["rounds_after_bootstrap_died"] > 0, report["incarnations"]
    late = [entry for name, entry in report["incarnations"].items() if name.startswith("late")]
    assert late and late[0]["rounds_ok"] + late[0]["rounds_failed"] > 0, report["incarnations"]  # it got in
    sampled = {row["process"] for row in report["samples"]}
    assert "bootstrap" in sampled and "bootstrap/p2pd" in sampled and any(p.startswith("late") for p in sampled)
    assert max(row["fds"] for row in report["samples"]) < MAX_FDS
    assert max(row["threads"] for row in report["samples"]) < MAX_THREADS
    assert plot.stat().st_size > 10_000


def test_a_stall_is_told_with_what_moved_across_it_and_a_restarted_peers_first_swarm_step_is_warm_up():
    """The soak's stall accounting on made-up progress events: the longest gap in which the step did
    not move, what the peer's counters did across it, and the same after the warm-up (a fifth of it
    into a process's life), which leaves out the first swarm step of a peer that took the state."""
    sys.path.insert(0, str(BENCHMARK.parent))
    import soak

    proc = soak.Proc.__new__(soak.Proc)
    proc.name, proc.started, proc.round_errors, proc.log = "peer1#1", 100.0, soak.Counter(), None
    proc.stderr = []
    for line in ("round 12: failed (no group formed this round; tensors unchanged), 1 peers, 2.0 s",
                 "round 13: failed (deadline of 5.0 s passed; next deadline 10.0 s), 3 peers, 7.1 s",
                 "round 14: failed (deadline of 10.0 s passed; next deadline 20.0 s), 3 peers, 12.0 s",
                 "round 15: ok, 3 peers, 0.2 s"):
        proc._stderr(line)
    events = [(101.0, {"step": 0}), (102.0, {"step": 5, "state_downloads": 0, "epoch": 0}),
              (125.0, {"step": 6, "state_downloads": 1, "epoch": 7}),  # 23 s: its first swarm step took the state
              (130.0, {"step": 20, "rounds_ok": 3, "epoch": 9}), (140.0, {"step": 21, "rounds_ok": 4, "epoch": 10}),
              (141.0, {"step": 30, "rounds_ok": 4, "epoch": 10})]
    proc.events = events
    slot = soak.PeerSlot("peer1", [], [proc])
    entry = soak.stalls_and_rounds([slot], began=0.0, warm_up=50.0)["peer1#1"]  # counted from 110 s
    assert entry["longest_stall"] == 23.0 and entry["stall"]["moved"] == {"state_downloads": 1, "epoch": 7}
    assert entry["longest_stall_after_warm_up"] == 10.0  # 130 -> 140, a round
    assert entry["stall_after_warm_up"]["moved"] == {"rounds_ok": 1, "epoch": 1}
    # failed rounds counted by kind from the peer's log, numbers left out
    assert entry["round_errors"] == {"deadline of # s passed; next deadline # s": 2,
                                     "no group formed this round; tensors unchanged": 1}


def test_every_process_gets_the_whole_warm_up_before_its_slopes_count():
    """A process restarted mid-soak is measured from ``warm_up`` after its own start, as the first
    ones are from the soak's: its allocator's first minutes are growth that is not a leak."""
    sys.path.insert(0, str(BENCHMARK.parent))
    import soak

    # restarted at 300 s: +100 MB over its first 600 s (warming up), flat after
    rows = [{"process": "peer1#1", "t": t, "rss": 400e6 + min(t - 300.0, 600.0) / 600.0 * 100e6, "fds": 20,
             "threads": 8} for t in range(310, 1800, 30)]
    entry = soak.slopes(rows, {"peer1#1": 300.0}, warm_up=600.0)["peer1#1"]
    assert entry["samples"] == len([t for t in range(310, 1800, 30) if t >= 900])
    assert abs(entry["rss_pct_per_hour"]) < 1e-6  # flat once warm; counted from 2 min, it would be ~40%/h
