"""benchmarks/gpu_check.py on this CPU-only machine: without a GPU it says so in one line and exits 0;
its placement benchmark and its measure of the peers' rates run here on the CPU (the same code the
GPU machine runs), and the device's int8 encoding gives the host codec's frames."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(BENCHMARK.parent))

import gpu_check as gc  # noqa: E402

from swarmgrad.averaging.codecs import get_codec  # noqa: E402


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--json", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"gpu_check: no CUDA GPU found (torch {torch.__version__}: a CPU-only build); "
                                        "nothing measured"]
    assert json.loads(out.read_text())["gpu"] is None


def test_the_placement_shapes_are_a_100m_gpt():
    params = sum(math.prod(shape) for shape in gc.gpt_shapes())
    assert 95e6 < params < 105e6 and len(gc.gpt_shapes()) == 2 + 12 * 12 + 2
    assert 0.8e6 < sum(math.prod(shape) for shape in gc.shapes_for(1e6)) < 1.1e6


@pytest.mark.parametrize("numel", [3 * gc.BLOCK, 3 * gc.BLOCK + 17, 5])
def test_int8_encoded_in_torch_on_a_device_gives_the_int8_codecs_frames(numel):
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    values[:gc.BLOCK] = 0  # an all-zero block: the scale's floor
    codes, scales = gc.int8_encode(values)
    encoded = get_codec("int8").encode(values)
    assert codes.numpy().tobytes() == encoded.parts["q"]
    assert scales.numpy().tobytes() == encoded.parts["scale"]


def test_the_placement_benchmark_counts_each_placements_bytes_per_round():
    report = gc.placement("cpu", 200_000, repeats=1)
    rows = {row["placement"].split(" (")[0].split(",")[0]: row for row in report["rows"]}
    numel = report["params"]
    assert rows["boundary"]["bytes_per_param"] == 8.0 and rows["naive per parameter"]["bytes_per_param"] == 8.0
    assert rows["as at 670d8d2"]["down_bytes"] == 16 * numel and rows["as at 670d8d2"]["up_bytes"] == 4 * numel
    encoded = numel + 4 * math.ceil(numel / gc.BLOCK)
    sent, kept = report["rows"][3], report["rows"][4]
    assert (sent["down_bytes"], sent["up_bytes"]) == (encoded, 8 * numel)  # the start goes up, then the result
    assert "start sent up" in sent["placement"] and "kept" in kept["placement"]
    assert (kept["down_bytes"], kept["up_bytes"]) == (encoded, 4 * numel)
    assert all(row["seconds"] >= 0 for row in report["rows"])
    assert report["device_codes_equal_host_codec"] == 1.0
    assert "boundary (pinned" in gc.table({"gpu": {"name": "cpu", "torch": "x"}, "placement": report, "seconds": 1})


def _event(kind: str, t: float, samples: int) -> dict:
    if kind == "done":
        return {"event": kind, "t": t, "status": {"samples": samples}}
    return {"event": kind, "t": t} | ({"samples": samples} if kind == "progress" else {})


def test_rates_are_taken_over_the_window_every_peer_trained_in():
    events = [_event("ready", 0.0, 0)] + [_event("progress", float(t), 10 * t) for t in range(1, 11)]
    assert gc.rate_in_window(events, 2.5, 8.5) == pytest.approx(10.0)
    # a round held the loop (no progress events) from 3 to 9: the rate spans it, from the points around it
    held = [_event("ready", 0.0, 0), _event("progress", 3.0, 30), _event("progress", 9.0, 60), _event("done", 10.0, 70)]
    assert gc.rate_in_window(held, 4.0, 10.0) == pytest.approx((70 - 35) / 6)
    assert gc.rate_in_window(held, 4.0, 11.0) is None  # past its done: not a window it trained in
    slow = [_event("ready", 2.0, 0)] + [_event("progress", float(t), 5 * t) for t in range(3, 11)]
    ends = [_event("done", 11.0, 110), _event("done", 10.5, 55)]

    class Peer:
        def __init__(self, events):
            self.events = events

        def first(self, kind):
            return next(e for e in self.events if e["event"] == kind)

    assert gc.common_window([Peer(events + ends[:1]), Peer(slow + ends[1:])], skip=1.0) == (3.0, 10.5)


def test_without_swarmgrads_network_stack_the_two_peer_check_is_skipped_saying_why(monkeypatch):
    def missing(requested):
        raise ImportError("No module named 'pydantic'")

    monkeypatch.setattr(gc, "pick_task", missing)
    report = gc.swarm_check(gc.parse_args(["--device", "cpu"]))
    assert report == {"skipped": "swarmgrad's tasks do not import here (No module named 'pydantic')"}
    text = gc.table({"gpu": {"name": "cpu", "torch": "x"}, "two_peers": report, "seconds": 1})
    assert "two peers: skipped: swarmgrad's tasks do not import here" in text


# about a minute and five processes (two peers alone, a bootstrap and two peers together); what it
# runs is covered in CI by the unit tests above and the peer CLI tests (tests/commands/test_peer_cli.py)
@pytest.mark.extended
def test_the_two_peer_check_rehearsed_on_the_cpu_measures_both_phases(tmp_path):
    """The GPU machine runs this path once, unattended: here it runs whole on the CPU with digits."""
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--device", "cpu", "--skip-placement", "--task", "digits",
                           "--seconds", "10", "--inner-steps", "20", "--skip-seconds", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())["two_peers"]
    assert "failed" not in report and "skipped" not in report, report
    for phase in ("alone", "swarm"):
        assert [row["peer"] for row in report[phase]["peers"]] == [f"{phase}0", f"{phase}1"]
        assert all(row["samples_per_second"] > 0 and row["device"] == "cpu" for row in report[phase]["peers"])
    assert all(row["rounds_ok"] == 0 for row in report["alone"]["peers"])  # alone: nobody to average with
    for row in report["swarm"]["peers"]:  # together: rounds averaged, their bytes counted at the boundary
        assert row["rounds_ok"] >= 1 and row["bytes_sent_per_round"] > 0 and row["device_bytes_per_epoch"] > 0
    assert report["utilisation"] > 0 and "compute utilisation" in done.stdout
