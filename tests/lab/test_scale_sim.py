"""benchmarks/_mixing.py and scale_sim.py: the simulated mixing follows the real rules (grid.py's
slices, pushsum.py's arithmetic), is exact where it must be, slows down with churn, counts bytes by
the wire rules, and the script writes its JSON and PNG."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from swarmgrad.averaging.grid import grid_position, grid_sides
from swarmgrad.averaging.pushsum import Push, exponential_neighbors, give, merge

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
mixing = importlib.import_module("_mixing")
sim = importlib.import_module("scale_sim")

NUMEL = 1000


@pytest.mark.parametrize("grid", ["real", "base"])
@pytest.mark.parametrize("peers", [16, 64, 256])
def test_moshpit_is_exact_after_d_rounds_when_n_is_a_power_of_the_group_size(grid, peers):
    dims = round(math.log(peers, 4))
    for seed in range(3):
        run = mixing.simulate_moshpit(peers, seed, grid=grid, target=1e-9)
        assert run.rounds == dims  # not one round sooner: every dimension is needed
        assert run.final_error < 1e-6 and run.no_group == 0


def test_moshpit_on_a_grid_with_empty_cells_is_not_exact_but_converges():
    run = mixing.simulate_moshpit(10, 0, target=1e-9, max_rounds=2)  # 10 peers: a 4 x 3 grid, 2 empty cells
    assert run.rounds is None and run.final_error > 1e-3
    assert mixing.simulate_moshpit(10, 0).rounds is not None


@pytest.mark.parametrize("peers, sides", [(8, (4, 2)), (10, (4, 3)), (17, (3, 3, 2)), (20, (4, 3, 2)), (50, (4, 4, 4)),
                                          (100, (4, 3, 3, 3))])
def test_moshpit_groups_are_the_slices_of_grid_py(peers, sides):
    """On grid.grid_sides' grid, two ranks meet exactly when grid.grid_position puts them in cells
    that agree outside this round's dimension, and each peer's group is that whole slice."""
    assert mixing.sides_for(peers, 4, "real") == grid_sides(peers, 4) == sides
    ranks = np.arange(peers)
    for dim in range(len(sides)):
        cells = [tuple(c for k, c in enumerate(grid_position(r, sides)) if k != dim) for r in range(peers)]
        keys = mixing.slice_keys(ranks, dim, sides)
        assert all((keys[a] == keys[b]) == (cells[a] == cells[b]) for a in range(peers) for b in range(peers))
        sizes = mixing.moshpit_round(np.zeros((peers, 2)), ranks, ranks, dim, sides, 0.0, np.random.default_rng(0))
        expected = [cells.count(cell) for cell in cells]
        assert sizes.tolist() == [size if size > 1 else 0 for size in expected]


def test_an_absent_peer_and_a_failed_group_keep_their_vectors():
    x = np.random.default_rng(1).standard_normal((16, 3))
    before = x.copy()
    present = np.ones(16, dtype=bool)
    present[[0, 5]] = False
    members = np.flatnonzero(present)
    sizes = mixing.moshpit_round(x, members, members, 0, (4, 4), 0.0, np.random.default_rng(0))
    assert np.array_equal(x[[0, 5]], before[[0, 5]]) and sizes[0] == sizes[5] == 0
    assert sizes[1] == 3 and np.allclose(x[1], before[1:4].mean(axis=0))  # the rest of 0's group met
    x = before.copy()
    sizes = mixing.moshpit_round(x, np.arange(16), np.arange(16), 0, (4, 4), 1.0, np.random.default_rng(0))
    assert np.array_equal(x, before) and (sizes == 4).all()  # attempted (bytes sent), nothing changed


@pytest.mark.parametrize("rerank", [False, True])
def test_churn_and_failed_groups_need_more_rounds(rerank):
    for seed in range(3):  # 64 peers: 3 rounds without either
        churned = mixing.simulate_moshpit(64, seed, churn=0.1, rerank=rerank)
        assert churned.rounds is not None and churned.rounds > 3, churned
        failing = mixing.simulate_moshpit(64, seed, failure=0.1, rerank=rerank)
        assert failing.rounds is not None and failing.rounds > 3, failing


def test_bytes_follow_the_wire_rules():
    """A member of a group of m sends (m - 1)/m of the vector as a contributor and as much as an owner
    (consensus.py measured 10.0 MB per peer for 8 peers, 1M float32, 2 rounds: 4 x (1.5 + 1.0))."""
    for members in range(2, 8):
        assert mixing.allreduce_bytes(members, NUMEL) == pytest.approx(2 * (members - 1) / members * NUMEL * 4)
    assert mixing.allreduce_bytes(1, NUMEL) == 0.0
    # 16 peers: two rounds in groups of 4; 8 peers on the 4 x 2 grid: a group of 4, then of 2
    assert mixing.simulate_moshpit(16, 0, numel=NUMEL).bytes_per_peer == pytest.approx(2 * 1.5 * NUMEL * 4)
    assert mixing.simulate_moshpit(8, 0, numel=NUMEL).bytes_per_peer == pytest.approx((1.5 + 1.0) * NUMEL * 4)
    assert mixing.simulate_moshpit(8, 0).bytes_per_peer == pytest.approx(10.0e6)
    gossip = mixing.simulate_gossip(16, 0, numel=NUMEL, fanout=2)
    assert gossip.bytes_per_peer == pytest.approx(gossip.rounds * 2 * NUMEL * 4)  # every push: the whole vector


def reference_gossip(x: np.ndarray, w: np.ndarray, fanout: int, steps: int) -> tuple[torch.Tensor, list[float]]:
    """Synchronous push-sum peer by peer with pushsum.py's own functions, as GossipAverager.step does:
    merge what arrived, then give weight / (k + 1) of what is left to each neighbour in turn."""
    ids = [mixing.peer_id(i) for i in range(len(x))]
    values = [torch.tensor(row) for row in x]
    weights, pending = [float(v) for v in w], [[] for _ in ids]
    for step in range(steps):
        for i in range(len(ids)):
            weights[i] = merge(values[i], weights[i], pending[i])
        pending = [[] for _ in ids]
        for i, me in enumerate(ids):
            neighbours = exponential_neighbors(ids, me, step, fanout)
            for peer in neighbours:
                given = weights[i] / (len(neighbours) + 1)
                values[i], weights[i] = give(values[i], weights[i], given, values[i])
                pending[ids.index(peer)].append(Push(given, values[i].clone()))
    return torch.stack(values), weights


@pytest.mark.parametrize("peers, fanout", [(6, 1), (6, 2), (11, 3)])
def test_vectorised_gossip_follows_pushsum_step_by_step(peers, fanout):
    x = np.random.default_rng(2).standard_normal((peers, 4))
    w = np.arange(1.0, peers + 1)
    state = mixing.PushSum.start(x, w)
    for _ in range(7):
        mixing.gossip_step(state, np.ones(peers, dtype=bool), fanout, 0.0, np.random.default_rng(0))
    values, weights = reference_gossip(x, w, fanout, 7)
    assert np.allclose(state.x, values.numpy()) and np.allclose(state.w, weights)


def test_gossip_converges_exactly_on_powers_of_two_and_geometrically_otherwise():
    for peers in (8, 16, 64):  # pushes along offsets 1, 2, 4, ...: exact after log2 N pushes
        assert mixing.simulate_gossip(peers, 0, target=1e-9).rounds == math.log2(peers) + 1
    other = mixing.simulate_gossip(12, 0)
    assert other.rounds is not None and other.rounds > 5 and other.final_error <= mixing.TARGET


def test_gossip_with_lost_pushes_agrees_on_a_drifted_mean():
    lossy = mixing.simulate_gossip(16, 0, drop=0.1)
    assert lossy.rounds is not None and lossy.rounds > mixing.simulate_gossip(16, 0).rounds
    assert lossy.drift > 1e-3  # the lost shares moved the point every peer agrees on
    clocks = mixing.simulate_gossip(16, 0, activity=0.5)  # peers on their own clocks: more steps each
    assert clocks.rounds is not None and clocks.rounds > 5


def test_real_points_are_read_from_scale_and_consensus_json(tmp_path):
    scale = {"config": {}, "rows": [
        {"peers": 8, "moshpit_rounds": 3, "round_bound": 3, "moshpit_ok": True, "gossip_steps": 12.5, "gossip_s": 1.0,
         "moshpit_trace": [0.5, 0.01]},
        {"peers": 16, "moshpit_rounds": None, "gossip_steps": None, "error": None},
        {"N": 64, "moshpit": {"round_limit": 12, "rounds": 4}, "gossip_steps_s": 2.5},  # nested, a cap, seconds
        {"peers": 32, "error": "peer 3 died"}]}
    consensus = {"rows": [{"method": "gossip", "codec": "none", "peers": 8, "steps": 19.1, "converged": True},
                          {"method": "moshpit", "codec": "int8", "peers": 8, "steps": 9, "converged": True},
                          {"method": "moshpit", "codec": "none", "peers": 16, "steps": 14, "converged": False}]}
    (tmp_path / "scale.json").write_text(json.dumps(scale))
    (tmp_path / "consensus.json").write_text(json.dumps(consensus))
    found = {(p.peers, p.method, p.rounds) for p in sim.real_points(tmp_path / "scale.json")}
    assert found == {(8, "moshpit", 3.0), (8, "gossip", 12.5), (64, "moshpit", 4.0)}
    found = {(p.peers, p.method, p.rounds) for p in sim.real_points(tmp_path / "consensus.json")}
    assert found == {(8, "gossip", 19.1)}  # other codecs and unconverged rows are left out


def test_the_script_writes_json_and_png(tmp_path):
    real = tmp_path / "real.json"
    real.write_text(json.dumps({"rows": [{"peers": 8, "moshpit_rounds": 3, "gossip_steps": 19.0},
                                         {"peers": 21, "moshpit_rounds": 5}]}))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "scale_sim.py"), "--quick", "--json", "--out", str(out),
                           "--real", str(real)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    rows = {row["peers"]: row for row in report["rows"]}
    assert max(rows) == sim.QUICK_MAX_PEERS and 21 in rows  # the real file's N is simulated too
    assert rows[16]["moshpit"]["rounds"] == 2 and rows[16]["theory"] == 2 and rows[16]["gossip"]["rounds"] == 5
    assert rows[100]["sides"] == [4, 3, 3, 3] and rows[100]["moshpit"]["rounds"] > rows[100]["theory"]
    assert rows[256]["moshpit"]["mb_per_peer"] == pytest.approx(4 * 1.5 * 4.0)
    assert rows[8]["gossip_async"]["rounds"] > rows[8]["gossip"]["rounds"]
    assert rows[64]["moshpit_churn"]["rounds"] > 3 and rows[64]["gossip_churn"]["drift"] > 0
    gaps = {(g["peers"], g["variant"]): g for g in report["gaps"]}
    assert set(gaps) == {(8, "moshpit"), (8, "gossip"), (8, "gossip_async"), (21, "moshpit")}
    assert gaps[(8, "gossip")]["gap"] == pytest.approx(4 - 19.0) and gaps[(8, "moshpit")]["gap"] == 2 - 3
    assert (out / sim.PNG_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--churn", "1.5"], "probability"),
    (["--peers", "8,1"], "peer counts"),
    (["--real", "/nonexistent/scale.json"], "--real"),
])
def test_bad_input_is_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sim.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
