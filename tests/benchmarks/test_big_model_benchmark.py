"""The big-model benchmark (benchmarks/big_model.py): its size and memory arithmetic, and its quick
variant run as a user would (one 4.2M-parameter layer, three peers on loopback, a joiner).

The quick run checks what could break: every peer averaged at least one round, the joiner took a
whole state, the RAM figures per parameter are positive and finite, the stall ratio was computed,
and no peer process outlived the run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "big_model.py"
sys.path.insert(0, str(BENCHMARK.parent))

import big_model as bm  # noqa: E402
from _big_model_report import round_figures  # noqa: E402


def test_sizes_become_whole_layers_of_2048_by_2048():
    assert bm.PARAMS_PER_LAYER == 4_196_352
    assert [bm.layers_for(bm.parse_size(s)) for s in ("5M", "20M", "60M", "200M")] == [1, 5, 14, 48]
    assert bm.parse_size("1.5G") == 1_500_000_000 and bm.parse_size("4196352") == 4_196_352


def test_the_memory_estimate_counts_three_peers_model_adam_and_the_swarm():
    params = 60_000_000
    assert bm.memory_needed(params, 100.0) == pytest.approx(3 * (116 * params + bm.PROCESS_OVERHEAD))
    assert bm.memory_needed(200_000_000, 100.0) > 24 * bm.GiB  # this machine's 24 GiB: 200M is skipped


def test_quick_is_one_small_loopback_case_with_a_joiner():
    args = bm.parse_args(["--quick"])
    [case] = bm.cases(args)
    assert (case.network, case.codec, case.layers, case.rounds, case.join_after) == ("loopback", "int8", 1, 4, 1)
    with pytest.raises(SystemExit):
        bm.parse_args(["--codecs", "nope"])
    with pytest.raises(SystemExit):
        bm.parse_args(["--rounds", "3", "--join-after", "3"])


def test_a_peer_summary_reads_rounds_steps_memory_and_download():
    rate = 100e6 / 8
    result = {"role": "joiner", "index": 2, "params": 1000, "epoch": 5, "rounds_ok": 2, "rounds_failed": 1,
              "baseline_rss": 10_000, "peak_rss": 150_000, "hwm": 160_000, "daemon_rss": 5e7, "swarm_memory": None,
              "state_downloads": 1, "enter_s": 3.0, "steps": [0.1, 0.1, 0.5], "step_epochs": [3, 3, 4],
              "step_cpu": [0.1, 0.05, 0.1], "step_runq": [0.0, 0.05, 0.3],
              "download": {"download_s": 4.0, "download_bytes": 25_000_000, "verify_s": 1.0},
              "rounds": [{"epoch": e, "seconds": s, "rss_before": rss, "ok": 1, "failed": 0, "cpu_s": s / 2,
                          "averaging_s": s - 1, "allreduce_s": s - 1.5,
                          "bytes_sent": 1_250_000, "bytes_received": 2_500_000,
                          "link_sent": 1_300_000, "link_received": link}
                         for e, s, rss, link in ((3, 9.0, 500_000, 25_000_000), (4, 2.0, 90_000, 2_600_000),
                                                 (5, 3.0, 110_000, 2_600_000))]}
    result["rounds"].append({"epoch": 7, "seconds": 30.0, "rss_before": 100_000, "ok": 0, "failed": 0,
                             "bytes_sent": 0, "bytes_received": 0})  # a call that only caught up
    row = bm.summarize_peer(result, rate)
    assert row["round_cpu_s"] == 1.5  # median(4.5, 1.0, 1.5): the call that only caught up left out
    assert row["round_s"] == 3.0 and row["wire_s"] == pytest.approx(0.2) and row["wire_sum_s"] == pytest.approx(0.3)
    assert row["catch_up_calls"] == 1 and row["catch_up_s"] == 30.0  # not a round
    assert (row["averaging_s"], row["allreduce_s"]) == (2.0, 1.5)  # of the same calls
    # the link carried 2.6 MB in, 0.21 s at the rate; in the first round a served state besides
    assert row["link_s"] == pytest.approx(0.208)
    assert (row["quiet_round_s"], row["quiet_rounds"]) == (2.5, 2)  # the first round's link was not quiet
    assert row["steady_bytes_per_param"] == 90.0  # the first round's sample is left out: median(80, 90, 100)
    assert row["peak_bytes_per_param"] == 140.0 and row["hwm_bytes_per_param"] == 150.0
    assert row["stall_ratio"] == pytest.approx(5.0) and row["download_wire_s"] == pytest.approx(2.0)
    assert row["verify_share"] == pytest.approx(0.25)
    # the stall's 0.5 s: 0.1 on a CPU, 0.3 waiting for one, 0.1 blocked; the longest wait of any step
    assert (row["stall_cpu_s"], row["stall_runq_s"]) == (0.1, 0.3)
    assert row["step_log"][2] == [4, 0.5, 0.1, 0.3] and row["stall_epoch"] == 4  # every step kept, to read back
    assert row["stall_blocked_s"] == pytest.approx(0.1) and row["longest_blocked_s"] == pytest.approx(0.1)
    assert bm.summarize_peer(result, None)["wire_s"] is None  # loopback: no link rate


def test_a_round_beside_a_joiners_fetch_is_not_quiet_whatever_its_link_carried():
    """A replay's bytes may be few, but serving it costs the donor CPU beside its round."""
    def round_at(began: float) -> dict:
        return {"epoch": 1, "seconds": 10.0, "began": began, "rss_before": 0, "ok": 1, "failed": 0, "cpu_s": 1.0,
                "bytes_sent": 1_000_000, "bytes_received": 1_000_000,
                "link_sent": 1_000_000, "link_received": 1_000_000}

    starter = {"role": "starter", "rounds": [round_at(began) for began in (100.0, 200.0, 300.0)]}
    joiner = {"role": "joiner", "rounds": [], "download": {"fetching": [(195.0, 201.0), (400.0, 450.0)]}}
    bm.mark_joiner_fetches([starter, joiner])
    assert [round_["beside_joiner"] for round_ in starter["rounds"]] == [False, True, False]
    row = round_figures(starter["rounds"], 100e6 / 8)
    assert row["quiet_rounds"] == 2


class FakeGroup:
    def __init__(self) -> None:
        self.told: list[tuple[dict, int | None]] = []

    def tell(self, message: dict, only: int | None = None) -> None:
        self.told.append((message, only))


def _conductor(rounds: int = 8, join_after: int = 3) -> tuple[bm.Conductor, FakeGroup]:
    case = bm.Case("loopback", "int8", "20M", 1, 1, rounds, join_after, 5, "off", 100.0)
    group = FakeGroup()
    return bm.Conductor(case, group), group


def _enter_the_joiner(conductor: bm.Conductor, group: FakeGroup) -> None:
    for index in range(3):
        conductor.handle(index, {"event": "built"})
    assert group.told == [({"go": []}, 0)]  # peer 0 first: the others need its address
    conductor.handle(0, {"event": "ready", "maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/A"], "epoch": 0})
    assert group.told[-1] == ({"go": ["/ip4/127.0.0.1/tcp/1/p2p/A"]}, 1)
    for epoch in (1, 2, 3):
        conductor.handle(0, {"event": "epoch", "epoch": epoch, "rounds_ok": epoch})
        assert len(group.told) == 2  # the joiner waits for both starters
        conductor.handle(1, {"event": "epoch", "epoch": epoch, "rounds_ok": epoch})
    assert group.told[-1] == ({"go": ["/ip4/127.0.0.1/tcp/1/p2p/A"]}, 2)
    conductor.handle(2, {"event": "ready", "maddrs": [], "epoch": 3})
    assert conductor.arrival == 3 and conductor.end is None


def test_the_swarm_ends_the_epoch_after_the_joiner_averaged_its_rounds():
    conductor, group = _conductor()
    _enter_the_joiner(conductor, group)
    for epoch in range(4, 9):
        conductor.handle(0, {"event": "epoch", "epoch": epoch, "rounds_ok": epoch})
        conductor.handle(2, {"event": "epoch", "epoch": epoch, "rounds_ok": epoch - 3})
    assert conductor.end == 9 and group.told[-1] == ({"end_epoch": 9}, None)


def test_a_joiner_that_never_averages_ends_the_case_after_the_patience():
    conductor, group = _conductor()
    _enter_the_joiner(conductor, group)
    last = 3 + bm.JOINER_PATIENCE * 5
    for epoch in range(4, last):
        conductor.handle(0, {"event": "epoch", "epoch": epoch, "rounds_ok": epoch})
        conductor.handle(2, {"event": "epoch", "epoch": epoch, "rounds_ok": 0})
    assert conductor.end is None
    conductor.handle(1, {"event": "epoch", "epoch": last, "rounds_ok": last})
    assert conductor.end == last + 1


def test_a_peer_short_of_the_end_is_stopped_a_while_after_the_others_reported():
    conductor, group = _conductor()
    _enter_the_joiner(conductor, group)
    conductor.end = 9
    conductor.handle(0, {"event": "result"})
    conductor.tick(bm.time.monotonic() + 2 * bm.STRAGGLER_S)
    assert group.told[-1][0] != {"stop": True}  # one starter is still out: nobody is stopped yet
    conductor.handle(1, {"event": "result"})
    conductor.tick(bm.time.monotonic())
    assert group.told[-1][0] != {"stop": True}
    conductor.tick(bm.time.monotonic() + bm.STRAGGLER_S + 1)
    assert group.told[-1] == ({"stop": True}, 2) and conductor.stopped == {2}
    conductor.tick(bm.time.monotonic() + bm.STRAGGLER_S + 2)
    assert group.told.count(({"stop": True}, 2)) == 1  # told once


@pytest.mark.slow
@pytest.mark.timeout(240)  # above the run's own limits, so those fire first and say why
def test_quick_big_model_benchmark_trains_joins_and_measures(tmp_path):
    process = subprocess.Popen([sys.executable, str(BENCHMARK), "--quick", "--json", "--logs", str(tmp_path / "logs")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        stdout, stderr = process.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        process.terminate()  # it unwinds on SIGTERM and removes its peer processes
        _, stderr = process.communicate(timeout=60)
        pytest.fail(f"the quick benchmark ran past 200 s: {stderr[-3000:]}")
    assert process.returncode == 0, stderr[-4000:]
    report = json.loads(stdout)  # stdout holds the JSON object and nothing else
    [case] = report["cases"]
    assert case["status"] == "ok", case["reason"]
    peers = case["peers"]
    assert [p["role"] for p in peers] == ["starter", "starter", "joiner"]
    for peer in peers:
        assert peer["params"] == bm.PARAMS_PER_LAYER
        assert peer["rounds_ok"] >= 1, peer
        assert peer["round_s"] is not None and peer["round_s"] > 0 and peer["round_cpu_s"] > 0
        # the averaging step is part of the call, its all-reduce part of the averaging step
        assert 0 < peer["allreduce_s"] <= peer["averaging_s"] <= peer["round_s"], peer
        for key in ("steady_bytes_per_param", "peak_bytes_per_param"):
            assert math.isfinite(peer[key]) and peer[key] > 0, (key, peer[key])
        assert peer["wire_s"] is None  # loopback
    starters = peers[:2]
    for peer in starters:
        assert peer["stall_ratio"] is not None and peer["stall_ratio"] >= 1.0 and peer["steps"] > 0
        split = peer["stall_cpu_s"] + peer["stall_runq_s"] + peer["stall_blocked_s"]
        assert peer["stall_cpu_s"] > 0 and split == pytest.approx(peer["stall_s"], abs=0.02), peer
    joiner = peers[2]
    assert joiner["state_downloads"] >= 1
    # a fresh joiner takes the whole state: at least the fp32 parameters and Adam's two moments
    assert joiner["download_bytes"] >= 12 * bm.PARAMS_PER_LAYER and joiner["download_s"] > 0
    assert joiner["verify_s"] is not None and 0 < joiner["verify_share"] < 1

    for trace in (str(tmp_path), f"bigmodel-loopback-int8-5M-{process.pid}"):  # p2pd's files; a peer's run id
        leftover = subprocess.run(["pgrep", "-f", trace], capture_output=True, text=True, check=False)
        assert leftover.stdout.strip() == "", leftover.stdout  # no peer (nor p2pd) outlived the run
