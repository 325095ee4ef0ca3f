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
    assert report["rounds_after_bootstrap_died"] > 0, report["incarnations"]
    late = [entry for name, entry in report["incarnations"].items() if name.startswith("late")]
    assert late and late[0]["rounds_ok"] + late[0]["rounds_failed"] > 0, report["incarnations"]  # it got in
    sampled = {row["process"] for row in report["samples"]}
    assert "bootstrap" in sampled and "bootstrap/p2pd" in sampled and any(p.startswith("late") for p in sampled)
    assert max(row["fds"] for row in report["samples"]) < MAX_FDS
    assert max(row["threads"] for row in report["samples"]) < MAX_THREADS
    assert plot.stat().st_size > 10_000
