"""Push-sum arithmetic without the network: the exponential graph, dense merge and give
(averaging/pushsum.py), and sparse push-sum's per-coordinate mass and wire payload (sparse_gossip.py)."""

from __future__ import annotations

import math

import pytest
import torch

from swarmgrad.averaging.pushsum import Push, exponential_neighbors, give, merge
from swarmgrad.averaging.sparse_gossip import BYTES_PER_ENTRY, SparseMass, pack, unpack
from swarmgrad.net.wire import FrameError

MEMBERS = [f"peer{i:02d}" for i in range(8)]


@pytest.mark.parametrize("count, offsets", [(2, [1]), (3, [1, 2]), (5, [1, 2, 4]), (8, [1, 2, 4]), (9, [1, 2, 4, 8])])
def test_the_graph_cycles_through_powers_of_two_below_n(count, offsets):
    members = MEMBERS[:count] if count <= 8 else [f"p{i}" for i in range(count)]
    me = sorted(members)[0]
    picked = [exponential_neighbors(members, me, step, fanout=1) for step in range(2 * len(offsets))]
    ordered = sorted(members)
    assert picked == [[ordered[offsets[step % len(offsets)]]] for step in range(2 * len(offsets))]


def test_fanout_takes_the_next_offsets_and_never_repeats_or_picks_itself():
    ordered = sorted(MEMBERS)
    assert exponential_neighbors(MEMBERS, "peer06", 0, fanout=2) == [ordered[7], ordered[0]]  # +1, +2 wrap
    assert exponential_neighbors(MEMBERS, "peer06", 1, fanout=3) == [ordered[0], ordered[2], ordered[7]]
    # two peers: every offset is 1, so a fanout of 3 still gives the one other peer once
    assert exponential_neighbors(["a", "b"], "a", 5, fanout=3) == ["b"]
    # the caller need not be among the members; duplicates in the list do not count twice
    assert exponential_neighbors(["b", "b", "c"], "a", 0, fanout=1) == ["b"]
    assert exponential_neighbors([], "a", 0, fanout=2) == []
    assert exponential_neighbors(["a"], "a", 0, fanout=2) == []


def test_merge_is_the_weighted_mean_and_returns_the_total_weight():
    values = torch.tensor([1.0, 2.0, 3.0])
    pushes = [Push(1.0, torch.tensor([3.0, 2.0, 1.0])), Push(2.0, torch.tensor([0.0, 0.0, 6.0]))]
    weight = merge(values, 1.0, pushes)
    assert weight == 4.0
    torch.testing.assert_close(values, torch.tensor([(1 + 3) / 4, (2 + 2) / 4, (3 + 1 + 12) / 4]))
    untouched = torch.tensor([5.0])
    assert merge(untouched, 2.5, []) == 2.5 and untouched.item() == 5.0


def test_merge_keeps_tiny_and_huge_weights_out_of_the_tensors():
    for scale in (1e-300, 1e300):
        values = torch.tensor([1.0, -1.0])
        weight = merge(values, scale, [Push(scale, torch.tensor([3.0, 1.0]))])
        assert weight == 2 * scale
        torch.testing.assert_close(values, torch.tensor([2.0, 0.0]))


def test_give_keeps_exactly_what_was_not_given():
    values = torch.tensor([1.0, 2.0, 4.0])
    arrives = torch.tensor([1.5, 2.0, 3.0])  # what a lossy codec delivers
    kept, weight = give(values, 3.0, 1.0, arrives)
    assert weight == 2.0 and kept is not values
    torch.testing.assert_close(3.0 * values, 2.0 * kept + 1.0 * arrives)  # w x = w' x' + g x^
    assert torch.equal(values, torch.tensor([1.0, 2.0, 4.0]))  # the caller's tensor is left as it was
    same, weight = give(values, 3.0, 1.5, values.clone())
    assert same is values and weight == 1.5  # lossless: nothing to keep back


# ---- sparse push-sum ------------------------------------------------------------------------------


def test_sparse_mass_starts_even_and_picks_k_distinct_sorted_coordinates():
    mass = SparseMass(100, 2.0, 0.1)
    assert mass.k == 10 and mass.mean_weight == 2.0 and torch.equal(mass.weights, torch.full((100,), 2.0))
    assert SparseMass(10, 1.0, 0.01).k == 1 and SparseMass(10, 1.0, 1.0).k == 10 and SparseMass(3, 1.0, 0.5).k == 2
    values = torch.zeros(100)
    values[[3, 50, 97]] = torch.tensor([5.0, -9.0, 7.0])  # the most changed since nothing was shared
    for _ in range(20):
        indices = mass.select(values)
        assert bool((indices[1:] > indices[:-1]).all()) and 0 <= int(indices[0]) and int(indices[-1]) < 100
        assert {3, 50, 97} <= set(indices.tolist())
        assert mass.k - mass.k // 2 <= len(indices) <= mass.k


def test_sparse_selection_also_sends_a_window_at_a_random_place():
    """Half of k is a window of consecutive coordinates (mod n) that moves at random, so a coordinate
    that stopped changing here is still sent now and then."""
    mass = SparseMass(1000, 1.0, 0.02)  # k = 20: a window of 10, and the 10 most changed
    mass._generator.manual_seed(7)  # the place is random (os.urandom): fixed here, so the test is too
    values = torch.zeros(1000)
    values[:10] = 1.0  # the 10 changed coordinates
    starts = []
    for _ in range(30):
        chosen = mass.select(values).tolist()
        assert len(chosen) == 20
        if min(chosen[10:]) < 20 or max(chosen) > 990:  # the window may touch the changed ones: skip
            continue
        assert chosen[:10] == list(range(10))
        window = chosen[10:]
        assert window == list(range(window[0], window[0] + 10))  # consecutive
        starts.append(window[0])
    assert len(starts) >= 25 and len(set(starts)) > 20  # and it moves


def test_sparse_give_take_back_and_merge_conserve_mass_per_coordinate():
    mass = SparseMass(6, 1.0, 0.5)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    indices = torch.tensor([1, 4])
    given = mass.give(values, indices, 0.25)
    assert torch.equal(given, torch.tensor([0.25, 0.25]))
    assert torch.equal(mass.weights, torch.tensor([1.0, 0.75, 1.0, 1.0, 0.75, 1.0]))
    assert torch.equal(mass.last_shared, torch.tensor([0.0, 2.0, 0.0, 0.0, 5.0, 0.0]))
    assert mass.mean_weight == pytest.approx(5.5 / 6)
    mass.take_back(indices, given)
    assert torch.equal(mass.weights, torch.ones(6))
    mass.merge(values, torch.tensor([0, 5]), torch.tensor([3.0, 0.0]), torch.tensor([3.0, 1.0]))
    assert torch.equal(values, torch.tensor([(1 + 9) / 4, 2.0, 3.0, 4.0, 5.0, 3.0]))
    assert torch.equal(mass.weights, torch.tensor([4.0, 1.0, 1.0, 1.0, 1.0, 2.0]))


def test_a_sparse_payload_round_trips():
    indices, values, weights = torch.tensor([0, 3, 9]), torch.tensor([1.5, -2.0, 0.0]), torch.tensor([0.5, 1.0, 2.0])
    payload = pack(indices, values, weights)
    assert len(payload) == 3 * BYTES_PER_ENTRY == 36
    back = unpack(payload, 3, 10)
    assert [t.dtype for t in back] == [torch.int64, torch.float32, torch.float32]
    assert all(torch.equal(a, b) for a, b in zip(back, (indices, values, weights)))
    assert [t.numel() for t in unpack(b"", 0, 10)] == [0, 0, 0]
    wide = pack(indices, values.double(), weights.double())  # any float dtype goes out as float32
    assert wide == payload


def test_sparse_selection_never_picks_a_window_coordinate_twice():
    """All coordinates changed a little (less than 1): the changed-most half must still pick k/2
    coordinates outside the window, so every push carries k distinct ones."""
    mass = SparseMass(400, 1.0, 0.05)
    values = torch.full((400,), 0.5) + torch.rand(400, generator=torch.Generator().manual_seed(4)) * 0.1
    for _ in range(10):
        assert len(mass.select(values)) == mass.k == 20


@pytest.mark.parametrize("indices, values, weights, total, message", [
    ([3, 3], [1.0, 1.0], [1.0, 1.0], 10, "strictly increasing"),
    ([4, 2], [1.0, 1.0], [1.0, 1.0], 10, "strictly increasing"),
    ([0, 5, 3], [1.0] * 3, [1.0] * 3, 10, "strictly increasing"),
    ([-1, 2], [1.0, 1.0], [1.0, 1.0], 10, "within the tensors"),
    ([2, 10], [1.0, 1.0], [1.0, 1.0], 10, "within the tensors"),
    ([0, 9], [math.nan, 1.0], [1.0, 1.0], 10, "NaN/Inf values"),
    ([0, 9], [1.0, math.inf], [1.0, 1.0], 10, "NaN/Inf values"),
    ([0, 9], [1.0, 1.0], [math.inf, 1.0], 10, "non-positive weights"),
    ([0, 9], [1.0, 1.0], [1.0, 0.0], 10, "non-positive weights"),
    ([0, 9], [1.0, 1.0], [-1.0, 1.0], 10, "non-positive weights"),
])
def test_a_sparse_payload_that_lies_is_refused(indices, values, weights, total, message):
    payload = pack(torch.tensor(indices), torch.tensor(values), torch.tensor(weights))
    full = {"strictly": "^sparse push indices must be strictly increasing and within the tensors$",
            "within": "^sparse push indices must be strictly increasing and within the tensors$",
            "NaN/Inf": "^sparse push holds NaN/Inf values or non-positive weights$",
            "non-positive": "^sparse push holds NaN/Inf values or non-positive weights$"}[message.split()[0]]
    with pytest.raises(FrameError, match=full):
        unpack(payload, len(indices), total)
    assert unpack(payload[:0], 0, total)[0].numel() == 0


def test_a_sparse_payload_of_the_wrong_length_is_refused():
    payload = pack(torch.tensor([1, 2]), torch.ones(2), torch.ones(2))
    for count in (1, 3):
        with pytest.raises(FrameError, match=f"sparse push of {count} entries must carry {12 * count} bytes"):
            unpack(payload, count, 10)
    with pytest.raises(FrameError, match="must carry 24 bytes"):
        unpack(payload[:-1], 2, 10)


def test_sparse_selection_leaves_the_global_torch_generator_alone():
    """Training draws from torch's global generator (dropout, shuffling under a seed); gossip's
    random window must not shift those draws, so it has a generator of its own."""
    mass = SparseMass(1000, 1.0, 0.02)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    mass.select(torch.zeros(1000))
    assert torch.equal(torch.rand(3), expected)
