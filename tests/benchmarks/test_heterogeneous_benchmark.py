"""benchmarks/heterogeneous.py's own logic: the two swarms it runs and the figures and verdicts it
draws from the peers' progress events. The lab runs themselves take minutes and need root (their
numbers are in the issue note)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import heterogeneous as het


def test_the_slow_swarm_is_the_even_one_plus_a_ten_times_slower_last_peer():
    even, slow = het.scenario(False, 60.0, "digits"), het.scenario(True, 60.0, "digits")
    assert [p.slowdown for p in even.expanded_peers()] == [1.0] * 3
    assert [p.slowdown for p in slow.expanded_peers()] == [1.0, 1.0, 1.0, 10.0]
    for scenario in (even, slow):  # DiLoCo's defaults: nothing but the strategy and averaging named
        assert scenario.strategy == "diloco" and scenario.inner_steps is None and scenario.churn == []
        assert scenario.run_config.strategy.inner_steps == 50


def progress(peer: int, t: float, samples: int, averaged: int = 0, start: int = 1) -> dict:
    return {"lab_peer": peer, "lab_start": start, "event": "progress", "t": t, "samples": samples,
            "samples_averaged": averaged, "epoch": 1, "rounds_ok": 1, "rounds_failed": 0, "rounds_replayed": 0,
            "state_downloads": 0, "solo_steps": 0, "no_shows": {"x": 2}}


def test_rates_count_after_the_warm_up_and_the_share_is_the_last_reports():
    events = [{"lab_peer": 0, "lab_start": 1, "event": "ready", "t": 100.0},
              progress(0, 101.0, 5000),  # inside the warm-up (20% of 50 s): left out of the rate
              progress(0, 110.0, 6000), progress(0, 130.0, 10000),
              progress(1, 130.0, 999, start=2),  # a restart's reports are not the first start's
              progress(3, 112.0, 100, 0), progress(3, 140.0, 400, 300)]
    figures = het.peer_figures(events, duration=50.0)
    assert figures[0]["samples_per_second"] == 200.0 and figures[0]["no_shows"] == 2
    assert 1 not in figures
    assert figures[3]["averaged_share"] == 0.75 and figures[3]["samples_per_second"] == 300 / 28


def test_verdicts_meet_or_miss_the_bars():
    def fast(rate: float) -> dict:
        return {"samples_per_second": rate}

    slow = {"samples_per_second": 10.0, "averaged_share": 0.85}
    met = het.verdicts({0: fast(95), 1: fast(90), 2: fast(100), 3: slow}, {0: fast(100), 1: fast(100), 2: fast(100)})
    assert abs(met["fast_rate_ratio"] - 0.95) < 1e-9 and met["fast_rate_ratio_met"] and met["slow_averaged_share_met"]
    missed = het.verdicts({0: fast(80), 1: fast(80), 2: fast(80), 3: {**slow, "averaged_share": 0.5}},
                          {0: fast(100), 1: fast(100), 2: fast(100)})
    assert missed["fast_rate_ratio_met"] is False and missed["slow_averaged_share_met"] is False
    unknown = het.verdicts({0: fast(80), 1: {"samples_per_second": None}, 2: fast(80)}, {})
    assert unknown["fast_rate_ratio"] is None and unknown["slow_averaged_share"] is None
    assert [check["ok"] for check in het.checks(unknown)] == [False, False]
