"""The attack benchmark's quick form end to end: real ``swarmgrad peer`` processes (real p2pd, a real
DHT, loopback) train digits, clean and with one peer of four sending its update x100, both under
the run's defaults; the JSON report holds both rows, and the defended row's honest peers end close
to the clean run, with the attacker clipped or banned. (With ``--aggregators mean`` in place of the
defaults, ``defended_check`` fails: the honest peers' accuracy collapses and nothing is clipped.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "attacks.py"
# ~20 rounds in 10 s on a loaded machine. Pairs once let the attacker through (a round of two cannot
# out-vote it): beside a busy core 2 of 16 runs ended 37 and 73 points under clean, and a CI run 79.
# With no pairs while three are here (invitations.quorum) and groupmates counted at their epoch
# (ProgressTracker.met), 12 of 12 ended within 2 points of clean with no failed round; the same
# attack under mean ends 59 to 88 points under it. The margin tells the two apart; issue 15's own bar
# (2 points, 8 peers) is judged by the full benchmark, not here.
TOLERANCE = 0.20


def numbers(value: Any) -> list[float]:
    """Every number in a JSON value, nested."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    items = value.values() if isinstance(value, dict) else value
    return [number for item in items for number in numbers(item)]


def row(report: dict[str, Any], attack: str) -> dict[str, Any]:
    found = [entry for entry in report["rows"] if entry["attack"] == attack]
    assert len(found) == 1, report["rows"]
    assert "error" not in found[0], found[0]
    return found[0]


def defended_check(report: dict[str, Any]) -> None:
    """The scaled attacker leaves the honest peers within ``TOLERANCE`` of the clean run, and their
    aggregation bounded it (clipped its contribution, or banned it)."""
    clean, attacked = row(report, "clean"), row(report, "scaled")
    assert attacked["attackers"] == 1 and attacked["honest_peers"] == 3, attacked
    assert attacked["attacker_rounds_ok"] >= 1, json.dumps(attacked)  # the attack reached the honest peers
    assert attacked["accuracy_median"] >= clean["accuracy_median"] - TOLERANCE, (clean, attacked)
    assert attacked["attacker_clipped"] > 0 or attacked["attackers_banned"] > 0, json.dumps(attacked)
    assert attacked["honest_banned"] == 0, attacked


def test_quick_attack_benchmark_reports_the_defence():
    done = subprocess.run([sys.executable, str(BENCHMARK), "--quick", "--json"], capture_output=True, text=True,
                          timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert [(entry["attack"], entry["aggregator"]) for entry in report["rows"]] == \
        [("clean", "defaults"), ("scaled", "defaults")], report["rows"]
    assert all(math.isfinite(number) for number in numbers(report)), report
    clean = row(report, "clean")
    assert clean["attackers"] == 0 and clean["honest_peers"] == 4, clean
    for entry in report["rows"]:  # every honest peer trained with the others and learned
        assert entry["rounds_ok"] >= 1 and entry["epoch_median"] >= 1, entry
        assert len(entry["accuracies"]) == entry["honest_peers"] and not entry["crashed"], entry
    assert clean["accuracy_median"] >= 0.8, clean
    defended_check(report)


def test_repeated_clean_rows_are_judged_on_their_medians():
    """``--repeats``: the clean rows run that many times, the aggregators taking turns, and the bars
    use their medians (one slow clean run no longer decides the overhead). The rows here are made up:
    what is tested is the arithmetic over them, not a run."""
    sys.path.insert(0, str(BENCHMARK.parent))
    import attacks

    rows = attacks.plan(["scaled"], ["mean", attacks.DEFAULTS], ["mean", attacks.DEFAULTS], repeats=3)
    assert [(r.attack, r.aggregator) for r in rows] == [(None, "mean"), (None, "defaults")] * 3 + [
        ("scaled", "mean"), ("scaled", "defaults")]

    def clean(aggregator: str, accuracy: float, seconds: float | None, round_s: float) -> dict[str, Any]:
        return {"attack": "clean", "aggregator": aggregator, "accuracy_median": accuracy,
                "time_to_target": seconds, "round_seconds": round_s}

    results = [clean("mean", 0.97, 3.0, 1.0), clean("defaults", 0.96, 9.0, 1.2),
               clean("mean", 0.96, 4.0, 1.1), clean("defaults", 0.97, 3.5, 1.1),
               clean("mean", 0.95, 5.0, 0.9), clean("defaults", 0.98, 4.2, 1.0),
               {"attack": "scaled", "aggregator": "defaults", "accuracy_median": 0.955, "crashed": {}}]
    over = attacks.overhead(results)
    assert over["time_to_target_defaults"] == 4.2 and over["time_to_target_mean"] == 4.0  # not 9.0 vs 3.0
    assert math.isclose(over["time_ratio"], 1.05) and over["clean_runs"] == 3
    assert math.isclose(over["round_ratio"], 1.1)
    found = {check["check"]: check for check in attacks.checks(results, over)}
    assert found["scaled under the defaults: within 2 points of clean"]["ok"]  # 95.5 vs the median 97
    assert found["no attackers: the defaults reach the target within 10% of mean's time"]["ok"]
    results[-1]["accuracy_median"] = 0.945
    assert not attacks.checks(results, over)[0]["ok"]
    results.append(clean("defaults", 0.90, None, 1.0))  # a run that never reached the target counts for accuracy
    assert attacks.clean_medians(results)["defaults"] == {"accuracy_median": 0.965, "time_to_target": 4.2,
                                                          "round_seconds": 1.05, "runs": 4}


def test_rows_take_any_registered_rule_by_name():
    """``--aggregators`` names rules from the registry, each row's peers then run ``--aggregator NAME``:
    no rule is known to the benchmark by itself."""
    sys.path.insert(0, str(BENCHMARK.parent))
    import attacks

    from swarmgrad.averaging.rules import RULE_NAMES

    assert attacks.parse_aggregators(f"{attacks.DEFAULTS}, {','.join(RULE_NAMES)}") == [attacks.DEFAULTS, *RULE_NAMES]
    for bad in ("krum", "", "defaults,krum"):
        with pytest.raises(ValueError, match="--aggregators must name defaults and/or rules from centered-clip, mean"):
            attacks.parse_aggregators(bad)
    layout = attacks.Layout(task="digits", peers=4, attackers=1, seconds=10.0, inner_steps=10, eval_every=0.5,
                            target=0.9, join_after=2.5)
    rows = attacks.plan(["scaled"], ["median"], ["median"])
    assert [(row.attack, row.aggregator) for row in rows] == [(None, "median"), ("scaled", "median")]
    argv = attacks.peer_argv(layout, rows[1], "run", "/ip4/127.0.0.1/tcp/1", 0, 4, "scaled")
    assert argv[argv.index("--aggregator") + 1] == "median"
    defaults = attacks.peer_argv(layout, attacks.Row(None, attacks.DEFAULTS), "run", "/ip4/127.0.0.1/tcp/1", 0, 4, None)
    assert "--aggregator" not in defaults
