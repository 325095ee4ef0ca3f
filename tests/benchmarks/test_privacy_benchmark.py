"""The privacy benchmark's quick form end to end: 4 real ``swarmgrad peer`` processes (real p2pd, a real
DHT, loopback) train fashion-mnist with per-sample DP at a target epsilon, one process runs Opacus DP-SGD
at the same target, and the peers train at the README's update-level values with noise shares. The
full comparison (issue 39's bars: within 2 points of Opacus at epsilon 3 and 8, 80% at the update
level) is the full benchmark's; this checks that every row runs and accounts what it claims."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "privacy.py"


@pytest.mark.slow  # 2-3 minutes on a loaded 2-core host: 4 real peers twice and one Opacus process
@pytest.mark.timeout(480)  # above the run's own 420 s, so that one fires first and says why
def test_quick_privacy_benchmark_accounts_every_row():
    result = subprocess.run([sys.executable, str(BENCHMARK), "--quick", "--json"], capture_output=True, text=True,
                            timeout=420)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    rows = {row["setting"]: row for row in report["rows"]}
    assert set(rows) == {"sample", "opacus", "update"}, report["rows"]
    sample, opacus, update = rows["sample"], rows["opacus"], rows["update"]
    # each peer's noise was derived for its own shard and steps: it spent (almost) exactly the target
    for row in (sample, opacus):
        assert row["target_epsilon"] == 8.0 and 7.0 < row["epsilon"] <= 8.0 + 1e-6, row
        assert 0.3 < row["accuracy"] <= 1.0, row  # far above chance (0.1) after a few dozen noisy steps
    # the update level's noise is split over 4 peers: one release alone is far less private than the average
    assert update["noise_multiplier"] == 0.02
    assert math.isfinite(update["epsilon"]) and update["epsilon_local"] > 2 * update["epsilon"], update
    # the update-level noise went through real averages: the median peer averaged at least once. How
    # many of the run's 5 rounds form depends on the host (3-4 of 5 here, loaded or not; 1 under CI's
    # load); rounds under load are the peer tests' subject, not this accounting check's
    assert update["rounds_ok"] >= 1 and update["accuracy"] > 0.3, update["peers"]
    assert [check["check"] for check in report["checks"]][-1].startswith("update level"), report["checks"]
