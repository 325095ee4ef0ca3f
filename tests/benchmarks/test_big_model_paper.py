"""1B and 7B on paper (benchmarks/big_model_paper.py): its inputs come from the measured report, the
CPU's share of a round from the quiet rounds where the report has them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import big_model_paper as paper  # noqa: E402

MBPS = 100.0
RATE = MBPS * 1e6 / 8
PARAMS = 200_000_000


def _case(quiet: float | None) -> dict:
    starter = {"role": "starter", "round_s": 27.0, "quiet_round_s": quiet, "wire_s": 16.0, "round_mb_sent": 200.0,
               "round_mb_received": 190.0, "steady_bytes_per_param": 10.5, "peak_bytes_per_param": 12.5}
    joiner = {"role": "joiner", "download_bytes": 3.2e9, "download_s": 3.2e9 / RATE / 0.8, "verify_s": 5.0}
    return {"network": "lab", "codec": "int8", "params": PARAMS, "status": "ok",
            "peers": [dict(starter), dict(starter), joiner]}


def test_the_cpu_share_is_the_quiet_round_less_its_wire_where_measured():
    measured = paper.inputs([_case(quiet=19.0)], "int8", MBPS)
    assert measured["lab_round"] == "quiet_round_s" and measured["lab_round_s"] == 19.0
    assert measured["cpu_s_per_param"] == pytest.approx((19.0 - 16.0) / PARAMS)
    assert measured["wire_bytes_per_param"] == pytest.approx(1.0)  # the busier direction: 200 MB
    assert measured["download_efficiency"] == pytest.approx(0.8)
    # an older report, without quiet rounds: every round
    older = paper.inputs([_case(quiet=None)], "int8", MBPS)
    assert older["lab_round"] == "round_s" and older["cpu_s_per_param"] == pytest.approx((27.0 - 16.0) / PARAMS)


def test_the_table_scales_the_measured_costs_to_the_sizes_asked_for():
    text = paper.table([_case(quiet=19.0)], [1e9], [100.0], MBPS)
    # 1B: RAM 10.5 / 12.5 B/param; round 3/200M s per param x 1B + 1 B/param at 12.5 MB/s = 15 + 80 s
    assert "| int8 | 1B | 100 Mbit/s | 10 / 12 GB | 16 GB | 1.6 min |" in text
    assert "quiet rounds" in text
