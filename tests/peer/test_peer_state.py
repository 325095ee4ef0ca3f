"""Unit tests of peer state: snapshots, TrainingState capture/restore (checkpoints: test_checkpoint.py)."""

from __future__ import annotations

import pytest
import torch
from peer_fakes import attach, model_and_optimizer, train_steps

from swarmgrad.errors import ConfigError
from swarmgrad.net.wire import FrameError
from swarmgrad.peer.state import StateMismatch, TrainingState, not_optimizer
from swarmgrad.peer.strategies.diloco import DiLoCo
from swarmgrad.peer.strategies.sync import SyncSGD
from swarmgrad.state import snapshot as state_snapshot
from swarmgrad.state.snapshot import StateSnapshot, layout, parse_description, parts_holding

# ---- StateSnapshot ------------------------------------------------------------------------------------


def test_snapshot_round_trips_every_dtype_and_shape():
    tensors = {
        "a": torch.randn(3, 5),
        "half": torch.randn(7).half(),
        "bf": torch.randn(2, 2).bfloat16(),
        "double": torch.randn(4, dtype=torch.float64),
        "count": torch.tensor(7, dtype=torch.int64),  # 0-dim
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(5, dtype=torch.uint8),
        "small": torch.tensor([-3, 4], dtype=torch.int8),
        "empty": torch.zeros(0, 3),
        "strided": torch.randn(6, 4).t(),  # not contiguous
    }
    snapshot = StateSnapshot.capture(3, tensors, {"epoch": 3})
    assert snapshot.version == 3 and snapshot.meta == {"epoch": 3}
    # each tensor starts on an 8-byte boundary, so it can be viewed in place as its dtype
    assert sum(t.numel() * t.element_size() for t in tensors.values()) <= snapshot.nbytes
    assert snapshot.nbytes == layout(snapshot.specs)[1] and snapshot.nbytes % 8 == 0
    restored = snapshot.tensors()
    assert list(restored) == list(tensors)
    for name, tensor in tensors.items():
        assert restored[name].dtype == tensor.dtype and restored[name].shape == tensor.shape
        assert torch.equal(restored[name], tensor), name
    assert [spec[0] for spec in snapshot.specs] == list(tensors)


def test_training_state_of_a_batchnorm_model_round_trips():
    """A BatchNorm's int64 ``num_batches_tracked`` lands at an offset that is not a multiple of 8."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_steps(model, optimizer, 2)
    snapshot = TrainingState(model, optimizer, attach(SyncSGD(), model, optimizer)).capture(2, {})
    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    other_optimizer = torch.optim.Adam(other.parameters(), lr=0.01)
    TrainingState(other, other_optimizer, attach(SyncSGD(), other, other_optimizer)).restore(snapshot)
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    assert_same_optimizer_state(optimizer, other_optimizer)


def test_snapshot_is_a_copy():
    source = {"w": torch.zeros(4)}
    snapshot = StateSnapshot.capture(1, source)
    source["w"].add_(1.0)
    assert torch.equal(snapshot.tensors()["w"], torch.zeros(4))


def test_snapshot_rejects_unsupported_dtype():
    with pytest.raises(ValueError, match="unsupported dtype"):
        StateSnapshot.capture(0, {"z": torch.zeros(2, dtype=torch.complex64)})


def test_empty_snapshot():
    snapshot = StateSnapshot.capture(0, {})
    assert snapshot.nbytes == 0 and snapshot.tensors() == {}


def test_digest_identifies_the_layout_not_the_values():
    a = StateSnapshot.capture(1, {"w": torch.zeros(4), "b": torch.zeros(2)})
    b = StateSnapshot.capture(9, {"w": torch.ones(4), "b": torch.randn(2)})
    assert a.digest == b.digest
    assert a.digest != StateSnapshot.capture(1, {"w": torch.zeros(5), "b": torch.zeros(2)}).digest
    assert a.digest != StateSnapshot.capture(1, {"w": torch.zeros(4).double(), "b": torch.zeros(2)}).digest
    assert a.digest != StateSnapshot.capture(1, {"v": torch.zeros(4), "b": torch.zeros(2)}).digest
    assert a.digest != StateSnapshot.capture(1, {"b": torch.zeros(2), "w": torch.zeros(4)}).digest  # order


def test_describe_parses_back_and_is_checked_against_nbytes():
    snapshot = StateSnapshot.capture(2, {"w": torch.randn(3, 4), "n": torch.tensor(5)}, {"k": [1, 2]})
    specs, meta = parse_description(snapshot.describe(), snapshot.nbytes)
    assert specs == snapshot.specs and meta == snapshot.meta
    with pytest.raises(FrameError, match="adds up"):
        parse_description(snapshot.describe(), snapshot.nbytes + 1)
    with pytest.raises(FrameError):
        parse_description(b"\xc1 not msgpack", snapshot.nbytes)


def test_parts_holding_covers_exactly_the_kept_tensors(monkeypatch):
    monkeypatch.setattr(state_snapshot, "PART_BYTES", 100)
    # byte ranges: a 0..40, b 40..240, c 240..244 (+4 padding), d 248..348, e 352..352 (empty)
    specs = (("a", "float32", (10,)), ("b", "float32", (50,)), ("c", "float32", (1,)),
             ("d", "int8", (100,)), ("e", "float32", (0,)))
    assert layout(specs)[1] == 352
    assert parts_holding(specs, None) == [0, 1, 2, 3]
    assert parts_holding(specs, lambda name: name == "a") == [0]
    assert parts_holding(specs, lambda name: name == "b") == [0, 1, 2]
    assert parts_holding(specs, lambda name: name == "c") == [2]
    assert parts_holding(specs, lambda name: name == "d") == [2, 3]
    assert parts_holding(specs, lambda name: name in ("a", "e")) == [0]  # an empty tensor needs no part
    assert parts_holding(specs, lambda name: False) == []


# ---- TrainingState ------------------------------------------------------------------------------------


def diloco_state(model, optimizer):
    strategy = attach(DiLoCo(inner_steps=5), model, optimizer)
    return strategy, TrainingState(model, optimizer, strategy)


def trained_adam_diloco():
    """A model trained 3 Adam steps, DiLoCo with random outer momentum, and its state at version 4."""
    model, optimizer = model_and_optimizer(0, lr=0.01, kind="adam")
    train_steps(model, optimizer, 3)
    strategy, state = diloco_state(model, optimizer)
    strategy.momentum.normal_()
    return model, optimizer, strategy, state.capture(4, {"strategy": strategy.settings.to_dict()})


def test_restore_keeping_the_optimizer_takes_model_and_strategy_only():
    """A peer that steps its own optimizer catches up from a state without optimizer tensors and
    keeps its own Adam moments; without keep_optimizer the same state would reset them."""
    model, _, strategy, full = trained_adam_diloco()
    swarm_part = StateSnapshot.capture(4, {k: v for k, v in full.tensors().items() if not_optimizer(k)}, full.meta)
    assert swarm_part.nbytes < full.nbytes / 2  # Adam's two moments were most of it

    mine, my_optimizer = model_and_optimizer(1, lr=0.01, kind="adam")
    train_steps(mine, my_optimizer, 2, seed=9)
    my_strategy, my_state = diloco_state(mine, my_optimizer)
    own_moments = {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                   for i, s in my_optimizer.state_dict()["state"].items()}
    my_state.restore(swarm_part, keep_optimizer=True)
    for key, value in model.state_dict().items():
        assert torch.equal(mine.state_dict()[key], value), key
    assert torch.equal(strategy.momentum, my_strategy.momentum)
    for index, moments in own_moments.items():
        for key, value in moments.items():
            assert torch.equal(my_optimizer.state_dict()["state"][index][key], value), (index, key)
    my_state.restore(swarm_part)  # the same state, taken whole: it holds no optimizer state
    assert my_optimizer.state_dict()["state"] == {}


def test_training_state_round_trip_with_adam_and_diloco_momentum():
    model, optimizer, strategy, snapshot = trained_adam_diloco()
    names = set(snapshot.tensors())
    assert {"model/0.weight", "optimizer/0/exp_avg", "optimizer/0/exp_avg_sq", "strategy/momentum/0"} <= names

    other_model, other_optimizer = model_and_optimizer(1, lr=0.01, kind="adam")
    other_strategy, other_state = diloco_state(other_model, other_optimizer)
    other_state.restore(snapshot)
    for key, value in model.state_dict().items():
        assert torch.equal(other_model.state_dict()[key], value), key
    assert_same_optimizer_state(optimizer, other_optimizer)
    assert torch.equal(strategy.momentum, other_strategy.momentum)
    for start, param in zip(other_strategy.layout.views(other_strategy.start), other_strategy.params):
        # the new start is the state's params
        assert torch.equal(start, param.detach())
    # the restored pair trains exactly like the original
    train_steps(model, optimizer, 2, seed=5)
    train_steps(other_model, other_optimizer, 2, seed=5)
    for a, b in zip(model.parameters(), other_model.parameters()):
        assert torch.equal(a, b)


def assert_same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    state_a, state_b = a.state_dict()["state"], b.state_dict()["state"]
    assert set(state_a) == set(state_b)
    for index in state_a:
        assert set(state_a[index]) == set(state_b[index])
        for key, value in state_a[index].items():
            other = state_b[index][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other) and value.dtype == other.dtype, (index, key)
            else:
                assert value == other, (index, key)


def test_restore_refuses_wrong_shapes_and_names_and_changes_nothing():
    model, optimizer = model_and_optimizer(0, kind="adam")
    train_steps(model, optimizer, 1)
    _, state = diloco_state(model, optimizer)
    snapshot = state.capture(1, {})

    wide = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    wide_optimizer = torch.optim.Adam(wide.parameters())
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    with pytest.raises(StateMismatch, match="model/0.weight"):
        TrainingState(wide, wide_optimizer, attach(DiLoCo(), wide, wide_optimizer)).restore(snapshot)
    assert all(torch.equal(before[k], v) for k, v in wide.state_dict().items())

    deeper = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    deeper_optimizer = torch.optim.Adam(deeper.parameters())
    with pytest.raises(StateMismatch, match="missing"):
        TrainingState(deeper, deeper_optimizer, attach(DiLoCo(), deeper, deeper_optimizer)).restore(snapshot)

    # optimizer state for a parameter this optimizer does not have
    tensors = dict(snapshot.tensors())
    tensors["optimizer/9/exp_avg"] = torch.zeros(3)
    bad = StateSnapshot.capture(1, tensors, snapshot.meta)
    fresh_model, fresh_optimizer = model_and_optimizer(3, kind="adam")
    _, fresh_state = diloco_state(fresh_model, fresh_optimizer)
    before = {k: v.clone() for k, v in fresh_model.state_dict().items()}
    with pytest.raises(StateMismatch, match="parameter 9"):
        fresh_state.restore(bad)
    assert all(torch.equal(before[k], v) for k, v in fresh_model.state_dict().items())
    assert fresh_optimizer.state_dict()["state"] == {}

    # optimizer state of the wrong shape
    tensors = dict(snapshot.tensors())
    tensors["optimizer/0/exp_avg"] = torch.zeros(2, 2)
    with pytest.raises(StateMismatch, match="optimizer/0/exp_avg"):
        fresh_state.restore(StateSnapshot.capture(1, tensors, snapshot.meta))


def test_restore_with_foreign_strategy_state_changes_nothing():
    """restore() promises StateMismatch *changing nothing*: that covers the strategy part too."""
    model, optimizer = model_and_optimizer(0, kind="adam")
    train_steps(model, optimizer, 1)
    sync_state = TrainingState(model, optimizer, attach(SyncSGD(), model, optimizer))
    snapshot = sync_state.capture(1, {})  # no strategy tensors

    other_model, other_optimizer = model_and_optimizer(2, kind="adam")
    _, other_state = diloco_state(other_model, other_optimizer)  # expects strategy/momentum/*
    before = {k: v.clone() for k, v in other_model.state_dict().items()}
    with pytest.raises(ConfigError) as caught:
        other_state.restore(snapshot)
    assert all(torch.equal(before[k], v) for k, v in other_model.state_dict().items()), "model was changed"
    assert other_optimizer.state_dict()["state"] == {}, "optimizer was changed"
    assert isinstance(caught.value, StateMismatch)
