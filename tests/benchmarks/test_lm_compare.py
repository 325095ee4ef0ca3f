"""benchmarks/lm_compare.py's own logic: the swarm it builds, time to a target loss, and its ratios
(the benchmark runs whole swarms for many minutes; its numbers are in the issue notes), plus the
seconds-long single-process leg."""

from __future__ import annotations

import math
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import lm_compare  # noqa: E402


def test_the_scenario_is_four_lm_peers_on_each_network():
    args = lm_compare.parse_args([])
    loop, slow = lm_compare.scenario(args, "loopback"), lm_compare.scenario(args, "10mbit")
    assert loop.run_config.task == "lm" and loop.run_config.task_options == {"size": "medium", "context": 64}
    assert len(loop.expanded_peers()) == len(slow.expanded_peers()) == 4
    assert all(p.link().up_mbit == math.inf and p.link().delay_ms == 0 for p in loop.expanded_peers())
    assert all(p.up_mbit == p.down_mbit == 10 for p in slow.expanded_peers())
    assert loop.run_config.strategy.name == slow.run_config.strategy.name == "diloco"
    assert loop.run_config.strategy.inner_steps == 20 and loop.batch_size == 8
    # sync: a swarm step per 4 x 8 samples, the single process's batch
    synced = lm_compare.scenario(lm_compare.parse_args(["--strategy", "sync"]), "loopback")
    assert synced.run_config.strategy.name == "sync" and synced.run_config.strategy.target_batch_size == 32
    assert loop.run_config.hparams == {"batch_size": 8, "warmup_steps": 0, "decay_steps": 0}  # hivemind: no schedule


def test_time_to_loss_takes_the_first_evaluation_at_or_below_the_target():
    curve = [(10.0, 4.0), (20.0, None), (30.0, 2.6), (40.0, 2.5), (50.0, 2.7)]
    assert lm_compare.time_to_loss(curve, 2.6) == 30.0
    assert lm_compare.time_to_loss(curve, 2.0) is None


def entry(system: str, network: str, seconds: float | None, training: float = 900.0) -> dict:
    return {"system": system, "network": network, "error": None, "seconds_to_target": seconds,
            "training_seconds": training}


def test_ratios_meet_miss_and_bound():
    results = {"swarmgrad/loopback": entry("swarmgrad", "loopback", 100.0),
               "hivemind/loopback": entry("hivemind", "loopback", 250.0),
               "single/none": entry("single", "none", 90.0),
               "swarmgrad/10mbit": entry("swarmgrad", "10mbit", None, 900.0),
               "hivemind/10mbit": entry("hivemind", "10mbit", None, 900.0)}
    loop = lm_compare.ratios(results, "loopback")
    assert loop["swarmgrad_over_hivemind"] == {"value": 0.4, "kind": "exact", "bar": 0.5, "met": True}
    assert loop["swarmgrad_over_single"] == {"value": 1.11, "kind": "exact", "bar": 1.3, "met": True}
    slow = lm_compare.ratios(results, "10mbit")
    assert "swarmgrad_over_hivemind" not in slow  # neither reached it: no ratio
    assert slow["swarmgrad_over_single"] == {"value": 10.0, "kind": "at least", "bar": None, "met": None}
    results["hivemind/loopback"] = entry("hivemind", "loopback", None, 900.0)
    assert lm_compare.ratios(results, "loopback")["swarmgrad_over_hivemind"]["kind"] == "at most"
    results["swarmgrad/loopback"] = entry("swarmgrad", "loopback", None, 900.0)
    assert lm_compare.ratios(results, "loopback")["swarmgrad_over_single"]["met"] is False


def test_the_single_process_leg_trains_and_reports_tokens_per_second(tmp_path):
    code = lm_compare.main(["--quick", "--systems", "single", "--context", "16", "--batch-size", "2",
                            "--duration", "2", "--eval-every", "1", "--eval-batches", "1", "--out", str(tmp_path),
                            "--json"])
    assert code == 0
    import json

    report = json.loads((tmp_path / "lm-compare.json").read_text())
    single = report["results"]["single/none"]
    assert report["settings"]["size"] == "tiny" and report["settings"]["context"] == 16  # --quick, but as given
    assert len(single["curve"]) >= 1 and single["tokens_per_second_per_peer"] > 0
    assert single["best_bits_per_byte"] == min(loss for _, loss in single["curve"]) / math.log(2)
