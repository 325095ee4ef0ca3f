"""Unit tests of the peer layer without a network: snapshots, training state, checkpoints,
strategy math, progress, run manifests and averaging settings.

Strategies are exercised without ``open()`` (which needs a node): the tests set the attributes
``open()`` would set and hand them a minimal fake context with an optimizer and a progress tracker.
"""

from __future__ import annotations

import json
import math
import os
import time
from types import SimpleNamespace

import pydantic
import pytest
import torch
from conftest import run_async

from swarmgrad.averaging.state_transfer import StateSnapshot, _parse_description, layout
from swarmgrad.averaging.wire import FrameError
from swarmgrad.errors import ConfigError, StartupError
from swarmgrad.peer import Peer
from swarmgrad.peer.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from swarmgrad.peer.manifest import RunManifest, check_compatible, manifest_key, read_manifest
from swarmgrad.peer.progress import LocalProgress, PeerProgress, ProgressRecord, SwarmProgress
from swarmgrad.peer.settings import Gossip, Moshpit, averaging_from_dict
from swarmgrad.peer.state import StateMismatch, TrainingState
from swarmgrad.peer.strategies import DiLoCo, GossipSGD, SyncSGD, strategy_from_dict
from swarmgrad.peer.strategies.base import cpu_buffers
from swarmgrad.version import __version__

# ---- fakes ------------------------------------------------------------------------------------------


class FakeTracker:
    """What strategies use of a ProgressTracker: ``add``, ``local`` and ``fresh()``."""

    def __init__(self, others: tuple[PeerProgress, ...] = ()):
        self.local = LocalProgress()
        self.others = others

    def add(self, samples: int) -> None:
        self.local.add(samples)

    def fresh(self) -> SwarmProgress:
        me = PeerProgress("me", self.local.epoch, float(self.local.samples), float(self.local.steps), 0.0,
                          self.local.averaging)
        return SwarmProgress((me, *self.others), taken_at=time.monotonic())


class FakeAverager:
    """Records what a moshpit round would average; ``ok`` says whether the round succeeds."""

    def __init__(self, tensors: list[torch.Tensor], ok: bool = True):
        self.tensors, self.ok = tensors, ok
        self.calls: list[dict] = []

    async def step(self, weight: float, round_index: int, expected_peers: int, attempt: int):
        self.calls.append({"weight": weight, "round": round_index, "attempt": attempt,
                           "values": [t.clone() for t in self.tensors]})
        return SimpleNamespace(ok=self.ok)


def model_and_optimizer(seed: int = 0, lr: float = 0.1, kind: str = "sgd"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    if kind == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return model, optimizer


def attach(strategy, model, optimizer, tracker=None):
    """What ``open()`` sets, without a node or an averager."""
    strategy.ctx = SimpleNamespace(model=model, optimizer=optimizer, tracker=tracker or FakeTracker())
    strategy.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if isinstance(strategy, DiLoCo):
        strategy.start = [p.detach().to("cpu", torch.float32, copy=True) for p in strategy.params]
        strategy.delta = cpu_buffers(strategy.params)
        strategy.momentum = cpu_buffers(strategy.params)
    elif isinstance(strategy, SyncSGD):
        strategy.accumulated = cpu_buffers(strategy.params)
    elif isinstance(strategy, GossipSGD):
        strategy.values = cpu_buffers(strategy.params)
    return strategy


def set_grads(params, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=generator) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return grads


def train_steps(model, optimizer, steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


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
    specs, meta = _parse_description(snapshot.describe(), snapshot.nbytes)
    assert specs == snapshot.specs and meta == snapshot.meta
    with pytest.raises(FrameError, match="adds up"):
        _parse_description(snapshot.describe(), snapshot.nbytes + 1)
    with pytest.raises(FrameError):
        _parse_description(b"\xc1 not msgpack", snapshot.nbytes)


# ---- TrainingState ------------------------------------------------------------------------------------


def diloco_state(model, optimizer):
    strategy = attach(DiLoCo(inner_steps=5), model, optimizer)
    return strategy, TrainingState(model, optimizer, strategy)


def test_training_state_round_trip_with_adam_and_diloco_momentum():
    model, optimizer = model_and_optimizer(0, lr=0.01, kind="adam")
    train_steps(model, optimizer, 3)
    strategy, state = diloco_state(model, optimizer)
    for m in strategy.momentum:
        m.normal_()
    snapshot = state.capture(4, {"strategy": strategy.config()})
    names = set(snapshot.tensors())
    assert {"model/0.weight", "optimizer/0/exp_avg", "optimizer/0/exp_avg_sq", "strategy/momentum/0"} <= names

    other_model, other_optimizer = model_and_optimizer(1, lr=0.01, kind="adam")
    other_strategy, other_state = diloco_state(other_model, other_optimizer)
    other_state.restore(snapshot)
    for key, value in model.state_dict().items():
        assert torch.equal(other_model.state_dict()[key], value), key
    assert_same_optimizer_state(optimizer, other_optimizer)
    for mine, theirs in zip(strategy.momentum, other_strategy.momentum):
        assert torch.equal(mine, theirs)
    for start, param in zip(other_strategy.start, other_strategy.params):  # the new start is the state's params
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


# ---- checkpoints -----------------------------------------------------------------------------------


def sample_snapshot(version: int = 3) -> StateSnapshot:
    # 48 bytes of float32 first, so the int64 that follows is 8-byte aligned (see test_snapshot_of_mixed_dtypes...)
    return StateSnapshot.capture(version, {"w": torch.randn(4, 3), "step": torch.tensor(4)}, {"strategy": {"name": "x"}})


def test_checkpoint_round_trip(tmp_path):
    assert load_checkpoint(tmp_path, "run") is None
    snapshot = sample_snapshot()
    path = save_checkpoint(tmp_path / "deep" / "dir", "run", snapshot, {"epsilon": 1.5, "rounds": 4})
    assert path.name == CHECKPOINT_FILE
    loaded, extra = load_checkpoint(tmp_path / "deep" / "dir", "run")
    assert extra == {"epsilon": 1.5, "rounds": 4}
    assert loaded.version == 3 and loaded.specs == snapshot.specs and loaded.meta == snapshot.meta
    assert torch.equal(loaded.data, snapshot.data)
    assert os.listdir(tmp_path / "deep" / "dir") == [CHECKPOINT_FILE]  # no temporary left behind


def test_checkpoint_of_another_run_is_refused(tmp_path):
    save_checkpoint(tmp_path, "run-a", sample_snapshot(), {})
    with pytest.raises(ConfigError, match="run-a"):
        load_checkpoint(tmp_path, "run-b")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_checkpoint_is_a_config_error(tmp_path, damage):
    path = save_checkpoint(tmp_path, "run", sample_snapshot(), {})
    content = path.read_bytes()
    path.write_bytes({"garbage": b"not a checkpoint" * 10, "truncated": content[: len(content) // 2],
                      "empty": b""}[damage])
    with pytest.raises(ConfigError, match="cannot be read"):
        load_checkpoint(tmp_path, "run")


@pytest.mark.parametrize("cut", [4, 3])
def test_checkpoint_whose_bytes_do_not_fit_the_layout_is_refused(tmp_path, cut):
    snapshot = sample_snapshot()
    short = StateSnapshot(snapshot.version, snapshot.specs, snapshot.meta, snapshot.data[:-cut].clone())
    save_checkpoint(tmp_path, "run", short, {})
    with pytest.raises(ConfigError):
        load_checkpoint(tmp_path, "run")
    long = StateSnapshot(snapshot.version, snapshot.specs, snapshot.meta,
                         torch.cat([snapshot.data, torch.zeros(cut, dtype=torch.uint8)]))
    save_checkpoint(tmp_path, "run", long, {})
    with pytest.raises(ConfigError):
        load_checkpoint(tmp_path, "run")


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, "run", sample_snapshot(1), {"n": 1})

    def crash(payload, file):
        file.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, "run", sample_snapshot(2), {"n": 2})
    monkeypatch.undo()
    loaded, extra = load_checkpoint(tmp_path, "run")
    assert loaded.version == 1 and extra == {"n": 1}
    assert os.listdir(tmp_path) == [CHECKPOINT_FILE]


# ---- DiLoCo ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("outer_lr, mu", [(0.7, 0.9), (1.0, 0.0), (0.3, 0.5)])
def test_diloco_outer_step_is_torch_nesterov_sgd_on_the_pseudo_gradient(outer_lr, mu):
    model, optimizer = model_and_optimizer(0)
    strategy = attach(DiLoCo(inner_steps=3, outer_lr=outer_lr, outer_momentum=mu), model, optimizer)
    reference = [p.detach().clone().requires_grad_(True) for p in strategy.params]
    outer = torch.optim.SGD(reference, lr=outer_lr, momentum=mu, nesterov=mu > 0)
    generator = torch.Generator().manual_seed(7)
    for _ in range(4):
        with torch.no_grad():  # local training moves the parameters
            for p in strategy.params:
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
        for ref, p in zip(reference, strategy.params):
            ref.grad = (ref.detach() - p.detach()).clone()  # start - now
        outer.step()
        strategy.solo_step()
        for ref, p, start in zip(reference, strategy.params, strategy.start):
            torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-6)
            assert torch.equal(start, p.detach())


def test_diloco_outer_step_uses_the_averaged_delta():
    """A swarm step replaces the local delta by the swarm's average before the outer step."""
    model, optimizer = model_and_optimizer(0)
    strategy = attach(DiLoCo(outer_lr=0.7, outer_momentum=0.9), model, optimizer)
    reference = [p.detach().clone().requires_grad_(True) for p in strategy.params]
    outer = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for round_index in range(3):
        averaged = [torch.randn(p.shape, generator=torch.Generator().manual_seed(round_index)) for p in strategy.params]
        for delta, value, ref in zip(strategy.delta, averaged, reference):
            delta.copy_(value)
            ref.grad = value.clone()
        strategy._outer_step()
        outer.step()
        for ref, p in zip(reference, strategy.params):
            torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-6)
    for momentum, ref in zip(strategy.momentum, reference):
        torch.testing.assert_close(momentum, outer.state[ref]["momentum_buffer"], rtol=0, atol=1e-6)


def test_diloco_after_backward_steps_locally_and_counts():
    model, optimizer = model_and_optimizer(0, lr=0.5)
    tracker = FakeTracker()
    strategy = attach(DiLoCo(inner_steps=3), model, optimizer, tracker)
    due = []
    for step in range(3):
        before = [p.detach().clone() for p in strategy.params]
        grads = set_grads(strategy.params, step)
        due.append(strategy.after_backward(batch_size=8))
        for p, b, g in zip(strategy.params, before, grads):
            torch.testing.assert_close(p.detach(), b - 0.5 * g)
            assert p.grad is None
    assert due == [False, False, True]
    assert tracker.local.samples == 24 and tracker.local.steps == 3


def test_diloco_step_is_due_when_the_swarm_moves_on():
    model, optimizer = model_and_optimizer(0)
    ahead = PeerProgress("other", 1, 0.0, 0.0, 0.0, False)
    strategy = attach(DiLoCo(inner_steps=100), model, optimizer, FakeTracker((ahead,)))
    set_grads(strategy.params, 0)
    assert strategy.after_backward(4)
    averaging = PeerProgress("other", 0, 0.0, 0.0, 0.0, True)
    strategy = attach(DiLoCo(inner_steps=100), model, optimizer, FakeTracker((averaging,)))
    set_grads(strategy.params, 0)
    assert strategy.after_backward(4)


def test_diloco_state_tensors():
    model, optimizer = model_and_optimizer(0)
    strategy = attach(DiLoCo(), model, optimizer)
    momentum = {f"momentum/{i}": torch.randn(p.shape) for i, p in enumerate(strategy.params)}
    with torch.no_grad():
        for p in strategy.params:
            p.add_(1.0)
    strategy.load_state_tensors(momentum)
    for i, m in enumerate(strategy.momentum):
        assert torch.equal(m, momentum[f"momentum/{i}"])
        assert torch.equal(strategy.start[i], strategy.params[i].detach())
    assert set(strategy.state_tensors()) == set(strategy.expected_state()) == set(momentum)
    # a state that does not fit is refused by TrainingState.restore before anything is loaded
    state = TrainingState(model, optimizer, strategy)
    for wrong in ({}, {**momentum, "momentum/0": torch.zeros(1)}):
        snapshot = StateSnapshot.capture(1, {**{f"model/{k}": v for k, v in model.state_dict().items()},
                                             **{f"strategy/{k}": v for k, v in wrong.items()}})
        with pytest.raises(StateMismatch):
            state.restore(snapshot)


# ---- SyncSGD ---------------------------------------------------------------------------------------


def test_sync_accumulates_batch_weighted_gradients_without_stepping():
    model, optimizer = model_and_optimizer(0)
    tracker = FakeTracker()
    strategy = attach(SyncSGD(target_batch_size=8), model, optimizer, tracker)
    before = [p.detach().clone() for p in strategy.params]
    g1 = set_grads(strategy.params, 1)
    assert not strategy.after_backward(3)
    assert all(p.grad is None for p in strategy.params)
    g2 = set_grads(strategy.params, 2)
    assert strategy.after_backward(5)  # 8 samples reached
    for total, a, b in zip(strategy.accumulated, g1, g2):
        torch.testing.assert_close(total, 3 * a + 5 * b)
    for p, b in zip(strategy.params, before):
        assert torch.equal(p.detach(), b)  # no optimizer step yet
    assert tracker.local.samples == 8


def test_sync_counts_the_swarms_samples():
    model, optimizer = model_and_optimizer(0)
    other = PeerProgress("other", 0, 100.0, 3.0, 10.0, False)
    strategy = attach(SyncSGD(target_batch_size=64), model, optimizer, FakeTracker((other,)))
    set_grads(strategy.params, 0)
    assert strategy.after_backward(1)


def accumulate(strategy, batches: list[int]) -> list[torch.Tensor]:
    """Feed batches; returns the expected mean gradient."""
    total = [torch.zeros(p.shape) for p in strategy.params]
    for seed, size in enumerate(batches):
        for t, g in zip(total, set_grads(strategy.params, 10 + seed)):
            t.add_(g, alpha=size)
        strategy.after_backward(size)
    return [t / sum(batches) for t in total]


def test_sync_swarm_step_averages_the_mean_gradient_and_steps_once():
    model, optimizer = model_and_optimizer(0, lr=0.1)
    strategy = attach(SyncSGD(target_batch_size=8), model, optimizer)
    mean = accumulate(strategy, [3, 5])
    before = [p.detach().clone() for p in strategy.params]
    strategy.averager = FakeAverager(strategy.accumulated, ok=False)
    outcome = run_async(strategy.swarm_step(epoch=0, attempt=0))
    assert not outcome.applied
    for p, b in zip(strategy.params, before):
        assert torch.equal(p.detach(), b)  # a failed round changes nothing
    strategy.averager.ok = True
    outcome = run_async(strategy.swarm_step(epoch=0, attempt=1))  # a retry must not divide again
    assert outcome.applied
    for call in strategy.averager.calls:
        assert call["weight"] == 8
        for seen, want in zip(call["values"], mean):
            torch.testing.assert_close(seen, want)
    for p, b, m in zip(strategy.params, before, mean):
        torch.testing.assert_close(p.detach(), b - 0.1 * m)
        assert p.grad is None
    assert all(not t.any() for t in strategy.accumulated)


def test_sync_solo_step_applies_the_mean_gradient():
    """Alone in the run (no swarm step attempted), the epoch ends on this peer's mean gradient."""
    model, optimizer = model_and_optimizer(0, lr=0.1)
    strategy = attach(SyncSGD(target_batch_size=8), model, optimizer)
    mean = accumulate(strategy, [3, 5])
    before = [p.detach().clone() for p in strategy.params]
    strategy.solo_step()
    for p, b, m in zip(strategy.params, before, mean):
        torch.testing.assert_close(p.detach(), b - 0.1 * m)
    assert all(not t.any() for t in strategy.accumulated)


def test_sync_keeps_no_state():
    model, optimizer = model_and_optimizer(0)
    strategy = attach(SyncSGD(), model, optimizer)
    accumulate(strategy, [2])
    assert strategy.state_tensors() == {} == strategy.expected_state()
    strategy.load_state_tensors({})
    assert all(not t.any() for t in strategy.accumulated)  # old gradients are dropped
    snapshot = StateSnapshot.capture(1, {**{f"model/{k}": v for k, v in model.state_dict().items()},
                                         "strategy/momentum/0": torch.zeros(1)})
    with pytest.raises(StateMismatch):
        TrainingState(model, optimizer, strategy).restore(snapshot)


# ---- strategy settings -----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [SyncSGD(128), DiLoCo(10, 0.5, 0.8), GossipSGD(7), SyncSGD(), DiLoCo(),
                                      GossipSGD()])
def test_strategy_config_round_trip(strategy):
    config = json.loads(json.dumps(strategy.config()))  # as a manifest carries it
    again = strategy_from_dict(config)
    assert type(again) is type(strategy) and again.config() == strategy.config()


@pytest.mark.parametrize("data", [{"name": "adam"}, {}, {"name": "sync", "lr": 1.0}, {"name": "diloco", "steps": 3},
                                  {"name": "sync", "target_batch_size": 0}, {"name": "gossip", "every": 0}])
def test_strategy_from_dict_refuses_bad_settings(data):
    with pytest.raises(ConfigError):
        strategy_from_dict(data)


@pytest.mark.parametrize("make", [
    lambda: DiLoCo(inner_steps=0), lambda: DiLoCo(outer_lr=0), lambda: DiLoCo(outer_lr=11),
    lambda: DiLoCo(outer_momentum=1.0), lambda: DiLoCo(outer_momentum=-0.1), lambda: SyncSGD(0),
    lambda: SyncSGD(10**9 + 1), lambda: GossipSGD(0), lambda: GossipSGD(2_000_000),
])
def test_strategy_settings_are_validated(make):
    with pytest.raises(ConfigError):
        make()


def test_strategy_and_averaging_combinations():
    for strategy in (DiLoCo(), SyncSGD()):
        with pytest.raises(ConfigError, match="gossip"):
            strategy.check(Gossip())
        strategy.check(Moshpit())
    GossipSGD().check(Gossip())
    GossipSGD().check(Moshpit())
    model, optimizer = model_and_optimizer(0)
    with pytest.raises(ConfigError):
        Peer(model, optimizer, run_id="combo", strategy=DiLoCo(), averaging=Gossip())
    with pytest.raises(ConfigError):
        Peer(model, optimizer, run_id="combo", strategy=SyncSGD(), averaging=Gossip())


# ---- progress -------------------------------------------------------------------------------------


def test_swarm_progress_aggregates():
    empty = SwarmProgress()
    assert empty.epoch == 0 and empty.mean_steps_in(0) == 0.0 and empty.samples_in(0) == 0
    assert not empty.averaging_in(0) and empty.samples_per_second == 0
    peers = (PeerProgress("a", 2, 10.0, 4.0, 5.0, False), PeerProgress("b", 2, 30.0, 8.0, 7.0, True),
             PeerProgress("c", 1, 99.0, 50.0, 1.0, False))
    swarm = SwarmProgress(peers)
    assert swarm.epoch == 2
    assert [p.peer_id for p in swarm.at(2)] == ["a", "b"] and swarm.at(3) == []
    assert swarm.samples_in(2) == 40.0 and swarm.samples_in(1) == 99.0
    assert swarm.mean_steps_in(2) == 6.0 and swarm.mean_steps_in(1) == 50.0
    assert swarm.averaging_in(2) and not swarm.averaging_in(1)
    assert swarm.samples_per_second == 13.0


def test_local_progress_counts_and_rates():
    local = LocalProgress()
    local.add(8)
    local.add(4)
    assert (local.samples, local.steps, local.total_samples, local.total_steps) == (12, 2, 12, 2)
    local.update_rates()  # less than 0.2 s since the mark: nothing to measure yet
    local._rate_mark = (time.monotonic() - 2.0, 0, 0)
    local.update_rates()
    assert local.samples_per_second == pytest.approx(6.0, rel=0.02)
    assert local.steps_per_second == pytest.approx(1.0, rel=0.02)
    local._rate_mark = (time.monotonic() - 1.0, local.total_samples, local.total_steps)
    for _ in range(4):
        local.add(4)
    local.update_rates()  # 16 samples/s now; smoothed toward it
    assert local.samples_per_second == pytest.approx(6.0 + 0.3 * (16.0 - 6.0), rel=0.02)
    assert local.steps_per_second == pytest.approx(1.0 + 0.3 * (4.0 - 1.0), rel=0.02)


def progress_record(**changes):
    fields = dict(epoch=1, samples=10, steps=2, samples_per_second=3.0, steps_per_second=0.5, updated_at=time.time())
    return ProgressRecord(**{**fields, **changes})


@pytest.mark.parametrize("changes", [
    {"epoch": -1}, {"samples": -5}, {"steps": -1}, {"samples_per_second": math.nan}, {"steps_per_second": math.nan},
    {"samples_per_second": math.inf}, {"samples_per_second": -1.0}, {"samples_per_second": 2e9},
    {"updated_at": math.nan}, {"epoch": "1"},
])
def test_progress_record_rejects_bad_values(changes):
    with pytest.raises(pydantic.ValidationError):
        progress_record(**changes)


def test_progress_record_accepts_good_values():
    record = progress_record(averaging=True)
    assert record.epoch == 1 and record.averaging and not record.left


# ---- run manifests --------------------------------------------------------------------------------


def manifest(task="digits", settings=None, fingerprint="fp", created_at=100.0, version=__version__) -> RunManifest:
    return RunManifest(task=task, settings=json.dumps(settings or {"strategy": {"name": "diloco"}}, sort_keys=True),
                       version=version, data_fingerprint=fingerprint, created_at=created_at)


def test_manifest_create_options_and_digest():
    settings = {"strategy": DiLoCo(5).config(), "averaging": Moshpit(4).to_dict(), "lr": 0.1}
    created = RunManifest.create("digits", settings, "abc")
    assert created.version == __version__ and created.task == "digits" and created.data_fingerprint == "abc"
    assert created.options == settings
    assert abs(created.created_at - time.time()) < 60
    # the digest covers what is trained and how, not when
    later = RunManifest.create("digits", dict(reversed(list(settings.items()))), "abc")
    assert later.digest == created.digest
    assert RunManifest.create("charlm", settings, "abc").digest != created.digest
    assert RunManifest.create("digits", {**settings, "lr": 0.2}, "abc").digest != created.digest
    assert RunManifest.create("digits", settings, "other").digest != created.digest
    assert RunManifest.create("digits", settings, None).digest != created.digest


@pytest.mark.parametrize("settings", ["not json", "[1, 2]", "3"])
def test_manifest_options_must_be_a_json_object(settings):
    bad = RunManifest(task="t", settings=settings, version=__version__, created_at=1.0)
    with pytest.raises(ConfigError):
        bad.options


def test_check_compatible():
    major, minor, *_ = __version__.split(".")
    check_compatible(manifest(), "digits", "fp")
    check_compatible(manifest(), None, None)
    check_compatible(manifest(fingerprint=None), "digits", "anything")
    check_compatible(manifest(version=f"{major}.{minor}.99"), "digits", "fp")
    with pytest.raises(StartupError, match="swarmgrad"):
        check_compatible(manifest(version=f"{major}.{int(minor) + 1}.0"), "digits", "fp")
    with pytest.raises(StartupError):
        check_compatible(manifest(version=f"{int(major) + 1}.{minor}.0"), "digits", "fp")
    with pytest.raises(StartupError, match="charlm"):
        check_compatible(manifest(), "charlm", "fp")
    with pytest.raises(StartupError, match="data"):
        check_compatible(manifest(), "digits", "other-fp")


class FakeManifestNode:
    def __init__(self, bodies):
        self.bodies, self.keys = bodies, []

    async def get_records(self, key, body_type):
        self.keys.append((key, body_type))
        return {f"peer{i}": SimpleNamespace(body=body) for i, body in enumerate(self.bodies)}


def choose(bodies) -> RunManifest | None:
    node = FakeManifestNode(bodies)
    chosen = run_async(read_manifest(node, "my-run"))
    assert node.keys == [(manifest_key("my-run"), RunManifest)]
    return chosen


def test_read_manifest_takes_the_most_votes_then_the_earliest():
    assert choose([]) is None
    old_minority = manifest(task="old", created_at=1.0)
    majority = [manifest(created_at=50.0), manifest(created_at=20.0), manifest(created_at=30.0)]
    chosen = choose([old_minority, *majority])
    assert chosen.task == "digits" and chosen.created_at == 20.0
    tie = choose([manifest(task="b", created_at=9.0), manifest(task="a", created_at=5.0),
                  manifest(task="b", created_at=12.0), manifest(task="a", created_at=7.0)])
    assert tie.task == "a" and tie.created_at == 5.0


# ---- averaging settings ---------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: Moshpit(min_group_size=1), lambda: Moshpit(group_size=3, min_group_size=4), lambda: Moshpit(group_size=1025),
    lambda: Moshpit(matchmaking_seconds=0.01), lambda: Moshpit(matchmaking_seconds=601),
    lambda: Moshpit(round_timeout=0.5), lambda: Moshpit(round_timeout=4000), lambda: Gossip(fanout=0),
    lambda: Gossip(fanout=17), lambda: Gossip(push_timeout=0.5), lambda: Gossip(push_timeout=601),
])
def test_averaging_settings_are_validated(make):
    with pytest.raises(ConfigError):
        make()


@pytest.mark.parametrize("settings", [Moshpit(), Moshpit(4, 3, 0.5, 30.0), Gossip(), Gossip(3, 5.0)])
def test_averaging_round_trip(settings):
    data = json.loads(json.dumps(settings.to_dict()))
    assert data["kind"] == settings.kind
    assert averaging_from_dict(data) == settings


@pytest.mark.parametrize("data", [{"kind": "allreduce"}, {}, {"kind": "gossip", "group_size": 4},
                                  {"kind": "moshpit", "group_size": 1}])
def test_averaging_from_dict_refuses_bad_settings(data):
    with pytest.raises(ConfigError):
        averaging_from_dict(data)
